"""Two datasets mixed by dataset_weights — a Ray Dataset and an annotation file in another folder —
trained end to end through `DisaggregatedTrainer`, disjoint (vision 1 + text TP2, 3 workers), with
packed rows, token-budget micro-batches and a decoding process per rank, and experiment tracking
read back: TensorBoard event files (default) and MLflow (local file store), compared with the
metrics history. One fit covers all of it (each Ray fit costs ~15 s of start-up on a 2-core
machine)."""

import os

import pyarrow as pa
import pytest
import ray
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.train.callbacks import read_history
from ray_dhp.train.tracking import TENSORBOARD_DIR
from tests.ray.tensorboard_events import read_scalars


def _ray_dataset(data):
    """The annotation file as a Ray Dataset whose preprocessing makes the image paths absolute
    (the spooled rows are its output; no data_root: a wrong path would be a skipped sample)."""
    root = str(data.parent)

    def absolute_images(t):
        paths = [None if p is None else f"{root}/{p}" for p in t.column("image").to_pylist()]
        return t.set_column(t.schema.get_field_index("image"), "image", pa.array(paths, pa.string()))

    return ray.data.read_json(str(data)).map_batches(absolute_images, batch_format="pyarrow")


def test_a_ray_dataset_and_a_path_mixed_by_weight_train_and_report_to_tensorboard_and_mlflow(
        ray_start, fast_reports, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    # "more" is larger than "shapes": its images 004-007 exist only in its own folder, so a wrong
    # per-dataset root would show up as extra skipped samples; "shapes" (a Ray Dataset) has a
    # line whose image does not exist, "more" (a path) a malformed line
    shapes = demo.make_dataset(tmp_path / "shapes", num_samples=4, seed=1,
                               bad_lines=[(2, "missing_image")])
    more = demo.make_dataset(tmp_path / "more", num_samples=8, seed=2, text_only_every=3,
                             bad_lines=[(5, "malformed_json")])
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(), text=ModuleParallel(tensor_parallel=2),
                    placement="disjoint")
    uri, spools = f"file://{tmp_path / 'mlruns'}", tmp_path / "spools"
    result = DisaggregatedTrainer(
        train_loop_config=dict(lr=3e-3, global_batch_size=4, num_steps=3, log_every=2,
                               dataset_weights={"shapes": 1, "more": 2},
                               packing=True, max_tokens=64, micro_batch_tokens=64,
                               data_workers=1, index_dir=str(spools),
                               mlflow={"tracking_uri": uri, "experiment_name": "dhp_test"}),
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1}),
        # MLflow 3 refuses its file store unless told otherwise (users point at a server)
        run_config=ray.train.RunConfig(name="mix", storage_path=str(tmp_path / "runs"),
                                       worker_runtime_env={"env_vars": {"MLFLOW_ALLOW_FILE_STORE": "true"}}),
        datasets={"shapes": _ray_dataset(shapes), "more": str(more)},
    ).fit()
    m = result.metrics
    # 12 good samples take 14 draws: shapes 5 (4 + 1 into its 2nd epoch), more 9 (8 + 1)
    assert m["step"] == 3 and m["loss"] > 0
    assert m["skipped_samples"] == 2  # one bad line per dataset, each counted once
    assert m["epoch"] == 1  # both datasets finished their first pass
    assert m["dataset_draws"] == {"shapes": 5, "more": 9}  # 1:2 of 14 draws, to within one
    assert m["dataset_epochs"] == {"shapes": 1, "more": 1}
    # the run ended successfully: the Ray Dataset's spool (`shapes.<run key>.jsonl`) was written
    # there and is gone (`release_spools`); the path's index stays (it serves the next run)
    assert spools.is_dir() and not list(spools.glob("shapes.*"))
    assert list(spools.glob("data.jsonl.*.idx"))

    # tracking: the first step, every log_every-th and the last are reported, to both trackers
    hist = read_history(result)
    steps = [h["step"] for h in hist]
    assert steps == [1, 2, 3]
    scalars = read_scalars(os.path.join(result.path, TENSORBOARD_DIR))
    for tag in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_mb_per_rank/2"):
        assert sorted(scalars[tag]) == steps, tag
    # event files store float32
    assert scalars["loss"] == {h["step"]: pytest.approx(h["loss"], rel=1e-6) for h in hist}
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("dhp_test")
    (run,) = client.search_runs([exp.experiment_id])
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert loss == {h["step"]: pytest.approx(h["loss"], rel=1e-12) for h in hist}
    assert run.data.params["num_steps"] == "3" and run.data.params["dhp.placement"] == "disjoint"
