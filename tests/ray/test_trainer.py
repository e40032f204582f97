"""DisaggregatedTrainer end to end on Ray Train V2 (CPU, gloo). (A Ray Dataset mixed with a path,
disjoint, packed: `test_mixture.py`.)"""

import pytest
import ray
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.train.callbacks import read_history


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8)
    yield
    if started:
        ray.shutdown()


def _trainer(tmp_path, dhp, datasets, **loop):
    cfg = dict(lr=3e-3, global_batch_size=4, num_steps=12, seed=0, log_every=4)
    cfg.update(loop)
    return DisaggregatedTrainer(
        train_loop_config=cfg,
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=dhp.num_workers,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="t", storage_path=str(tmp_path / "runs")),
        datasets=datasets,
    )


def test_collocated_sp2_tp2_trains_and_reports(ray_cluster, tmp_path):
    data = demo.make_dataset(tmp_path / "data", num_samples=32)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    result = _trainer(tmp_path, dhp, {"train": str(data)}).fit()
    for key in ("loss", "step", "tokens_per_s", "grad_norm", "lr", "skipped_samples"):
        assert key in result.metrics
    assert result.metrics["step"] == 12 and result.metrics["tokens_per_s"] > 0
    assert result.metrics["model_tflops_per_s_per_rank"] > 0 and result.metrics["time_data_wait_s"] >= 0
    assert "mfu" not in result.metrics  # no known peak on CPU
    hist = read_history(result)
    assert [h["step"] for h in hist] == [1, 4, 8, 12]
    assert hist[-1]["loss"] < 0.8 * hist[0]["loss"], [h["loss"] for h in hist]


def test_wrong_worker_count_fails_before_workers_start(tmp_path):
    dhp = DHPConfig(model=demo.tiny_model_config(), vision=ModuleParallel(sequence_parallel=2),
                    text=ModuleParallel(tensor_parallel=2))
    with pytest.raises(ValueError, match="needs 2 workers"):
        DisaggregatedTrainer(dhp_config=dhp, datasets={"train": str(tmp_path)},
                             scaling_config=ray.train.ScalingConfig(num_workers=4))
    with pytest.raises(ValueError, match="did you mean 'num_steps'"):
        DisaggregatedTrainer(dhp_config=dhp, datasets={"train": str(tmp_path)},
                             train_loop_config={"num_step": 3},
                             scaling_config=ray.train.ScalingConfig(num_workers=2))


def test_bad_lines_are_skipped_and_reported(ray_cluster, tmp_path):
    data = demo.make_dataset(tmp_path / "data", num_samples=10,
                             bad_lines=[(2, "missing_image"), (6, "malformed_json")])
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor())
    result = _trainer(tmp_path, dhp, {"train": str(data)}, num_steps=3, log_every=3).fit()
    assert result.metrics["skipped_samples"] == 2
    assert result.metrics["step"] == 3


@pytest.mark.slow
def test_strict_bad_data_fails_naming_the_line(ray_cluster, tmp_path):
    data = demo.make_dataset(tmp_path / "data", num_samples=6, bad_lines=[(3, "corrupt_image")])
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor())
    with pytest.raises(Exception, match=r"data.jsonl:4"):
        _trainer(tmp_path, dhp, {"train": str(data)}, num_steps=2, global_batch_size=6,
                 bad_data="strict").fit()


@pytest.mark.slow
def test_three_modules_audio_vision_text_train_end_to_end(ray_cluster, tmp_path):
    """A Qwen2.5-Omni thinker with an audio group (issue #33) through `DisaggregatedTrainer`:
    disjoint vision 1 + audio 2 + text 1 workers on a mixed set (images, clips, a record with
    both, text-only, videos); the loss falls and no sample is skipped."""
    from ray_dhp.demo.omni import make_omni_dataset

    data = make_omni_dataset(tmp_path / "data", images=12, clips=8, videos=2)
    dhp = DHPConfig(model=demo.tiny_model_config("qwen2_5_omni"),
                    processor=demo.tiny_processor("qwen2_5_omni"), placement="disjoint",
                    vision=ModuleParallel(), audio=ModuleParallel(data_parallel=2),
                    text=ModuleParallel())
    assert dhp.num_workers == 4
    result = _trainer(tmp_path, dhp, {"train": str(data)}, num_steps=8, log_every=4).fit()
    assert result.metrics["step"] == 8 and result.metrics["skipped_samples"] == 0
    hist = read_history(result)
    assert hist[-1]["loss"] < hist[0]["loss"], [h["loss"] for h in hist]
