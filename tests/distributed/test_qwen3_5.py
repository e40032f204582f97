"""Qwen3.5 (hybrid Gated DeltaNet + gated attention LM) is exact under every layout: loss,
grad-norm, every parameter and every update of every rank's copy equal the single-process stock
model's (fp64, 3 steps, 2 micro-batches, clipping active; the parity batches of
``test_parity.py``).

Tolerances: 1e-10 relative as in ``test_parity.py`` (fp64: only summation orders differ),
except the gated attention's per-head ``q_norm``/``k_norm`` weights. The stock
``Qwen3_5RMSNorm`` computes in fp32 even in an fp64 model (``x.float()``, ``weight.float()``),
so their gradient is an fp32 sum over tokens and heads; under TP each rank sums its own heads
in fp32 and the all-reduce adds the partial sums: another summation order of fp32 terms.
Two orders of an N-term fp32 sum differ by ~sqrt(N) u (u = 6e-8) of the terms' size; N = tokens
x local heads ~ 150 x 4, sqrt(N) u ~ 1.5e-6; AdamW's per-entry normalisation passes an entry's
relative gradient error into its update at most unchanged. Measured 2e-8..1e-7 (gradients,
parameters and updates); 1e-5 leaves the margin, while a missing all-reduce (the partial sum
of half the heads) is an O(1) error. The other Qwen3_5RMSNorm weights (layer norms, final
norm) are replicated whole under TP and summed in the reference's order: they pass at 1e-10
without text SP; with it they run on sequence shards (DTensor ``SequenceParallel``), so their
gradients become the same kind of fp32 partial sums (over tokens) and take the same 1e-5
(measured 3e-8..3e-7). The Gated DeltaNet's gated norm computes in the model's dtype: 1e-10.

Layouts: collocated SP2/TP2 in the default run (both layer kinds, head-sharded conv and
recurrence, Ulysses ViT); disjoint 1+2, disjoint 1+4 (one key head and two value heads per
rank), text sequence parallelism and activation checkpointing in the slow run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.parity import dense_layout as _layout
from tests.distributed.parity import (CFG, assert_parity, copy_errors, reference_fixture, run_engine,
                                      run_reference)

FAMILY = "qwen3_5"
FP32_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
SEQUENCE_FP32_NORMS = FP32_NORMS + ("input_layernorm.weight", "post_attention_layernorm.weight",
                                    "language_model.norm.weight")


CASES = {  # id: (layout, config changes)
    "collocated-sp2-tp2": (_layout("collocated", (2, 1), (2, 1)), {}),
    "disjoint-1v-2t": (_layout("disjoint", (1, 1), (2, 1)), {}),
    "disjoint-1v-4t": (_layout("disjoint", (1, 1), (4, 1)), {}),
    "collocated-sp2-tp2-text-sp": (_layout("collocated", (2, 1), (2, 1), text_sp=True), {}),
    "disjoint-1v-2t-text-sp-checkpointing": (_layout("disjoint", (1, 1), (2, 1), text_sp=True),
                                             {"activation_checkpointing": True}),
    "collocated-sp2-tp2-checkpointing": (_layout("collocated", (2, 1), (2, 1)),
                                         {"activation_checkpointing": True}),
}
DEFAULT = {"collocated-sp2-tp2"}


reference = reference_fixture(FAMILY)


def assert_qwen3_5_parity(got, ref, text_sp=False):
    fp32 = SEQUENCE_FP32_NORMS if text_sp else FP32_NORMS
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, skip=fp32)
    per_rank = [{k: {n: t for n, t in o[k].items() if n.endswith(fp32)} for k in ("params", "params0")}
                for o in got["per_rank"]]
    errs = (copy_errors(per_rank, ref["params"])
            + copy_errors(per_rank, ref["params"], base="params0", ref_base=ref["params0"]))
    assert errs and max(errs)[0] < 1e-5, max(errs)


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in DEFAULT else (pytest.mark.slow,), id=c)
                                  for c in CASES])
def test_qwen3_5_is_exact(case, reference):
    _, steps, ref = reference()
    layout, changes = CASES[case]
    got = run_engine(FAMILY, layout, dataclasses.replace(CFG, **changes), steps, torch.float64)
    assert_qwen3_5_parity(got, ref, text_sp=layout["text_sequence_parallel"])


# -- a saved Hugging Face directory: sharded load, first step, export round trip ----------------

@pytest.mark.slow
def test_qwen3_5_directory_loads_sharded_and_exports(tmp_path):
    """``save_pretrained`` of the tiny model, really sharded (100 KB files): the engine at
    collocated SP2/TP2 reads only its slices, and its first step equals the stock
    ``from_pretrained`` model's (1e-10 / the fp32-norm tolerance above); the checkpoint it then
    writes exports a directory that ``from_pretrained`` loads with the trained weights, bit for bit."""
    import transformers

    from tests.distributed.parity import assert_export_round_trip, run_from_directory

    got, ref, ckpt = run_from_directory(tmp_path, FAMILY, CASES["collocated-sp2-tp2"][0],
                                        dataclasses.replace(CFG, num_steps=1))
    assert_qwen3_5_parity(got, ref)
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), transformers.Qwen3_5ForConditionalGeneration,
                             got["params"])


@pytest.mark.slow
def test_qwen3_5_lora_at_sp2_tp2(reference):
    """PEFT LoRA with the default targets (the gated attention's q/k/v/o and every MLP; the
    Gated DeltaNet projections are not targets) at collocated SP2/TP2 against the single-process
    PEFT model (fp64, 1e-10: the frozen base holds the fp32-norm weights, which get no gradient);
    the base weights of the language model stay bit-identical, the adapters move."""
    _, steps, _ = reference()
    cfg = dataclasses.replace(CFG, modules={"llm": {"lora": {"r": 4, "alpha": 8}}})
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, CASES["collocated-sp2-tp2"][0], cfg, steps, torch.float64)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
    lora = {n for n in ref["params"] if ".lora_B." in n}
    assert any(".mlp." in n for n in lora) and any(".self_attn." in n for n in lora)
    assert all(ref["params0"][n].abs().max() == 0 < ref["params"][n].abs().max() for n in lora)
    for out in got["per_rank"]:
        for name in out["params"]:
            if name.startswith("model.language_model.") and ".lora_" not in name:
                assert torch.equal(out["params"][name], out["params0"][name]), name
