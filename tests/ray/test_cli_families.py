"""Every family through ``ray-dhp train RUN.yaml`` (issue #41): a run file naming the family's
tiny demo model (``model.demo``) or a model directory (``model.path``), its data file
(``data.train``) and its layout (`tests.ray.family_runs.degrees`: vision DP2 + text TP2 on 2
collocated workers; the Omni thinkers vision SP2 + audio DP2 + text TP2), trained by
`ray_dhp.cli.main`: every step's loss rank 0 wrote to ``ray_dhp_metrics.jsonl`` equals the
single-process stock model's on the same samples.

Tolerance: the run file has no fp64 policy (``precision.policy`` is fp32 or bf16), so the run and
the reference are fp32 and the losses are held to `tests.distributed.parity.FP32_TOL` (1e-5
relative, derived there: two summation orders of the ~2e4-term sums of a step differ by
~sqrt(N) u ~ 9e-6 of the terms; a real bug is O(1)); the fp64 version of every case is
`test_generic_trainer.py` through `DisaggregatedTrainer`.

Every case is ``-m slow`` (a Ray fit each, ~30-60 s on 2 cores): the default run keeps a CLI
training (`test_shared_machine.py`'s interrupted ``examples/tiny.yaml`` run) and every family's
fp64 parity through the engine (`tests/distributed/test_families.py`)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import FP32_TOL
from tests.ray.family_runs import AUDIO_FAMILIES, GENERIC_FAMILIES, HAND_FAMILIES, assert_losses

#: the optimizer section of every run file: 3 steps, warm-up then the default schedule, clipping
OPTIM = {"lr": 1e-3, "global_batch_size": 4, "num_steps": 3, "log_every": 1, "warmup_steps": 1,
         "max_grad_norm": 1.0, "seed": 0}


def _cli_losses(tmp_path, family: str, model: dict, processor=None) -> tuple:
    """Train ``family`` (run-file ``model`` section ``model``) with ``ray-dhp train RUN.yaml`` on
    its data (`family_runs.family_data`, made with ``processor``); returns ``(rank 0's metrics
    lines, the stock model's fp32 losses on the same samples)``."""
    import yaml

    from ray_dhp.cli import main
    from ray_dhp.run_file import run_file_from_dict
    from ray_dhp.train.callbacks import read_history
    from tests.ray.family_runs import degrees, family_data, reference_losses

    run = {"model": model, **degrees(family), "placement": "collocated", "optim": dict(OPTIM),
           "scaling": {"resources_per_worker": {"CPU": 1}},
           "run": {"name": f"cli_{family}", "storage_path": str(tmp_path / "runs")}}
    loop = run_file_from_dict(run).loop_config()  # what the CLI's loop will run (data: unset)
    data, steps = family_data(tmp_path, family, loop, processor=processor)
    run["data"] = {"train": str(data)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    ref = reference_losses(family, loop, steps, torch.float32, model=model.get("path"))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    return read_history(str(tmp_path / "runs" / f"cli_{family}")), ref


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERIC_FAMILIES + HAND_FAMILIES + AUDIO_FAMILIES)
def test_cli_trains_a_demo_family_exactly(family, tmp_path, ray_start):
    """``model.demo: <family>``: the family's tiny random-init model and demo processor."""
    history, ref = _cli_losses(tmp_path, family, {"demo": family})
    assert len(ref) == OPTIM["num_steps"]
    assert_losses(history, ref, FP32_TOL)


@pytest.mark.slow
def test_cli_trains_a_model_directory_with_its_own_processor(tmp_path, ray_start):
    """``model.path`` a Gemma 3 directory (weights and its own processor), ``data.train`` a file:
    the losses equal the stock model's from the same directory on the same processor's samples."""
    from ray_dhp.data.model_processor import run_processor
    from ray_dhp.demo.model_dirs import model_dir

    path = str(tmp_path / "model")
    model_dir("gemma3", path, weights=True, seed=3)
    history, ref = _cli_losses(tmp_path, "gemma3", {"path": path}, processor=run_processor(path, path))
    assert len(ref) == OPTIM["num_steps"]
    assert_losses(history, ref, FP32_TOL)
