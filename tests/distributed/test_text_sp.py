"""Megatron sequence parallelism in the language model (``text_sequence_parallel``) is exact:
the loss, grad-norm, every parameter and every update equal the single-process reference in
fp64 (tolerance 1e-10 as in ``test_parity.py``: only summation orders differ).

The batches are the parity batches (mixed image sizes, a text-only sample, 2 micro-batches,
clipping active); their lengths are mostly not multiples of tp, so the pad-and-mask path runs
in every case. Qwen3-VL covers the deepstack seam, packing the per-sample positions/masks
(M-RoPE positions passed in), activation checkpointing the recomputed sharded blocks.
"""

from __future__ import annotations

import pytest
import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import (FP32_TOL, assert_parity, make_steps, reference_fixture, run_engine,
                                      run_reference)

VARIANTS = {"plain": {}, "packing": {"packing": True},
            "checkpointing": {"activation_checkpointing": True}}


def _layout(placement, vision, text):
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp,
                text_sequence_parallel=True)


CASES = [  # (family, placement, vision (sp, dp), text (tp, dp), variant), first per family default
    ("qwen2_5_vl", "collocated", (2, 1), (2, 1), "packing"),
    ("qwen2_vl", "disjoint", (1, 1), (2, 1), "checkpointing"),
    ("qwen3_vl", "collocated", (2, 2), (2, 2), "plain"),
    ("qwen2_5_vl", "disjoint", (2, 1), (4, 1), "checkpointing"),
    ("qwen2_vl", "collocated", (4, 1), (4, 1), "packing"),
    ("qwen3_vl", "disjoint", (1, 1), (4, 1), "packing"),
    ("qwen3_vl", "collocated", (2, 1), (2, 1), "checkpointing"),
    ("qwen2_5_vl", "collocated", (2, 2), (2, 2), "plain"),
    ("qwen2_vl", "disjoint", (2, 1), (2, 2), "plain"),
]
DEFAULT = {c[0]: c for c in reversed(CASES[:3])}.values()


def _params():
    for case in CASES:
        fam, placement, v, t, variant = case
        marks = () if case in DEFAULT else (pytest.mark.slow,)
        yield pytest.param(*case, marks=marks,
                           id=f"{fam}-{placement}-sp{v[0]}dp{v[1]}-tp{t[0]}dp{t[1]}-sp-{variant}")


reference = reference_fixture()


@pytest.mark.parametrize("family, placement, vision, text, variant", list(_params()))
def test_text_sequence_parallel_is_exact_fp64(family, placement, vision, text, variant, reference):
    cfg, steps, ref = reference(family, **VARIANTS[variant])
    got = run_engine(family, _layout(placement, vision, text), cfg, steps, torch.float64)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
    lengths = {int(s.num_tokens) for st in steps for mb in st for s in mb}
    assert any(n % text[0] for n in lengths)  # the padding path ran
    if family == "qwen3_vl":  # the deepstack gradients were summed over the TP ranks
        assert any(k.endswith("/text.sp_deepstack") for k in got["per_rank"][-1]["comm"])


def test_text_sequence_parallel_fp32_within_parity_tolerance(tmp_path):
    """fp32 (the production dtype), the fp32 case of ``test_parity.py`` with text sequence
    parallelism on (vision SP 2, text TP 2 + SP, collocated): loss and grad-norm of all 5 steps
    and every rank's clipped step-1 gradient within ``FP32_TOL``. Its derivation (parity.py) covers
    this layout: the extra work is exact data movement (all-gather, slice, the shard re-gathered
    bit-identically in backward) and reduce-scatters of the input gradients over 2 ranks, which
    only reorder a 2-term sum; the weight gradients are the same ``tokens x width`` sums."""
    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=5, max_grad_norm=1.0, seed=0)
    steps = make_steps(tmp_path, "qwen2_5_vl", cfg)
    ref = run_reference("qwen2_5_vl", cfg, steps)
    got = run_engine("qwen2_5_vl", _layout("collocated", (2, 1), (2, 1)), cfg, steps, grads=True)
    assert_parity(got, ref, loss_tol=FP32_TOL, param_tol=None, update_tol=None,
                  grad_tol=FP32_TOL, grad_steps=1)
    for out in got["per_rank"]:
        assert all(torch.equal(p, ref["params0"][n]) for n, p in out["params0"].items())


@pytest.mark.slow
def test_text_sequence_parallel_under_bf16_autocast_with_checkpointing(tmp_path):
    """bf16 autocast (matmuls in bf16, fp32 state) with activation checkpointing: the projections
    that re-gather their input in backward compute in the forward's dtype (autocast is off in
    backward). Against the same layout without text SP (the reference cannot autocast the same
    matmuls): loss and grad-norm of 2 steps within 1e-2 relative, a few bf16 ulps (2^-8 = 4e-3;
    measured <= 1e-6); a wrong-dtype or missing gradient is O(1) or an error."""
    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=2, max_grad_norm=1.0, seed=0,
                          precision="bf16_autocast", activation_checkpointing=True)
    steps = make_steps(tmp_path, "qwen2_5_vl", cfg)
    base = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    tp = run_engine("qwen2_5_vl", base, cfg, steps)["history"]
    sp = run_engine("qwen2_5_vl", {**base, "text_sequence_parallel": True}, cfg, steps)["history"]
    for a, b in zip(tp, sp, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-2 * abs(a[key]), (key, a[key], b[key])
