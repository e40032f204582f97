"""Evaluation end to end on Ray Train V2 (issue #14): a validation set, ``eval_every``, and
``CheckpointConfig(checkpoint_score_attribute="eval_loss")`` keeping the best checkpoint; the train
set is a file, the validation set a Ray Dataset."""

import json
import os
from pathlib import Path

import pytest
import ray
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.train.callbacks import read_history


def _ray_dataset(path):
    """The annotation file as a Ray Dataset, image paths made absolute (the train set's images are
    relative to its own folder, which data_root would override for both)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if "image" in r:
            r["image"] = str(path.parent / r["image"])
    return ray.data.from_items(rows)


def test_fit_with_validation_keeps_the_best_checkpoint_by_eval_loss(ray_start, fast_reports, tmp_path):
    train = demo.make_dataset(tmp_path / "train", num_samples=8)
    val = demo.make_dataset(tmp_path / "val", num_samples=5, seed=7, text_only_every=2)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    # A high constant rate without clipping: the eval loss falls, then rises as the 8 training
    # samples are over-fitted, so the best checkpoint is not the latest.
    loop = dict(lr=2e-2, global_batch_size=4, num_steps=8, seed=0, log_every=1, max_grad_norm=None,
                eval_every=2, checkpoint_every=2, eval_batch_size=2)
    trainer = DisaggregatedTrainer(
        train_loop_config=loop, dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name="evalrun", storage_path=str(tmp_path / "runs"),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="eval_loss", checkpoint_score_order="min")),
        datasets={"train": str(train), "validation": _ray_dataset(val)})
    result = trainer.fit()

    hist = read_history(result)
    evals = {h["step"]: h["eval_loss"] for h in hist if "eval_loss" in h}
    assert sorted(evals) == [2, 4, 6, 8], [h["step"] for h in hist]  # eval_every and the end
    assert all(h["eval_samples"] == 5 and h["eval_tokens"] > 0 for h in hist if "eval_loss" in h)
    assert all("eval_loss" not in h for h in hist if h["step"] % 2)  # only at eval steps
    best_step = min(evals, key=evals.get)
    (best, metrics), = result.best_checkpoints  # num_to_keep=1: the best one only
    assert metrics["step"] == best_step and metrics["eval_loss"] == evals[best_step]
    assert os.path.basename(best.path) == f"checkpoint_{best_step:06d}"
    # measured eval losses 3.83, 3.31, 3.37, 3.45 (steps 2-8): the best is not the latest
    assert best_step < 8, evals
    # on disk: the best and (Ray keeps it for resuming) the latest; the others were deleted
    kept = sorted(d for d in os.listdir(result.path)
                  if d.startswith("checkpoint_") and d[len("checkpoint_"):].isdigit())
    assert kept == [f"checkpoint_{best_step:06d}", "checkpoint_000008"], kept
    assert os.path.basename(result.checkpoint.path) == "checkpoint_000008"
    assert result.metrics["step"] == 8 and result.metrics["eval_loss"] == evals[8]


@pytest.mark.slow
def test_tune_sweep_on_eval_loss(ray_start, fast_reports, tmp_path):
    """Tune requires its metric in every result; the first report (step 1) has no eval_loss, so
    only the evaluation reports (steps 2 and 3) may reach Tune."""
    from ray import tune

    from ray_dhp.tune import sweep

    val = demo.make_dataset(tmp_path / "val", num_samples=3, seed=3)
    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    grid = sweep(tiny, {"optim.lr": tune.grid_search([1e-6, 3e-3])}, metric="eval_loss",
                 overrides=["optim.num_steps=3", "optim.log_every=10", "data.demo_samples=16",
                            f"data.validation={val}", "data.eval_every=2",
                            "vision.sequence_parallel=1", "text.tensor_parallel=1",
                            f"run.storage_path={tmp_path}", "run.name=evalsweep"])
    assert len(grid) == 2 and not grid.errors
    evals = {r.config["optim.lr"]: r.metrics["eval_loss"] for r in grid}
    assert all(r.metrics["step"] == 3 for r in grid)  # the last result is the final evaluation
    best = grid.get_best_result()
    assert best.metrics["eval_loss"] == min(evals.values()) == evals[3e-3] < evals[1e-6]
