"""Context parallelism through the public entry points: `DisaggregatedTrainer` and ``ray-dhp train
RUN.yaml`` with ``text.context_parallel: 2`` train the same losses as the CP1 run of the same
data (text TP2, the same 2 workers).

Tolerance: the entry points train in fp32 (no fp64 policy), so the two runs differ by summation
orders only (the CP2 run sums the loss, the gradients and the fp32 matmuls over sequence slices;
the TP2 run over hidden shards). tests/distributed/parity.py derives 1e-5 relative for the loss
and every step-1 gradient from N ~ 2e4-term fp32 sums (sqrt(N) u ~ 9e-6). After the first AdamW
update the runs' parameters differ by what those gradients' errors become through AdamW's
per-entry normalisation (entries with gradients near eps move by up to lr depending on the
order, parity.py), so later losses are compared at 1e-4: a wrong slice, a missing all-to-all or
a doubled gradient changes the step-2 loss by O(1e-2) relative or more. Measured (2026-12-03,
3 steps each): worst relative difference 8.4e-8 (trainer) and 8.5e-8 (CLI). The exact check of
the same mechanism is the fp64 matrix in tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.train.callbacks import read_history

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
STEP1_TOL, LATER_TOL = 1e-5, 1e-4  # fp32, see the module docstring


def _assert_same_losses(cp2: list, cp1: list) -> None:
    assert len(cp2) == len(cp1) >= 3, (cp2, cp1)
    for i, (a, b) in enumerate(zip(cp2, cp1)):
        assert abs(a - b) <= (STEP1_TOL if i == 0 else LATER_TOL) * abs(b), (i, cp2, cp1)
    print("losses cp2", cp2, "cp1", cp1, "worst relative",
          max(abs(a - b) / abs(b) for a, b in zip(cp2, cp1)))


def _fit(tmp_path, data, text: ModuleParallel, name: str) -> list:
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=text)
    trainer = DisaggregatedTrainer(
        train_loop_config=dict(lr=3e-3, global_batch_size=4, num_steps=3, seed=0, log_every=1),
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=dhp.num_workers,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=str(tmp_path / "runs")),
        datasets={"train": str(data)})
    return [h["loss"] for h in read_history(trainer.fit())]


@pytest.mark.slow
def test_trainer_cp2_trains_the_cp1_losses(ray_start, fast_reports, tmp_path):
    data = demo.make_dataset(tmp_path / "data", num_samples=16)
    cp2 = _fit(tmp_path, data, ModuleParallel(context_parallel=2), "cp2")
    cp1 = _fit(tmp_path, data, ModuleParallel(tensor_parallel=2), "cp1")
    _assert_same_losses(cp2, cp1)


def _cli(tmp_path, name: str, *overrides) -> list:
    from ray_dhp.cli import main

    assert main(["train", TINY, "optim.num_steps=3", "optim.log_every=1", "data.demo_samples=16",
                 f"run.storage_path={tmp_path}", f"run.name={name}", *overrides]) == 0
    lines = (tmp_path / name / "ray_dhp_metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if x.strip()]


@pytest.mark.slow
def test_cli_train_with_context_parallel_2(ray_start, fast_reports, tmp_path):
    """``ray-dhp train examples/tiny.yaml text.context_parallel=2 text.tensor_parallel=1``: the
    run file's layout with the LM's sequence over 2 CP ranks instead of 2 TP ranks."""
    cp2 = _cli(tmp_path, "cp2", "text.context_parallel=2", "text.tensor_parallel=1")
    cp1 = _cli(tmp_path, "cp1")
    _assert_same_losses(cp2, cp1)
