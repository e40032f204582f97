"""`optim.balance: cost` end to end under Ray Train: the train loop hands the loader the engine's
balancer, so mixed-resolution pixels reach the vision replica the balanced plan assigns (a
mismatch stops the step with "no pixels here"), and both balance modes train to the same loss."""

import pytest
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo


def _fit(tmp_path, data, balance):
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(max_side=224),
                    vision=ModuleParallel(data_parallel=2), text=ModuleParallel(data_parallel=2))
    cfg = dict(lr=3e-3, global_batch_size=8, micro_batches=2, num_steps=2, seed=0, log_every=1,
               balance=balance)
    return DisaggregatedTrainer(
        train_loop_config=cfg, dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=balance, storage_path=str(tmp_path / "runs")),
        datasets={"train": str(data)}).fit()


@pytest.mark.slow  # ~3 min on 2 cores; the default run covers loader/engine agreement in
# tests/distributed/test_loader.py and exactness in tests/distributed/test_balance.py
def test_cost_balance_trains_like_count_on_mixed_resolutions(ray_start, fast_reports, tmp_path):
    data = demo.make_dataset(tmp_path / "data", num_samples=16, text_only_every=4,
                             image_sizes=((56, 56), (224, 224), (112, 112)))
    cost, count = _fit(tmp_path, data, "cost"), _fit(tmp_path, data, "count")
    assert cost.metrics["step"] == count.metrics["step"] == 2
    # the same samples and update, whatever the plan (fp32 here: 1e-5 relative is ~10x the
    # summation-order noise of two steps of this model; fp64 exactness: test_balance.py)
    assert abs(cost.metrics["loss"] - count.metrics["loss"]) <= 1e-5 * count.metrics["loss"]
