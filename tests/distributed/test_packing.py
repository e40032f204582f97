"""Packed text collation trains exactly like padded collation.

The packed engine (`TrainLoopConfig.packing`) is compared with the padded single-process
reference (`ray_dhp.step.reference`, the stock transformers forward), on the parity harness's
batches: 3 steps, 2 micro-batches of 4 samples mixing image sizes and a text-only sample,
clipping active. With ``max_tokens=80`` (samples are 30-43 tokens, the template's system turn
included) a replica's 4 samples pack into 2-3 rows, so rows hold several samples and short rows
are padded. A family is a row of `CASES`; InternVL packs with 1-D positions restarting at each
sample (`FamilySpec.packed_positions`, no ``get_rope_index``); Qwen3.5 and Qwen3.5-MoE (hybrid LMs whose Gated
DeltaNet layers run on chunk-aligned rows whose recurrence resets at every sample,
`ray_dhp.models.segments`) also cover text TP,
text sequence parallelism, ZeRO-3, the disjoint placement, expert parallelism (MoE), activation
checkpointing and LoRA.
Generic families (`ray_dhp.models.generic_packing`) pack at vision DP2 + text TP2 (their towers
take no vision SP): LLaVA (default run; also disjoint), Mistral 3, Idefics3 (1-D positions),
GLM-4V (M-RoPE from its get_rope_index), PaliGemma (bidirectional image prefix), Aya Vision
(sliding-window layers), GLM-4.5V (a mixture-of-experts LM, at text DP2 with EP2: the router
loss counts the packed rows' real tokens), every other generic family that packs (one row each),
LLaVA with text ZeRO-3 and with LoRA; Gemma 3 and ShieldGemma 2 (image blocks on sliding-window
layers: each sample's masks built alone, `ray_dhp.models.packed_masks`) at vision SP2 + text TP2
and disjoint 1 + TP2, with a negative control (transformers' own packed masks), Gemma 3 also with
text ZeRO-3 DP2 and with LoRA; LFM3-VL and LFM2-VL with LFM2's hybrid decoder (short
convolutions run one row per sample, their mixers read from the module tree) at vision DP2 or
SP2 + TP2 and disjoint 1 + TP2, LFM3-VL with text ZeRO-3 DP2, LFM2-VL with LoRA; MiniCPM-V 4.7
(canvas M-RoPE from its own get_rope_index, with a negative control: 1-D positions) and
MiniCPM-OCR, their Qwen3.5 LM's Gated DeltaNet layers run one row per sample, at vision DP2 +
TP2. Every generic family that packs (`PACKING_FAMILIES`, linear-attention LMs included: their
Gated DeltaNet one row per sample) has a disjoint 1 + TP2 row with the pipelined schedule, and a
collocated row (`COLLOCATED_ROWS`: vision SP2 + TP2 where the tower takes SP, else DP2 + TP2) where
none above covers it. What stays refused is
refused with the reason (the last test). Qwen3-VL-MoE packs at SP2/TP2 (`LOSS_TOL`).

Tolerance (fp64): 1e-10 relative on loss, grad-norm, every parameter, every update and (Qwen3.5
rows) every clipped gradient. Packing changes only summation orders: inside attention (a longer,
masked row) and of the token-sum loss; measured: loss <= 2e-16, parameters and updates <= 1e-13
(the worst are the key biases: some of their entries have a gradient that nearly cancels across
positions, see test_parity). Every rank's copy of every tensor is compared. Any leak across a
sample boundary (attention, positions or targets) changes the loss at O(1e-2) or more; a
recurrent state carried into the next sample (the negative control) at ~5e-5.

Qwen3.5 rows run the Gated DeltaNet recurrence in fp64 on both sides (`fp64_delta_rule`, the
reference's and every rank's ``prepare``): transformers' torch recurrence casts to fp32 whatever
its inputs, and its fp32 backward rounds by the tensors' layout, which packed rows change (a
segment moves to another row and chunk: measured 2e-8 relative on step 1's Gated DeltaNet
gradients, amplified by AdamW on the near-cancelling ``dt_bias`` to 3e-5 by step 3). The
stand-in is the packed path's own recurrence without resets, equal to the stock one per
segment (outputs bit for bit, gradients to fp32 rounding: tests/unit/test_delta_rule.py).

Generic families take test_generic.py's tolerances (``TOLS``: Gemma/Cohere/GLM norm and
position-table gradients summed over vision DP2 or text DP in another order, up to 1e-6..1e-4 on
updates, loss 1e-7; 1e-10 otherwise) and skip its ``ZERO_GRAD`` key biases (exact gradient 0,
noise in both runs): the layout's own reorderings, which packing leaves unchanged. A packed sample
seeing another's tokens is an O(1e-6..1e-2) loss error (measured: Gemma 3 with transformers' own
packed masks 2.7e-6..2.5e-4, LLaVA with the mask's packed detection off 1e-3).

`FP32_SUMS` (Qwen3.5 families): their RMSNorm weights compute in fp32 even in an fp64 model
(``x.float()``, ``weight.float()``; the Gated DeltaNet's ``A_log`` through ``A_log.float()``),
so those gradients are fp32 sums over the micro-batch's tokens, and packed rows sum them in
another grouping than one sample per row: two orders of an N-term fp32 sum differ by
~sqrt(N) u (u = 6e-8), N ~ 300 tokens: ~1e-6; AdamW passes an entry's relative gradient error
into its update at most unchanged. Those weights take 1e-5 (measured ~3e-7; what the same
reordering takes under TP and text SP in test_qwen3_5.py). The MoE loss takes 1e-8: its aux term
sums routing probabilities in fp32 (~1e-7 of a term weighing ~1e-2 of the loss,
test_qwen3_5_moe.py).
"""

import inspect
from dataclasses import replace

import pytest
import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.fp64_recurrence import fp64_delta_rule
from tests.distributed.parity import (packable_steps, GENERIC_FAMILIES, assert_parity, copy_errors,
                                      reference_fixture, run_engine, run_reference)
from tests.distributed.generic_cases import (PACKING_FAMILIES, PACKING_MAX_TOKENS,
                                             PACKING_MODELS, STEPS, TOL, TOLS, VISION_SP,
                                             ZERO_GRAD, lfm2_vl_hybrid_config,
                                             qwen3_5_lm_hybrid_config)

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1,
                      max_tokens=80)


def _layout(placement, vision, text):
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp)


SINGLE = _layout("collocated", (1, 1), (1, 1))
TP2 = _layout("collocated", (2, 1), (2, 1))
DISJOINT_TP2 = _layout("disjoint", (1, 1), (2, 1))
TEXT_SP = dict(TP2, text_sequence_parallel=True)
GENERIC_TP2 = _layout("collocated", (1, 2), (2, 1))  # generic towers: vision DP, no SP
ZERO3 = dict(_layout("collocated", (1, 2), (1, 2)), text_zero=3)
CASES = [
    # (family, layout name, layout, max_tokens, default run?)
    ("qwen2_5_vl", "single", SINGLE, 80, True),
    ("qwen2_5_vl", "sp2-tp2", TP2, 80, True),
    ("qwen2_5_vl", "sp2-tp2-one-row", TP2, None, False),
    ("qwen3_vl", "single", SINGLE, 80, False),
    ("qwen3_vl", "sp2-tp2", TP2, 80, False),
    ("qwen2_vl", "disjoint-1v-tp2dp2", _layout("disjoint", (1, 1), (2, 2)), 80, False),
    ("internvl", "sp2-tp2", TP2, 80, True),  # 1-D RoPE positions (`packed_positions`)
    ("internvl", "disjoint-1v-tp2", DISJOINT_TP2, 80, False),
    ("internvl", "sp2-tp2-text-sp", TEXT_SP, 80, False),
    ("qwen3_5", "sp2-tp2", TP2, 80, True),
    ("qwen3_5", "disjoint-1v-tp2", DISJOINT_TP2, 80, False),
    ("qwen3_5", "sp2-tp2-text-sp", TEXT_SP, 80, False),
    ("qwen3_5", "dp2-zero3", ZERO3, 80, False),
    ("qwen3_5_moe", "sp2-tp2", TP2, 80, False),
    ("qwen3_5_moe", "disjoint-1v-tp2", DISJOINT_TP2, 80, False),
    ("qwen3_5_moe", "sp2-tp2-text-sp", TEXT_SP, 80, False),
    ("qwen3_5_moe", "dp2-zero3", ZERO3, 80, False),
    ("qwen3_5_moe", "dp2-ep2", dict(_layout("collocated", (1, 2), (1, 2)), text_ep=2), 80, False),
    # generic families (`ray_dhp.models.generic_packing`): 1-D positions unless get_rope_index
    ("llava", "dp2v-tp2", GENERIC_TP2, 80, True),
    ("llava", "disjoint-1v-tp2", DISJOINT_TP2, 80, False),
    ("llava", "dp2-zero3", ZERO3, 80, False),  # text ZeRO-3 over 2 replicas of packed rows
    ("llava", "dp2v-tp2-text-sp", dict(GENERIC_TP2, text_sequence_parallel=True), 80, False),
    ("mistral3", "dp2v-tp2", GENERIC_TP2, 80, False),
    ("idefics3", "dp2v-tp2", GENERIC_TP2, 80, False),
    ("glm4v", "dp2v-tp2", GENERIC_TP2, 80, False),  # M-RoPE from its get_rope_index
    ("glm4v_moe", "dp2v-dp2-ep2", dict(_layout("collocated", (1, 2), (1, 2)), text_ep=2), 80, False),
    ("paligemma", "dp2v-tp2", GENERIC_TP2, 80, False),  # bidirectional image prefix blocks
    ("paligemma", "dp2v-tp2-text-sp", dict(GENERIC_TP2, text_sequence_parallel=True), 80, False),
    ("aya_vision", "dp2v-tp2", GENERIC_TP2, 80, False),  # sliding-window layers
    # sliding-window layers with image blocks: each sample's masks built alone (`packed_masks`)
    ("gemma3", "sp2v-tp2", TP2, 80, False),
    ("gemma3", "disjoint-1v-tp2", DISJOINT_TP2, 80, False),
    ("gemma3", "sp2v-tp2-text-sp", TEXT_SP, 80, False),  # the masks on the gathered sequence
    ("gemma3", "dp2-zero3", ZERO3, 80, False),  # the per-sample masks, text ZeRO-3 DP2
    ("shieldgemma2", "sp2v-tp2", TP2, 80, False),
    # short causal convolutions, one row per sample (`stateful_mixers` read from the module tree)
    ("lfm3_vl", "dp2v-tp2", GENERIC_TP2, 80, False),
    ("lfm3_vl", "disjoint-1v-tp2", DISJOINT_TP2, 80, False),
    ("lfm3_vl", "dp2-zero3", ZERO3, 80, False),  # the conv rows on ZeRO-3's gathered weights
    # every other generic family that packs (unit/test_packing.py's per-sample logits), one row
    *[(f, "dp2v-tp2", GENERIC_TP2, 80, False)
      for f in ("cohere2_vision", "smolvlm", "glm46v", "lighton_ocr", "glmga",
                "hyperclovax_vision_v2", "got_ocr2", "pp_chart2table", "glm_ocr", "video_llava",
                "exaone4_5")],
    ("qwen3_vl_moe", "sp2-tp2", TP2, 80, False),  # router loss over the packed rows' real tokens
]
_QWEN3_5_FP32 = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight", "language_model.norm.weight", "linear_attn.A_log")
# family: (name suffixes of the fp32-summed weights, their tolerance, the loss tolerance)
FP32_SUMS = {"qwen3_5": (_QWEN3_5_FP32, 1e-5, 1e-10), "qwen3_5_moe": (_QWEN3_5_FP32, 1e-5, 1e-8)}
# family: its loss tolerance where not 1e-10 (Qwen3-VL-MoE: the aux loss sums routing
# probabilities in fp32, ~1e-7 of a term weighing ~1e-2 of the loss, test_moe.py)
LOSS_TOL = {"qwen3_vl_moe": 1e-8}
# Rows that run 2 steps, not 3. With text SP the fp32-summed norm weights also run on sequence
# shards of the packed rows; after step 2 (AdamW's first update is lr * sign(g), blind to their
# ~1e-7 gradient error, its second is not) they stand ~1e-9 apart, and from step 3 every fp64
# gradient follows (measured at step 3: gradients up to 1.4e-5 relative on the near-cancelling
# ``dt_bias``, updates 6e-7), the drift test_qwen3_5_moe.py's SP_TOL describes. Steps 1-2 match
# everything at 1e-10 (every clipped gradient of every rank included), which is what packing
# changes.
# ZeRO-3 rows too since the Gated DeltaNet runs the packed rows chunk-aligned (before, its rows
# mirrored the reference's padded ones): at ZeRO-3 DP2 step 3's gradients drift (measured: up to
# 9.9e-9 on the near-cancelling merger norm weight, updates 1.4e-9; loss and steps 1-2 within
# 1e-10). Likely path, not isolated: ``A_log``'s gradient passes through fp32 (``A_log.float()``)
# after a sum over the mixer's tokens, which the aligned rows group otherwise (a 1e-16 change
# can move an fp32 rounding: ~1e-7 on ``A_log``, `FP32_SUMS`), and AdamW's second update sees it.
TWO_STEPS = {("qwen3_5", "sp2-tp2-text-sp"), ("qwen3_5_moe", "sp2-tp2-text-sp"),
             ("qwen3_5", "dp2-zero3"), ("qwen3_5_moe", "dp2-zero3")}



padded_reference = reference_fixture(cfg=CFG, make=packable_steps, name="padded_reference",
                                     prepare=fp64_delta_rule)


# Generic families whose LM is transformers' Qwen3.5 decoder: their Gated DeltaNet calls
# modeling_qwen3_5's recurrence, which `padded_reference` swaps for the fp64 one
# (`fp64_delta_rule`); their rows compare with a reference of their own (`_padded`) on the stock
# fp32 recurrence, as their ranks run it (against the fp64 reference, measured: loss 3.8e-10,
# step-1 gradients up to 5e-4 on the vision tower, where the stock recurrence on both sides is
# exact at step 1 but for the fp32-summed norm weights, 6.4e-8). The stock recurrence rounds by
# the tensors' layout, which the rows of one sample change (as Qwen3.5's, module docstring): by
# step 3 AdamW has carried that to updates of 1.5e-5 (MiniCPM-V 4.6, the embedding) and 6.0e-6
# (Qwen4-Exp, ``dt_bias``; its own recurrence, never swapped), within their `TOLS` (1e-4, their
# fp32 norms' and ``A_log``'s); with the fp64 recurrence on both sides (both ``prepare``d)
# MiniCPM-V 4.6's worst update is 1.1e-7 (the fp32 norms alone), at 4x the run time.
QWEN3_5_LM = ("minicpmv4_6", "minicpm_ocr", "minicpmv4_7")


def _prepare(family: str):
    """Every rank's ``prepare``: Qwen3.5 families run their recurrence in fp64 (module docstring)."""
    return fp64_delta_rule if family in FP32_SUMS else None


@pytest.mark.parametrize(
    "family, name, layout, max_tokens",
    [pytest.param(f, n, lay, mt, marks=() if default else (pytest.mark.slow,), id=f"{f}-{n}")
     for f, n, lay, mt, default in CASES])
def test_packed_equals_padded_fp64(family, name, layout, max_tokens, padded_reference):
    _, steps, ref = padded_reference(family, **({"num_steps": 2} if (family, name) in TWO_STEPS else {}))
    cfg = replace(CFG, packing=True, max_tokens=max_tokens, num_steps=len(steps))
    grads = family in FP32_SUMS or family in GENERIC_FAMILIES
    got = run_engine(family, layout, cfg, steps, torch.float64, grads=grads, prepare=_prepare(family))
    worst = assert_packed_parity(family, got, ref)
    print(family, name, "worst (update, parameter, name):", worst)


def assert_packed_parity(family, got, ref):
    """The module docstring's tolerances: 1e-10, `FP32_SUMS` for the fp32-summed weights, and
    test_generic's for the generic families."""
    if family in GENERIC_FAMILIES:
        return assert_parity(got, ref, skip=ZERO_GRAD, **TOLS.get(family, TOL))
    if family not in FP32_SUMS:
        assert_parity(got, ref, loss_tol=LOSS_TOL.get(family, 1e-10), param_tol=1e-10,
                      update_tol=1e-10)
        return
    fp32, fp32_tol, loss_tol = FP32_SUMS[family]
    assert_parity(got, ref, loss_tol=loss_tol, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10,
                  skip=fp32)
    only = [{k: {n: t for n, t in o[k].items() if n.endswith(fp32)} for k in ("params", "params0")}
            for o in got["per_rank"]]
    errs = (copy_errors(only, ref["params"])
            + copy_errors(only, ref["params"], base="params0", ref_base=ref["params0"]))
    assert errs and max(errs)[0] < fp32_tol, max(errs)


@pytest.mark.slow
def test_qwen3_5_packed_with_activation_checkpointing_pipelined(padded_reference):
    """Non-reentrant activation checkpointing recomputes every decoder layer in backward: the
    segments travel with the layer's keyword arguments, so the recomputed Gated DeltaNet layers
    run one row per sample again; with the pipelined disjoint schedule (vision of micro-batch
    k+1 while text runs k; disjoint 1+2, the Qwen3.5 tolerances)."""
    _, steps, ref = padded_reference("qwen3_5")
    cfg = replace(CFG, packing=True, activation_checkpointing=True)
    got = run_engine("qwen3_5", DISJOINT_TP2, cfg, steps, torch.float64, schedule="pipelined",
                     grads=True, prepare=fp64_delta_rule)
    assert_packed_parity("qwen3_5", got, ref)


@pytest.mark.slow
def test_qwen3_5_packed_with_lora(padded_reference):
    """PEFT LoRA (default targets: the gated attention's q/k/v/o and every MLP) on packed rows at
    collocated SP2/TP2 against the padded single-process PEFT model; the frozen base keeps the
    Gated DeltaNet layers (still run one row per sample) and the fp32-summed norm weights."""
    lora = {"llm": {"lora": {"r": 4, "alpha": 8}}}
    _, steps, ref = padded_reference("qwen3_5", modules=lora)
    got = run_engine("qwen3_5", TP2, replace(CFG, packing=True, modules=lora), steps, torch.float64,
                     grads=True, prepare=fp64_delta_rule)
    assert_packed_parity("qwen3_5", got, ref)
    assert any(".lora_B." in n for n in ref["grads"][0])


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("llava", GENERIC_TP2), ("gemma3", TP2),
                                            ("lfm2_vl", GENERIC_TP2)],
                         ids=["llava-dp2v-tp2", "gemma3-sp2v-tp2", "lfm2_vl-dp2v-tp2"])
def test_generic_packed_with_lora(family, layout, padded_reference, tmp_path):
    """PEFT LoRA (default targets) on a generic family's packed rows against the padded
    single-process PEFT model, test_generic's tolerances: LLaVA at vision DP2 + text TP2, Gemma 3
    (each sample's masks built alone, `packed_masks`) at vision SP2 + text TP2, LFM2-VL's hybrid
    decoder (`PACKING_MODELS`: the adapters on its attention layer's q/k/v, the frozen short
    convolution still run one row per sample) at vision DP2 + text TP2."""
    lora = {"llm": {"lora": {"r": 4, "alpha": 8}}}
    steps, ref = _padded(family, padded_reference, tmp_path, modules=lora)
    got = run_engine(family, layout, replace(CFG, packing=True, modules=lora), steps,
                     torch.float64, grads=True, model=_model(family))
    print(family, "worst (update, parameter, name):", assert_packed_parity(family, got, ref))
    assert any(".lora_B." in n for n in ref["grads"][0])


def _model(family):
    """The family's model for the packing rows: its tiny config, or `PACKING_MODELS`'."""
    return PACKING_MODELS[family]() if family in PACKING_MODELS else None


def _padded(family, padded_reference, tmp_path, **changes):
    """``(steps, ref)``: the packable steps and the padded single-process trajectory on them,
    for `_model(family)` (`padded_reference`'s, shared, for a family's tiny config; its own for
    `QWEN3_5_LM`, on the stock recurrence)."""
    if family not in PACKING_MODELS and family not in QWEN3_5_LM:
        _, steps, ref = padded_reference(family, **changes)
        return steps, ref
    cfg = replace(CFG, **changes)
    steps = packable_steps(tmp_path, family, cfg)
    return steps, run_reference(family, cfg, steps, torch.float64, model=_model(family))


#: The generic families that pack with no collocated row above (`CASES`, or a test of their own:
#: LFM2-VL's hybrid decoder, MiniCPM-V 4.7 / MiniCPM-OCR's Qwen3.5 LM), and those whose tower
#: takes Ulysses SP (`VISION_SP`) with no collocated row at vision SP2: each gets one in
#: `test_generic_packed_collocated_fp64`.
COLLOCATED_ROWS = tuple(f for f in PACKING_FAMILIES if f not in (
    {f for f, _, lay, _, _ in CASES if lay["placement"] == "collocated"
     and (lay["vision_sp"] == 2 or f not in VISION_SP)}
    | {"lfm2_vl", "minicpmv4_7", "minicpm_ocr"}))


def _packed_row(family, layout, padded_reference, tmp_path, **engine):
    """A generic family's packed rows at ``layout`` against the same samples one per row
    (`_padded`), test_generic's tolerances (`TOLS`), every clipped gradient of every step of
    every rank; its `PACKING_MODELS` model, `STEPS` and `PACKING_MAX_TOKENS` where it has them."""
    from ray_dhp import demo
    from ray_dhp.models import family_of

    assert family_of(_model(family) or demo.tiny_model_config(family)).packing
    max_tokens = PACKING_MAX_TOKENS.get(family, 80)
    steps, ref = _padded(family, padded_reference, tmp_path, num_steps=STEPS.get(family, 3),
                         max_tokens=max_tokens)
    cfg = replace(CFG, packing=True, num_steps=len(steps), max_tokens=max_tokens)
    got = run_engine(family, layout, cfg, steps, torch.float64, grads=True, model=_model(family),
                     prepare=_prepare(family), **engine)
    print(family, "worst (update, parameter, name):", assert_packed_parity(family, got, ref))


@pytest.mark.slow
@pytest.mark.parametrize("family", COLLOCATED_ROWS)
def test_generic_packed_collocated_fp64(family, padded_reference, tmp_path):
    """Every generic family that packs and has no collocated packed row above (`COLLOCATED_ROWS`),
    collocated on 2 ranks: vision SP2 + text TP2 where its tower takes Ulysses SP
    (`generic_cases.VISION_SP`), else vision DP2 + text TP2; packed rows vs the same samples one
    per row (`_packed_row`)."""
    _packed_row(family, TP2 if family in VISION_SP else GENERIC_TP2, padded_reference, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", PACKING_FAMILIES)
def test_generic_packed_disjoint_pipelined_fp64(family, padded_reference, tmp_path):
    """Every generic family that packs (`PACKING_FAMILIES`), disjoint 1 vision rank + text TP2
    with the pipelined schedule (the vision of micro-batch k+1 runs while the text runs k, the
    packed rows' image features sent to the text ranks), packed rows vs the same samples one per
    row: test_generic's tolerances (`TOLS`; one vision rank, so only the text TP2 partial sums
    reorder), every clipped gradient of every step of every rank. LFM2-VL with its hybrid
    decoder (`PACKING_MODELS`); Gemma 4 for `STEPS` steps (its fp32 pooler's noise,
    generic_cases.py); the LLaVA-NeXT kinds' rows of 128 tokens (`PACKING_MAX_TOKENS`)."""
    _packed_row(family, DISJOINT_TP2, padded_reference, tmp_path, schedule="pipelined")


def _without_state_reset():
    """Rank side of the negative control: Qwen3.5 packs through its Gated DeltaNet layers'
    packed path with both isolations off: samples back to back (chunk 1, no conv gap) and a
    recurrence that never resets, so the conv window and the state run on across the samples of
    a row. (The reset alone off leaks little in the tiny model: its gap tokens decay the state by
    exp(-1.3 A) per token, A >= 1; measured with 3 zeros between samples: loss 4e-10..5e-9,
    with 64-token chunks: 1e-16. The reset alone is shown by tests/unit/test_delta_rule.py and
    the unit packed-logits control.)"""
    import ray_dhp.models as models

    fp64_delta_rule()
    family = models.FAMILIES["qwen3_5"]
    (spec,) = family.stateful_mixers

    def no_reset(*args, starts, **kwargs):
        return spec.resetting(*args, starts=None, **kwargs)

    models._BY_MODEL_TYPE["qwen3_5"] = replace(
        family, stateful_mixers=(replace(spec, chunk=1, window="", resetting=no_reset),))


@pytest.mark.slow
def test_packed_bf16_autocast_tracks_fp32(padded_reference):
    """bf16 autocast with packing and TP=2 runs and its loss stays within 0.1% of the padded fp32
    reference (the fp64 reference starts from a different random init: init is drawn per dtype).
    bf16 has a 2^-8 relative mantissa but the loss is computed in fp32; measured gap ~1e-5, the
    same as padded bf16."""
    _, steps, _ = padded_reference("qwen2_5_vl")
    ref = run_reference("qwen2_5_vl", CFG, steps)
    got = run_engine("qwen2_5_vl", TP2, replace(CFG, packing=True, precision="bf16_autocast"), steps)
    for g, r in zip(got["history"], ref["history"]):
        assert abs(g["loss"] - r["loss"]) <= 1e-3 * r["loss"], (g["loss"], r["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("sp2v-tp2", TP2), ("disjoint-1v-tp2", DISJOINT_TP2)])
def test_lfm2_vl_hybrid_packed_equals_padded_fp64(name, layout, tmp_path):
    """LFM2-VL with LFM2's hybrid decoder (a short-convolution layer, then attention; the
    released models' layout, which transformers' default config lacks): the conv layers run one
    row per sample, the attention layer per sample; LFM2-VL's tolerances (`TOLS`)."""
    config = lfm2_vl_hybrid_config()
    cfg = replace(CFG, packing=False)
    steps = packable_steps(tmp_path, "lfm2_vl", cfg)
    ref = run_reference("lfm2_vl", cfg, steps, torch.float64, model=config)
    got = run_engine("lfm2_vl", layout, replace(CFG, packing=True), steps, torch.float64,
                     grads=True, model=config)
    assert_packed_parity("lfm2_vl", got, ref)


@pytest.fixture(scope="module")
def qwen3_5_lm_reference(tmp_path_factory):
    """``get(family) -> (steps, reference)``: the padded single-process trajectory of a
    generic family with a Qwen3.5 language model on `qwen3_5_lm_hybrid_config` (a Gated
    DeltaNet layer, then full attention), the recurrence in fp64 (`fp64_delta_rule`), built once
    per family."""
    cache = {}

    def get(family):
        if family not in cache:
            cfg = replace(CFG, packing=False)
            steps = packable_steps(tmp_path_factory.mktemp(family), family, cfg)
            undo = fp64_delta_rule()
            try:
                cache[family] = steps, run_reference(family, cfg, steps, torch.float64,
                                                     model=qwen3_5_lm_hybrid_config(family))
            finally:
                undo()
        return cache[family]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", ["minicpmv4_7", "minicpm_ocr"])
def test_qwen3_5_lm_generic_packed_equals_padded_fp64(family, qwen3_5_lm_reference):
    """MiniCPM-V 4.7 (each sample's canvas M-RoPE from its own ``get_rope_index``, called with
    the arguments its signature names: `ray_dhp.models.generic_packing.packed_rope_index`) and
    MiniCPM-OCR (1-D positions) at vision DP2 + text TP2, their Qwen3.5 language model with a
    Gated DeltaNet layer (one row per sample) and a full-attention layer (per sample), the
    recurrence in fp64 on both sides (`fp64_delta_rule`: transformers' torch recurrence computes
    in fp32 and rounds by the layout): loss, every gradient, update and rank's copy within the
    family's `TOLS` (the zero-centred RMSNorms' fp32 sums, generic_cases.py). Measured (3 steps):
    MiniCPM-V 4.7 loss <= 8.3e-16, worst update 1.0e-7 (a post-attention RMSNorm weight);
    MiniCPM-OCR loss <= 1.0e-10, worst update 6.0e-8 (an attention k_norm weight): only the
    fp32-computed norm weights move beyond 1e-10."""
    steps, ref = qwen3_5_lm_reference(family)
    got = run_engine(family, GENERIC_TP2, replace(CFG, packing=True), steps, torch.float64,
                     grads=True, model=qwen3_5_lm_hybrid_config(family), prepare=fp64_delta_rule)
    print(family, "worst (update, parameter, name):",
          assert_parity(got, ref, skip=ZERO_GRAD, **TOLS.get(family, TOL)),
          "loss:", [abs(g["loss"] - r["loss"]) / r["loss"]
                    for g, r in zip(got["history"], ref["history"])])


def _minicpm_v4_7_one_dimensional():
    """Rank side of MiniCPM-V 4.7's negative control: its packed samples take 1-D positions
    (0..n-1 on every axis) in place of its canvas M-RoPE rule; the recurrence in fp64."""
    import ray_dhp.models as models

    models._BY_MODEL_TYPE["minicpmv4_7"] = replace(
        models.family_of(qwen3_5_lm_hybrid_config("minicpmv4_7")), packed_positions="1d")
    return fp64_delta_rule()


@pytest.mark.slow
def test_minicpm_v4_7_packed_without_its_rope_index_fails_parity(qwen3_5_lm_reference):
    """The positions matter: MiniCPM-V 4.7's packed samples with 1-D positions instead of its own
    ``get_rope_index`` (the case above otherwise) are far out of tolerance, the loss itself
    (measured 9.1e-6, 3.4e-5, 5.5e-4 relative per step; the family's loss tolerance is 1e-7)."""
    steps, ref = qwen3_5_lm_reference("minicpmv4_7")
    got = run_engine("minicpmv4_7", GENERIC_TP2, replace(CFG, packing=True), steps,
                     torch.float64, grads=True, model=qwen3_5_lm_hybrid_config("minicpmv4_7"),
                     prepare=_minicpm_v4_7_one_dimensional)
    loss_errs = [abs(g["loss"] - r["loss"]) / r["loss"] for g, r in zip(got["history"], ref["history"])]
    print("minicpmv4_7 1-D positions, loss errors:", loss_errs)
    assert min(loss_errs) > 1e-6, loss_errs
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_packed_parity("minicpmv4_7", got, ref)


def _gemma3_transformers_masks():
    """Rank side of Gemma 3's negative control: its packed rows keep transformers' own packed
    masks (the image blocks of its sliding-window layers looked up at packed positions)."""
    import ray_dhp.models as models
    from ray_dhp import demo

    models._BY_MODEL_TYPE["gemma3"] = replace(models.family_of(demo.tiny_model_config("gemma3")),
                                              packed_masks=False)


@pytest.mark.parametrize("family, prepare", [
    ("qwen3_5", _without_state_reset),
    pytest.param("gemma3", _gemma3_transformers_masks, marks=pytest.mark.slow)])
def test_packed_without_the_sample_boundaries_fails_parity(family, prepare, padded_reference):
    """The negative controls (SP2/TP2): Qwen3.5 without the recurrent layers' reset, Gemma 3
    without the per-sample masks, are far out of tolerance — the loss itself, not only some
    weights (measured: Qwen3.5 5e-5..7e-5 relative per step, the tiny random model's decaying
    state carries little across a boundary; Gemma 3 2.1e-4, 2.5e-4, 2.7e-6; the bound 1e-6 is 10^4 times
    Qwen3.5's tolerance, 10 times Gemma 3's)."""
    _, steps, ref = padded_reference(family)
    got = run_engine(family, TP2, replace(CFG, packing=True), steps, torch.float64,
                     grads=True, prepare=prepare)
    loss_errs = [abs(g["loss"] - r["loss"]) / r["loss"] for g, r in zip(got["history"], ref["history"])]
    assert min(loss_errs) > 1e-6, loss_errs
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_packed_parity(family, got, ref)


def test_generic_packing_refused_with_the_reason():
    """Generic families whose packed rows would not compute what their samples compute alone are
    refused in the driver (`ray_dhp.models.generic_packing`): a ``get_rope_index`` that needs an
    argument a packed sample does not hand it; Gemma 3 without a static
    ``create_masks_for_generate`` (its image blocks on sliding-window layers) would be; the ones
    rows cover above pack, with their positions (and LFM3-VL's short convolutions and MiniCPM-V
    4.7's Gated DeltaNet layers as stateful mixers read from the module tree)."""
    import transformers

    from ray_dhp import demo
    from ray_dhp.models import family_of
    from ray_dhp.models.generic_packing import packing_rule

    gemma = demo.tiny_model_config("gemma3")
    with torch.device("meta"):
        model = transformers.Gemma3ForConditionalGeneration(gemma)
    params = tuple(inspect.signature(type(model).forward).parameters)
    rule = packing_rule(model.model, model.model.language_model, gemma.text_config, params)
    assert not rule["packing"] and "create_masks_for_generate" in rule["packing_reason"]
    assert packing_rule(model.model, model.model.language_model, gemma.text_config, params,
                        type(model))["packed_masks"]
    assert family_of(demo.tiny_model_config("lfm3_vl")).stateful_mixers == (
        ("layers.0.conv", "out_proj"), ("layers.1.conv", "out_proj"))  # read from the module tree
    assert family_of(demo.tiny_model_config("llava")).packed_positions == "1d"
    assert family_of(demo.tiny_model_config("glm4v")).packed_positions == "mrope"
    # a get_rope_index that needs what a packed sample does not hand it is refused; MiniCPM-V
    # 4.7's (its grids as target_sizes, as its stock forward takes them) packs, its Gated
    # DeltaNet layers (linear_attention: transformers' recurrent mask) one row per sample
    inner = type("Inner", (), {"get_rope_index": lambda self, input_ids, image_grid_thw,
                               audio_seqlens: None})()
    rule = packing_rule(inner, model.model.language_model, gemma.text_config, params, type(model))
    assert not rule["packing"] and "needs ('audio_seqlens',)" in rule["packing_reason"]
    config = demo.tiny_model_config("minicpmv4_7")
    family_of(config).validate_layout(config, sp=1, tp=1, packing=True)
    assert family_of(config).packed_positions == "mrope"
    assert family_of(config).stateful_mixers == (("layers.0.linear_attn", "out_proj"),
                                                 ("layers.1.linear_attn", "out_proj"))
