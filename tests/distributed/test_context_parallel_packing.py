"""Packed rows under the LM's context parallelism (``data.packing`` with ``text.context_parallel``)
train exactly like the padded single-process reference.

The batches are test_packing.py's (``max_tokens=80``, samples of 30-43 tokens: 2-3 packed rows
per replica and micro-batch, several samples per row). Each packed row is cut into CP slices, so
a cut falls inside a sample (often inside an image's rows): the slice's positions come from each
sample's own rule on the whole row (`ray_dhp.data.collate.pack_text_batch`), its targets are
shifted within each sample, the boundary delivers each CP rank only the feature rows of its
slices, `cp_attention` runs causal attention per packed segment after the all-to-all, and the
head-sharded Gated DeltaNet layers (Qwen3.5) lay the rows out chunk-aligned and reset their
recurrence at every sample, so their conv window and state start at zero at every sample.
Qwen3.5 rows run that recurrence in fp64 on both sides, as test_packing.py's
(`fp64_delta_rule`).

Tolerances: test_packing.py's (here `assert_packed_parity`: 1e-10 relative on loss, grad-norm, every
parameter, every update of every rank's copy, and for Qwen3.5 every clipped gradient; its
fp32-computed norm weights and ``A_log`` at 1e-5, the fp32 sums that packing and CP both
regroup, derived there and in test_context_parallel.py). Qwen3.5 rows run 2 steps, not 3, as
test_packing.py's `TWO_STEPS` rows (text SP on packed rows) and for the same reason: CP also runs
the fp32-summed norm weights on sequence slices of packed rows, after step 2 they stand ~1e-9
apart and from step 3 every fp64 gradient follows (measured at CP2, step 3: loss 3.0e-10,
grad-norm 5.9e-9, updates up to 1.5e-8); steps 1-2 match everything at 1e-10, every clipped
gradient of every rank included, which is what packing under CP changes. Every row is slow (each runs 2-8
spawned ranks for 3 steps, 25-60 s); the negative controls show that a leak across a sample
boundary is far outside them.
"""

from dataclasses import replace

import pytest
import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.parallel.packed_rows import pack_bins
from tests.distributed.fp64_recurrence import fp64_delta_rule
from tests.distributed.parity import (packable_steps, assert_parity, copy_errors, reference_fixture,
                                      run_engine)

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1,
                      max_tokens=80)  # test_packing.py's
# Qwen3.5's fp32-computed weights (test_packing.py's `FP32_SUMS`): at 1e-5, the rest at 1e-10
FP32 = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight", "language_model.norm.weight", "linear_attn.A_log")



padded_reference = reference_fixture(cfg=CFG, make=packable_steps, name="padded_reference",
                                     prepare=fp64_delta_rule)


def assert_packed_parity(family, got, ref) -> tuple:
    """The module docstring's tolerances; the worst (update, parameter, name) of the rest."""
    if family != "qwen3_5":
        return assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10,
                          grad_tol=1e-10, skip=FP32)
    only = [{k: {n: t for n, t in o[k].items() if n.endswith(FP32)} for k in ("params", "params0")}
            for o in got["per_rank"]]
    errs = (copy_errors(only, ref["params"])
            + copy_errors(only, ref["params"], base="params0", ref_base=ref["params0"]))
    assert errs and max(errs)[0] < 1e-5, max(errs)
    return worst


def _layout(placement, vision, text, cp, text_zero=None):
    (sp, vdp), (tp, tdp) = vision, text
    out = dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp, text_cp=cp)
    if text_zero is not None:
        out["text_zero"] = text_zero
    return out


CASES = [  # (id, family, layout)
    ("qwen2_5_vl-cp2", "qwen2_5_vl", _layout("collocated", (2, 1), (1, 1), 2)),
    ("qwen2_5_vl-cp2-tp2", "qwen2_5_vl", _layout("collocated", (4, 1), (2, 1), 2)),
    ("qwen2_5_vl-cp2-disjoint", "qwen2_5_vl", _layout("disjoint", (1, 1), (1, 1), 2)),
    ("qwen2_vl-cp4", "qwen2_vl", _layout("collocated", (2, 2), (1, 1), 4)),
    ("qwen2_5_vl-cp2-dp2-zero3", "qwen2_5_vl", _layout("collocated", (2, 2), (1, 2), 2, 3)),
    ("qwen3_5-cp2", "qwen3_5", _layout("collocated", (2, 1), (1, 1), 2)),
    ("qwen3_5-cp2-tp2", "qwen3_5", _layout("collocated", (4, 1), (2, 1), 2)),
    ("qwen3_5-cp2-disjoint", "qwen3_5", _layout("disjoint", (1, 1), (1, 1), 2)),
]


def _steps(family: str) -> dict:
    """Qwen3.5 rows run 2 steps (module docstring)."""
    return {"num_steps": 2} if family == "qwen3_5" else {}


def _cuts_inside_samples(steps, cp: int) -> bool:
    """Whether some CP cut of a packed row falls strictly inside a sample (the case is
    meaningful: a sample's tokens are split between CP ranks), the rows laid out as the one text
    replica lays them out (`pack_bins`, in layout order)."""
    for st in steps:
        for mb in st:
            sizes = [int(s.num_tokens) for s in mb]
            rows = pack_bins(sizes, CFG.data.max_tokens)
            length = -(-max(sum(sizes[i] for i in r) for r in rows) // cp) * cp
            cuts = [length // cp * c for c in range(1, cp)]
            for r in rows:
                start = 0
                for i in r:
                    if any(start < cut < start + sizes[i] for cut in cuts):
                        return True
                    start += sizes[i]
    return False


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_packed_under_cp_equals_padded_fp64(family, layout, padded_reference):
    _, steps, ref = padded_reference(family, **_steps(family))
    assert _cuts_inside_samples(steps, layout["text_cp"])
    got = run_engine(family, layout, replace(CFG, packing=True, num_steps=len(steps)), steps, torch.float64,
                     grads=family == "qwen3_5", prepare=fp64_delta_rule if family == "qwen3_5" else None)
    worst = assert_packed_parity(family, got, ref)
    print(f"{family} packed {layout}: worst update error {worst[0]:.1e} ({worst[2]})")
    comm = got["per_rank"][-1]["comm"]  # the last rank hosts the LM in both placements
    assert any(k.endswith("/text.cp") for k in comm), comm  # the all-to-alls ran
    if family == "qwen3_5":
        assert any(k.endswith("/text.cp.mixer") for k in comm), comm


def _attention_across_samples():
    """Negative control's rank side: CP attention ignores the packed segments (causal over the
    whole row, so a sample sees the samples before it in its row)."""
    import ray_dhp.parallel.context as context

    def whole_row(q, k, v, cu_seqlens, scale=None, dropout=0.0):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    context.segment_attention = whole_row


def _state_across_samples():
    """Negative control's rank side: the head-sharded mixers lay their rows out with samples back
    to back (chunk 1, no conv gap) and a recurrence that never resets (the family's
    `StatefulMixer` that `cp_mixers` hands them), so the conv window and the recurrent state
    flow from one sample into the next (test_packing.py's `_without_state_reset`)."""
    from ray_dhp.models import qwen3_5

    fp64_delta_rule()
    (spec,) = qwen3_5.STATEFUL_MIXERS

    def no_reset(*args, starts, **kwargs):
        return spec.resetting(*args, starts=None, **kwargs)

    qwen3_5.STATEFUL_MIXERS = (replace(spec, chunk=1, window="", resetting=no_reset),)


@pytest.mark.slow
@pytest.mark.parametrize("family, prepare", [("qwen2_5_vl", _attention_across_samples),
                                             ("qwen3_5", _state_across_samples)],
                         ids=["attention-across-samples", "deltanet-state-across-samples"])
def test_leaks_across_samples_fail_parity(family, prepare, padded_reference):
    """Negative controls at CP2: attention over the whole packed row, or the Gated DeltaNet's
    state carried over the row, break parity (the loss is off beyond the tolerances)."""
    _, steps, ref = padded_reference(family, **_steps(family))
    got = run_engine(family, _layout("collocated", (2, 1), (1, 1), 2),
                     replace(CFG, packing=True, num_steps=len(steps)),
                     steps, torch.float64, prepare=prepare)
    err = abs(got["history"][0]["loss"] - ref["history"][0]["loss"]) / ref["history"][0]["loss"]
    print(f"{family}: loss relative error {err:.1e} with the leak")
    assert err > 1e-7
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
