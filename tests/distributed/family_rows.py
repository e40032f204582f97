"""The fp64 family x layout parity matrix as data: one `Row` per family (its layouts, which of them
run by default, its tolerances, its configuration and an extra check where the family is held to
more than `tests.distributed.parity.assert_parity`). `test_families.py::test_family_is_exact`
runs every row's every layout against the single-process stock model: 3 optimizer steps of 2
micro-batches with clipping active (`parity.CFG`), loss and grad-norm of every step, every rank's
copy of every parameter and update (and, with ``grads``, of every clipped gradient of every step).

Tolerance 1e-10 relative unless a row says otherwise (with its reason and measurements below): in
fp64 the only differences are the summation orders of sharded matmuls and all-reduces (~1e-14
measured), amplified at most ~1e3 by AdamW's per-entry normalisation of the updates. fp64 is where
parameters after AdamW are comparable: Adam divides each gradient entry by its own magnitude, so
an entry with a small gradient turns summation-order noise into a change of up to ``lr``; in fp64
that noise (~1e-16 relative) stays far below Adam's ``eps`` (1e-8), in fp32 it does not (issue
#20; the fp32 cases are `test_parity.py`'s). A real bug (gradients doubled over SP/TP, a missing
all-reduce, a replica reading the wrong samples, a dropped forward keyword) is an O(1) error.

The family's own extra cases (directory loading and export, LoRA, variants) stay in its file
(`test_internvl.py`, `test_qwen3_5.py`, ...), with the same reference (`parity.reference_fixture`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.parallel.topology import EncoderDegrees
from tests.distributed.generic_cases import TOL as GENERIC_TOL
from tests.distributed.generic_cases import TOLS as GENERIC_TOLS
from tests.distributed.generic_cases import ROTARY_KEY_BIAS, STEPS, VISION_SP, ZERO_GRAD
from tests.distributed.parity import (CFG, GENERIC_FAMILIES, GENERIC_MOE_FAMILIES, dense_layout,
                                      make_steps, moe_layout)
from tests.distributed import family_checks as checks
from tests.distributed.omni_cases import omni_steps

EXACT = dict(loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
EXACT_GRADS = dict(EXACT, grad_tol=1e-10)


class Row(NamedTuple):
    """One family's cases: ``layouts`` maps a layout id to ``(layout, config changes)`` (a
    `run_engine` layout dict, `dataclasses.replace` changes of ``cfg``); ``default``: the ids run
    by default (the others carry ``-m slow``); ``tols``: `assert_parity`'s keywords; ``grads``:
    record and compare the clipped gradients; ``make``: the steps (`parity.make_steps`'s
    signature); ``check(got, ref, case)``: the family's assertions beyond ``tols``."""
    family: str
    layouts: dict
    default: frozenset
    tols: dict
    grads: bool = False
    cfg: TrainLoopConfig = CFG
    make: Callable = make_steps
    check: Callable | None = None


class Case(NamedTuple):
    """One case of the matrix: its row, layout id, layout and config changes."""
    row: Row
    id: str
    layout: dict
    changes: dict


# -- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the layout matrix ----------------------------------------------

QWEN_VL_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")
VISION = [(1, 1), (2, 1), (4, 1), (2, 2)]   # (sp, dp)
TEXT = [(1, 1), (2, 1), (4, 1), (2, 2)]     # (tp, dp)

# Representative subset in the default run, as (family, placement, (vision sp, dp), (text tp,
# dp)): every family, both placements, SP, TP and DP in each module, asymmetric disjoint groups,
# Qwen3's partial q/k-norm gradients (two of them are demoted by tests/default_suite.py); the NCCL
# twin's ordering test (test_nccl_twin.py) runs these layouts too.
PARITY_DEFAULT = {
    ("qwen2_5_vl", "collocated", (2, 1), (2, 1)),
    ("qwen2_5_vl", "disjoint", (2, 2), (2, 1)),
    ("qwen2_vl", "collocated", (2, 2), (2, 2)),
    ("qwen3_vl", "collocated", (2, 1), (2, 1)),
    ("qwen3_vl", "disjoint", (1, 1), (2, 2)),
}


def layout_id(placement: str, vision: tuple, text: tuple) -> str:
    return f"{placement}-sp{vision[0]}dp{vision[1]}-tp{text[0]}dp{text[1]}"


def _qwen_vl_row(family: str) -> Row:
    layouts, default = {}, set()
    for v in VISION:
        for t in TEXT:
            for placement in ("collocated", "disjoint"):
                if placement == "collocated" and v[0] * v[1] != t[0] * t[1]:
                    continue
                layouts[layout_id(placement, v, t)] = (dense_layout(placement, v, t), {})
                if (family, placement, v, t) in PARITY_DEFAULT:
                    default.add(layout_id(placement, v, t))
    return Row(family, layouts, frozenset(default), EXACT)


# -- InternVL3 (InternViT on fixed tiles + pixel shuffle + MLP projector, Qwen2 LM) -----------------
# 1e-10 (only summation orders differ: the Ulysses attention per tile segment, the projector on a
# rank's rows, TP partial sums); a CLS token dropped, a unit's patches in the wrong channel order or
# a missing all-to-all is O(1). The batches are cut into 1-4 tiles per image by InternVL's own
# tiling (test_internvl.py::test_samples_have_tiles).

INTERNVL = Row("internvl", {
    "collocated-sp2-tp2": (dense_layout("collocated", (2, 1), (2, 1)), {}),
    "disjoint-1v-2t": (dense_layout("disjoint", (1, 1), (2, 1)), {}),
    "disjoint-1v-4t": (dense_layout("disjoint", (1, 1), (4, 1)), {}),
    "collocated-sp4-tp4": (dense_layout("collocated", (4, 1), (4, 1)), {}),
    "collocated-sp2-tp2-text-sp": (dense_layout("collocated", (2, 1), (2, 1), text_sp=True), {}),
    "collocated-sp2-tp2-checkpointing": (dense_layout("collocated", (2, 1), (2, 1)),
                                         {"activation_checkpointing": True}),
    "disjoint-2v-2t-text-sp-checkpointing": (dense_layout("disjoint", (2, 1), (2, 1), text_sp=True),
                                             {"activation_checkpointing": True}),
    "collocated-text-zero3-dp2": (dict(dense_layout("collocated", (1, 2), (1, 2)), text_zero=3), {}),
}, frozenset({"collocated-sp2-tp2"}), EXACT_GRADS, grads=True)


# -- Qwen3.5 (hybrid Gated DeltaNet + gated attention LM) ------------------------------------------
# 1e-10, except the fp32-computed norm weights: `family_checks.assert_qwen3_5_parity` (reasons and
# measurements there). Default: collocated SP2/TP2 (both layer kinds, head-sharded conv and
# recurrence, Ulysses ViT); disjoint 1+4 has one key head and two value heads per rank.

QWEN3_5 = Row("qwen3_5", {
    "collocated-sp2-tp2": (dense_layout("collocated", (2, 1), (2, 1)), {}),
    "disjoint-1v-2t": (dense_layout("disjoint", (1, 1), (2, 1)), {}),
    "disjoint-1v-4t": (dense_layout("disjoint", (1, 1), (4, 1)), {}),
    "collocated-sp2-tp2-text-sp": (dense_layout("collocated", (2, 1), (2, 1), text_sp=True), {}),
    "disjoint-1v-2t-text-sp-checkpointing": (dense_layout("disjoint", (1, 1), (2, 1), text_sp=True),
                                             {"activation_checkpointing": True}),
    "collocated-sp2-tp2-checkpointing": (dense_layout("collocated", (2, 1), (2, 1)),
                                         {"activation_checkpointing": True}),
}, frozenset({"collocated-sp2-tp2"}), dict(loss_tol=1e-10), check=checks.qwen3_5)


# -- Qwen3.5-MoE (Qwen3.5's LM with a sparse block in every layer) ---------------------------------
# The loss 1e-8, every other copy per name: `family_checks.assert_qwen3_5_moe_parity` (reasons and
# measurements there). Default: collocated SP2/TP2 (both mixers head-sharded, the shared expert
# TP-sharded, the routed experts replicated on the TP ranks, Ulysses ViT).

QWEN3_5_MOE = Row("qwen3_5_moe", {
    "collocated-sp2-tp2": (moe_layout("collocated", (2, 1), (2, 1)), {}),
    "collocated-dp2-ep2": (moe_layout("collocated", (1, 2), (1, 2), ep=2), {}),
    "collocated-sp2dp2-tp2dp2-ep2": (moe_layout("collocated", (2, 2), (2, 2), ep=2), {}),
    "disjoint-1v-2t-tp2": (moe_layout("disjoint", (1, 1), (2, 1)), {}),
    # text sequence parallelism: the sparse block on the gathered sequence (models/qwen3_5_moe.py)
    "collocated-sp2-tp2-text-sp": (dict(moe_layout("collocated", (2, 1), (2, 1)),
                                        text_sequence_parallel=True), {}),
    "collocated-sp2dp2-tp2dp2-ep2-text-sp": (dict(moe_layout("collocated", (2, 2), (2, 2), ep=2),
                                                  text_sequence_parallel=True), {}),
    # the routed experts sharded over TP by their intermediate dim (parallel/expert_tp.py)
    "collocated-sp2-tp2-experts-tp": (dict(moe_layout("collocated", (2, 1), (2, 1)),
                                           text_expert_tp=True), {}),
    "disjoint-1v-2t-ep2": (moe_layout("disjoint", (1, 1), (1, 2), ep=2), {}),
    "collocated-dp2-ep2-checkpointing": (moe_layout("collocated", (1, 2), (1, 2), ep=2),
                                         {"activation_checkpointing": True}),
}, frozenset({"collocated-sp2-tp2"}), dict(loss_tol=1e-8), grads=True, check=checks.qwen3_5_moe)


# -- Qwen2.5-Omni thinker (two modules: ViT under Ulysses SP2, Qwen2 LM under TP2) -----------------
# 1e-10; image and text-only samples (no audio: the audio tower gets no gradient on either side and
# must stay bit-identical, `family_checks.omni`). Its own short run: 2 steps of 4 samples, 8 in all.
# Demoted to -m slow by tests/default_suite.py (test_omni_audio.py's three-module case keeps it).

OMNI_CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=2,
                           max_grad_norm=0.5, weight_decay=0.1, seed=0)
OMNI = Row("qwen2_5_omni", {
    "collocated-sp2-tp2": (dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1,
                                text_tp=2), {}),
}, frozenset({"collocated-sp2-tp2"}), EXACT_GRADS, grads=True, cfg=OMNI_CFG,
    make=functools.partial(make_steps, num_samples=8), check=checks.omni)


# -- Qwen3-Omni thinker (three modules: Qwen3-VL's ViT, a chunked-conv audio tower, Qwen3-VL-MoE's
# LM), each in its own group -------------------------------------------------------------------------
# The loss 1e-8: the stock router loss sums the routing probabilities in fp32 even in fp64, and a
# text DP split sums them in another order (`test_moe.py`, measured there); every gradient,
# parameter and update 1e-10, the audio attention's key biases left out (an exact gradient of 0:
# `family_checks.omni_audio` checks it is noise). The steps of `test_omni_audio.py` (`omni_cases.omni_steps`: every
# modality, then no audio, then no image; a 2.3 s clip spans three chunks and attention windows).
# ``schedule`` in a layout: the disjoint schedule (`run_engine`'s, default sequential).

OMNI_AUDIO_CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                                 max_grad_norm=0.5, weight_decay=0.1, seed=0)


def _omni3(placement: str, vision: tuple, audio_dp: int, text: tuple, **extra) -> dict:
    """A three-module layout: ``vision=(sp, dp)``, audio ``dp``, ``text=(tp, dp)``."""
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp,
                encoders={"audio": EncoderDegrees(dp=audio_dp)}, **extra)


OMNI3 = Row("qwen3_omni_moe", {
    "collocated-sp2-adp2-tp2": (_omni3("collocated", (2, 1), 2, (2, 1)), {}),
    "disjoint-2v-1a-2t-pipelined": (_omni3("disjoint", (2, 1), 1, (2, 1), schedule="pipelined"), {}),
    "disjoint-1v-1a-2t": (_omni3("disjoint", (1, 1), 1, (2, 1)), {}),
    "collocated-dp2-adp2-text-zero3-dp2": (_omni3("collocated", (1, 2), 2, (1, 2), text_zero=3), {}),
    # expert parallelism over the text DP replicas (all-to-all dispatch, `ray_dhp.parallel.expert`)
    "collocated-dp2-adp2-ep2": (_omni3("collocated", (1, 2), 2, (1, 2), text_ep=2), {}),
}, frozenset(), dict(loss_tol=1e-8, param_tol=1e-10, update_tol=1e-10,  # all slow: the default
                     grad_tol=1e-10, skip=checks.OMNI3_ZERO_GRAD),  # run keeps the Omni row's audio
    # group and this family's audio rows (tests/unit/test_omni3_audio.py)
    grads=True, cfg=OMNI_AUDIO_CFG, make=omni_steps, check=checks.omni_audio)


# -- generic families (`ray_dhp.models.generic`, nothing written for them) -------------------------
# 1e-10, or the family's `generic_cases.TOLS` (fp32 sums inside some stock modules; measured
# there); the zero-gradient key biases `generic_cases.ZERO_GRAD` are left out and checked to be
# noise (`family_checks.zero_grad_is_noise`). The default run keeps one case per layout.

GENERIC_LAYOUTS = {
    "collocated-dp2-tp2": (dense_layout("collocated", (1, 2), (2, 1)), {}),
    "disjoint-1v-tp2": (dense_layout("disjoint", (1, 1), (2, 1)), {}),
    "collocated-text-zero3-dp2": (dict(dense_layout("collocated", (1, 2), (1, 2)), text_zero=3), {}),
    # Megatron text sequence parallelism derived from the LM's plan (`ray_dhp.models.text_sp_plans`)
    "collocated-dp2-tp2-text-sp": (dense_layout("collocated", (1, 2), (2, 1), text_sp=True), {}),
}
#: the generic families whose LM plan refuses text sequence parallelism (the driver says why:
#: LFM2's plan shards only the embedding; `tests/unit/test_text_sp_plans.py` keeps this current)
GENERIC_NO_TEXT_SP = ("lfm2_vl", "lfm3_vl", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "gemma4",
                      "mistral_large4", "qwen4_exp")
#: text SP with activation checkpointing, disjoint (recomputed sharded blocks; `AfterLayers`'s
#: check across the recompute) where the derived plan has each kind of region: Gemma 3 (four
#: norms, Megatron regions), Kimi-K2.5 (MLA attention gathered, a sparse block sliced)
GENERIC_TEXT_SP_CHECKPOINTING = ("gemma3", "kimi_k25")
TEXT_SP_CHECKPOINTING = {"disjoint-1v-tp2-text-sp-checkpointing": (
    dense_layout("disjoint", (1, 1), (2, 1), text_sp=True), {"activation_checkpointing": True})}
#: both sequence parallelisms at once, vision Ulysses SP2 (`ray_dhp.models.vision_generic_sp`)
#: and text SP over the same two ranks: LLaVA (CLIP tower, Llama LM)
GENERIC_BOTH_SP = {"llava": {"collocated-sp2-tp2-text-sp": (
    dense_layout("collocated", (2, 1), (2, 1), text_sp=True), {})}}
GENERIC_DEFAULT = {("gemma3", "collocated-sp2-tp2"), ("gemma3", "disjoint-1v-tp2"),  # one reference
                   ("paligemma", "collocated-text-zero3-dp2")}
# vision SP2 in place of DP2 where the tower splits (`generic_cases.VISION_SP`)
GENERIC_SP = {"collocated-sp2-tp2": (dense_layout("collocated", (2, 1), (2, 1)), {}),
              **{k: v for k, v in GENERIC_LAYOUTS.items() if k != "collocated-dp2-tp2"}}


def _generic_row(family: str) -> Row:
    layouts = {k: v for k, v in (GENERIC_SP if family in VISION_SP else GENERIC_LAYOUTS).items()
               if not (k.endswith("-text-sp") and family in GENERIC_NO_TEXT_SP)}
    if family in GENERIC_TEXT_SP_CHECKPOINTING:
        layouts.update(TEXT_SP_CHECKPOINTING)
    layouts.update(GENERIC_BOTH_SP.get(family, {}))
    rotary = family in ROTARY_KEY_BIAS  # its key biases have a real gradient: compared too
    return Row(family, layouts, frozenset(lay for f, lay in GENERIC_DEFAULT if f == family),
               dict(GENERIC_TOLS.get(family, GENERIC_TOL), skip=() if rotary else ZERO_GRAD),
               grads=True, check=None if rotary else checks.zero_grad_is_noise,
               cfg=dataclasses.replace(CFG, num_steps=STEPS[family]) if family in STEPS else CFG)


# -- generic families with a mixture-of-experts LM, under expert parallelism ----------------------
# (`ray_dhp.models.generic_moe`; their rows above cover text TP2, disjoint 1+2 and ZeRO-3 DP2.)
# `generic_cases.TOLS` (GLM-4.5V's router computes its logits in fp32, measured there); the loss
# 1e-7 also covers the stock aux loss's fp32 sums of the routing probabilities, which a DP split
# takes in another order (~1e-7 of the aux term, which weighs coef * aux / loss ~ 4e-5 of the loss).

GENERIC_MOE_LAYOUTS = {
    "collocated-dp2-ep2": (moe_layout("collocated", (1, 2), (1, 2), ep=2), {}),
    "disjoint-1v-dp2-ep2": (moe_layout("disjoint", (1, 1), (1, 2), ep=2), {}),
    # the experts' intermediate dim over the TP ranks instead (`ray_dhp.parallel.expert_tp`)
    "collocated-dp2-tp2-experts-tp": (dict(moe_layout("collocated", (1, 2), (2, 1)),
                                           text_expert_tp=True), {}),
}
GENERIC_MOE_DEFAULT = {("glm4v_moe", "collocated-dp2-ep2")}


def _generic_moe_row(family: str) -> Row:
    return Row(family, GENERIC_MOE_LAYOUTS,
               frozenset(lay for f, lay in GENERIC_MOE_DEFAULT if f == family), GENERIC_TOLS[family],
               grads=True, check=checks.experts_really_parallel)


ROWS = ([_qwen_vl_row(f) for f in QWEN_VL_FAMILIES] + [INTERNVL, QWEN3_5, QWEN3_5_MOE, OMNI, OMNI3]
        + [_generic_row(f) for f in GENERIC_FAMILIES] + [_generic_moe_row(f) for f in GENERIC_MOE_FAMILIES])


def cases() -> list:
    """Every `Case` of every row, in row order (a family may have several rows: the generic MoE
    families' expert-parallel layouts are a second row; its ids must not repeat)."""
    out = [Case(row, lay, *row.layouts[lay]) for row in ROWS for lay in row.layouts]
    ids = [f"{c.row.family}-{c.id}" for c in out]
    assert len(set(ids)) == len(ids), "a (family, layout) id repeats"
    return out

