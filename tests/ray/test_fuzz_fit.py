"""Fuzz end to end: `DisaggregatedTrainer.fit()` on Ray over the hostile record set (skip mode):
the run finishes and reports every hostile record as skipped, once."""

import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, demo
from tests.hostile_data import make_hostile_dataset


def test_fit_skips_exactly_the_hostile_records(ray_start, fast_reports, tmp_path):
    path, bad_at, odd_at = make_hostile_dataset(tmp_path / "data")
    valid = 40 + len(odd_at)
    batch = 16
    steps = -(-valid // batch) + 1  # more valid samples than one pass holds: every record drawn
    trainer = DisaggregatedTrainer(
        train_loop_config=dict(global_batch_size=batch, num_steps=steps, log_every=steps,
                               max_tokens=2048, max_bad_fraction=0.5),
        dhp_config=DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor()),
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="fuzz", storage_path=str(tmp_path / "runs")),
        datasets={"train": str(path)},
    )
    result = trainer.fit()
    assert result.metrics["step"] == steps
    assert result.metrics["skipped_samples"] == len(bad_at)
    assert result.metrics["loss"] > 0
