"""Qwen3.5-MoE (the hybrid Gated DeltaNet + gated attention LM of Qwen3.5 with a sparse block in
every layer: 8 routed experts top-2 and a sigmoid-gated shared expert) is exact: the DHP step
equals the stock single-process ``Qwen3_5MoeForConditionalGeneration``'s, load-balancing loss
included (fp64, 3 steps, 2 micro-batches, clipping active). Checked: the loss (cross-entropy +
``router_aux_loss_coef`` x aux) and grad-norm of every step, every rank's copy of every
parameter and of its update, and every rank's copy of every clipped gradient of every step —
the routers (``mlp.gate``), the routed experts (``mlp.experts.*``), the shared expert
(``mlp.shared_expert.*``, TP-sharded) and its gate (``mlp.shared_expert_gate``) among them.

Tolerances, relative:

* 1e-10 for parameters, updates and gradients as the dense fp64 matrix (only summation orders
  differ), except the zero-centred ``Qwen3_5MoeRMSNorm`` weights (``input_layernorm``,
  ``post_attention_layernorm``, the final ``norm``, the gated attention's ``q_norm``/``k_norm``).
  That norm computes in fp32 even in an fp64 model (``x.float()``, ``weight.float()``), so the
  gradient of its weight is an fp32 sum over tokens (and heads). A rank that sums only part of
  the terms — its TP heads (``q_norm``/``k_norm``, all-reduced), or its data-parallel replica's
  tokens (every such norm, summed over the replicas) — adds fp32 partial sums in another order.
  Two orders of an N-term fp32 sum differ by ~sqrt(N) u (u = 6e-8) of the terms' size; N ~ 600
  (tokens x heads) gives ~1.5e-6, and AdamW's per-entry normalisation passes an entry's relative
  gradient error into its update at most unchanged. Those weights (gradients, parameters,
  updates) take 1e-5 (measured below 1e-6; a missing reduction is an O(1) error). So does the
  Gated DeltaNet's ``A_log`` (``-A_log.float().exp()``: an fp32 sum over the tokens, split over
  the data-parallel replicas; measured 5e-8). Its gated norm and ``dt_bias`` (added to an fp32
  tensor: promoted to fp64) compute in the model's dtype: 1e-10.
* the loss 1e-8 (as ``test_moe.py``): the stock aux loss sums the routing probabilities in fp32
  (``routing_weights.float()``) even in an fp64 model; a DP split sums them in another order,
  ~1e-7 of the aux term, which weighs ~1e-2 of the loss. The aux *gradient* is not affected
  (``d aux / d P_e = E C_e / (L N)^2``: the same integer counts and fp32 operations).

Layouts: collocated SP2/TP2 in the default run (both mixers head-sharded, the shared expert
TP-sharded, the routed experts replicated on the TP ranks, Ulysses ViT); EP2 (experts
partitioned over two text data-parallel replicas), EP2 with TP2 on 4 ranks, disjoint 1+2 with
TP2 and with EP2, and EP2 with activation checkpointing in the slow run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models.qwen3_5_moe import sparse_layers
from tests.distributed.parity import moe_layout as _layout
from tests.distributed.parity import (CFG, assert_parity, copy_errors, reference_fixture, run_engine,
                                      run_reference)

FAMILY = "qwen3_5_moe"
FP32_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight", "language_model.norm.weight", "linear_attn.A_log")
TOL, FP32_TOL = 1e-10, 1e-5
# With text sequence parallelism the fp32 layer/final norms run on sequence shards, so their
# gradients are fp32 partial sums over tokens (~1e-7 relative, FP32_TOL), as for Qwen3.5. AdamW's
# first update is lr * sign(g) (m / sqrt(v) = g / |g|), blind to that; the second is not, so from
# step 3 every forward sees norm weights ~1e-8..1e-7 off and every fp64 gradient follows
# (measured: steps 1-2 gradients 3e-12, step 3 1.2e-7; parameters 7.6e-10, updates 2.4e-9 after
# lr = 1e-3 scales them). A missing reduction or a wrong shard is an O(1) error.
SP_TOL = {"param": 1e-8, "update": 1e-8, "grad": 1e-6}


CASES = {  # id: (layout, config changes)
    "collocated-sp2-tp2": (_layout("collocated", (2, 1), (2, 1)), {}),
    "collocated-dp2-ep2": (_layout("collocated", (1, 2), (1, 2), ep=2), {}),
    "collocated-sp2dp2-tp2dp2-ep2": (_layout("collocated", (2, 2), (2, 2), ep=2), {}),
    "disjoint-1v-2t-tp2": (_layout("disjoint", (1, 1), (2, 1)), {}),
    # text sequence parallelism: the sparse block on the gathered sequence (models/qwen3_5_moe.py)
    "collocated-sp2-tp2-text-sp": (dict(_layout("collocated", (2, 1), (2, 1)), text_sequence_parallel=True), {}),
    "collocated-sp2dp2-tp2dp2-ep2-text-sp": (dict(_layout("collocated", (2, 2), (2, 2), ep=2),
                                                  text_sequence_parallel=True), {}),
    # the routed experts sharded over TP by their intermediate dim (parallel/expert_tp.py)
    "collocated-sp2-tp2-experts-tp": (dict(_layout("collocated", (2, 1), (2, 1)), text_expert_tp=True), {}),
    "disjoint-1v-2t-ep2": (_layout("disjoint", (1, 1), (1, 2), ep=2), {}),
    "collocated-dp2-ep2-checkpointing": (_layout("collocated", (1, 2), (1, 2), ep=2),
                                         {"activation_checkpointing": True}),
}
DEFAULT = {"collocated-sp2-tp2"}


reference = reference_fixture(FAMILY)


def _errors(got, ref) -> list:
    """``(error, rank, what, name)`` of every rank's copy of every parameter, update and clipped
    gradient of every step against the reference."""
    per_rank = got["per_rank"]
    out = [(e, r, "param", n) for e, r, n in copy_errors(per_rank, ref["params"])]
    out += [(e, r, "update", n) for e, r, n in copy_errors(per_rank, ref["params"], base="params0",
                                                          ref_base=ref["params0"])]
    for k, ref_grads in enumerate(ref["grads"]):
        step = [{"grads": o["grads"][k]} for o in per_rank]
        out += [(e, r, f"grad step {k + 1}", n) for e, r, n in copy_errors(step, ref_grads, key="grads")]
    return out


def assert_qwen3_5_moe_parity(got, ref, tol=None) -> dict:
    """Every copy within its tolerance (module docstring; ``tol``: per kind, `SP_TOL` under text
    sequence parallelism); returns the worst error per kind."""
    assert_parity(got, ref, loss_tol=1e-8)  # loss and grad-norm of every step; hosted == reference
    errs = _errors(got, ref)
    assert len({(r, n) for _, r, what, n in errs if what.startswith("grad")}) > 0
    exact = [e for e in errs if not e[3].endswith(FP32_NORMS)]
    fp32 = [e for e in errs if e[3].endswith(FP32_NORMS)]
    limit = (lambda what: TOL) if tol is None else (lambda what: tol[what.split()[0]])
    bad = [e for e in exact if e[0] > limit(e[2])] + [e for e in fp32 if e[0] > FP32_TOL]
    assert not bad, "out of tolerance (error, rank, what, name):\n" + "\n".join(map(str, bad[:40]))
    return {"exact": max(exact)[:1], "fp32_norms": max(fp32)[:1]}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in DEFAULT else (pytest.mark.slow,), id=c)
                                  for c in CASES])
def test_qwen3_5_moe_is_exact(case, reference):
    _, steps, ref = reference()
    layout, changes = CASES[case]
    got = run_engine(FAMILY, layout, dataclasses.replace(CFG, **changes), steps, torch.float64,
                     grads=True)
    grads = ref["grads"][0]
    for part in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                 "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"):
        assert any(n.endswith(part) and g.abs().max() > 0 for n, g in grads.items()), part
    worst = assert_qwen3_5_moe_parity(got, ref, SP_TOL if layout.get("text_sequence_parallel") else None)
    print(case, worst)
    assert all(h["aux_loss"] > 0 for h in got["history"])
    ep = layout.get("text_ep", 1)
    # every text rank ran the dispatch and combine all-to-alls of every sparse layer (EP really on)
    calls = {o["comm"].get("all_to_all/text.experts", {}).get("calls", 0) for o in got["per_rank"]
             if "lm_head.weight" in o["params"]}
    layers = len(sparse_layers(demo.tiny_model_config(FAMILY).text_config))
    per_step = 2 * layers * CFG.optim.micro_batches * CFG.optim.num_steps
    if changes.get("activation_checkpointing"):  # recomputed blocks redo both in backward
        per_step *= 2
    assert calls == ({per_step} if ep > 1 else {0}), calls


@pytest.mark.slow
def test_qwen3_5_moe_lora_at_sp2_tp2(reference):
    """PEFT LoRA with the default targets at collocated SP2/TP2: the gated attention's q/k/v/o
    and the shared expert's gate/up/down (TP-sharded, their adapters get the dense MLP's plan);
    the router, the fused experts and ``shared_expert_gate`` stay frozen (`ray_dhp.models.lora`).
    Against the single-process PEFT model, fp64, 1e-10 (the frozen base holds the fp32-norm
    weights, which get no gradient; the loss 1e-8: the aux loss's fp32 sums). Every base weight
    of the language model stays bit-identical on every rank; the adapters move."""
    _, steps, _ = reference()
    cfg = dataclasses.replace(CFG, modules={"llm": {"lora": {"r": 4, "alpha": 8}}})
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, CASES["collocated-sp2-tp2"][0], cfg, steps, torch.float64)
    assert_parity(got, ref, loss_tol=1e-8, param_tol=1e-10, update_tol=1e-10)
    lora = {n for n in ref["params"] if ".lora_B." in n}
    assert any(".mlp.shared_expert." in n for n in lora) and any(".self_attn." in n for n in lora)
    assert not any(".experts." in n or "shared_expert_gate" in n or ".mlp.gate." in n for n in lora)
    assert all(ref["params0"][n].abs().max() == 0 < ref["params"][n].abs().max() for n in lora)
    for out in got["per_rank"]:
        for name in out["params"]:
            if name.startswith("model.language_model.") and ".lora_" not in name:
                assert torch.equal(out["params"][name], out["params0"][name]), name


@pytest.mark.slow
def test_qwen3_5_moe_directory_loads_sharded_at_ep2_and_exports(tmp_path):
    """``save_pretrained`` of the tiny model (per-expert tensor names, 100 KB files) read at
    collocated DP2 x EP2, each rank taking its experts' slices through transformers' conversion
    mapping (`ray_dhp.models.hf_convert`): the first step equals the stock ``from_pretrained``
    model's (loss 1e-8, the aux loss's fp32 sums; every rank's parameters and updates 1e-10, the
    fp32 norms 1e-5: module docstring); the checkpoint it writes exports a directory that
    ``from_pretrained`` loads with the trained weights, bit for bit."""
    import transformers

    from tests.distributed.parity import assert_export_round_trip, run_from_directory

    got, ref, ckpt = run_from_directory(tmp_path, FAMILY, CASES["collocated-dp2-ep2"][0],
                                        dataclasses.replace(CFG, num_steps=1))
    assert_parity(got, ref, loss_tol=1e-8)
    per_rank = got["per_rank"]
    errs = copy_errors(per_rank, ref["params"]) + copy_errors(per_rank, ref["params"], base="params0",
                                                              ref_base=ref["params0"])
    bad = [e for e in errs if e[0] > (FP32_TOL if e[2].endswith(FP32_NORMS) else TOL)]
    assert errs and not bad, bad[:20]
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), transformers.Qwen3_5MoeForConditionalGeneration,
                             got["params"])
