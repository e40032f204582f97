"""Experiment tracking end to end: TensorBoard event files (default) and MLflow (local file store),
both read back and compared with the metrics history; and a quiet worker console."""

import os

import pytest
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.train.callbacks import read_history
from ray_dhp.train.tracking import TENSORBOARD_DIR
from tests.ray.tensorboard_events import read_scalars


def test_tensorboard_and_mlflow_get_every_reported_metric(ray_start, fast_reports, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    data = demo.make_dataset(tmp_path / "data", num_samples=16)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    text=ModuleParallel(tensor_parallel=2), vision=ModuleParallel(sequence_parallel=2))
    uri = f"file://{tmp_path / 'mlruns'}"
    trainer = DisaggregatedTrainer(
        train_loop_config=dict(lr=1e-3, global_batch_size=4, num_steps=4, log_every=2,
                               mlflow={"tracking_uri": uri, "experiment_name": "dhp_test"}),
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        # MLflow 3 refuses its file store unless told otherwise (users point at a server)
        run_config=ray.train.RunConfig(name="tracked", storage_path=str(tmp_path / "runs"),
                                       worker_runtime_env={"env_vars": {"MLFLOW_ALLOW_FILE_STORE": "true"}}),
        datasets={"train": str(data)})
    result = trainer.fit()
    hist = read_history(result)
    steps = [h["step"] for h in hist]
    assert steps == [1, 2, 4]

    scalars = read_scalars(os.path.join(result.path, TENSORBOARD_DIR))
    for tag in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_mb_per_rank/1"):
        assert sorted(scalars[tag]) == steps, tag
    # event files store float32
    assert scalars["loss"] == {h["step"]: pytest.approx(h["loss"], rel=1e-6) for h in hist}

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("dhp_test")
    (run,) = client.search_runs([exp.experiment_id])
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert loss == {h["step"]: pytest.approx(h["loss"], rel=1e-12) for h in hist}
    assert run.data.params["num_steps"] == "4" and run.data.params["dhp.placement"] == "collocated"
