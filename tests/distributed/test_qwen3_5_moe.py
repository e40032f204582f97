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
from tests.distributed.parity import CFG, assert_parity, copy_errors, reference_fixture, run_engine

FAMILY = "qwen3_5_moe"
FP32_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight", "language_model.norm.weight", "linear_attn.A_log")
TOL, FP32_TOL = 1e-10, 1e-5


CASES = {  # id: (layout, config changes)
    "collocated-sp2-tp2": (_layout("collocated", (2, 1), (2, 1)), {}),
    "collocated-dp2-ep2": (_layout("collocated", (1, 2), (1, 2), ep=2), {}),
    "collocated-sp2dp2-tp2dp2-ep2": (_layout("collocated", (2, 2), (2, 2), ep=2), {}),
    "disjoint-1v-2t-tp2": (_layout("disjoint", (1, 1), (2, 1)), {}),
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


def assert_qwen3_5_moe_parity(got, ref) -> dict:
    """Every copy within its tolerance (module docstring); returns the worst error per kind."""
    assert_parity(got, ref, loss_tol=1e-8)  # loss and grad-norm of every step; hosted == reference
    errs = _errors(got, ref)
    assert len({(r, n) for _, r, what, n in errs if what.startswith("grad")}) > 0
    exact = [e for e in errs if not e[3].endswith(FP32_NORMS)]
    fp32 = [e for e in errs if e[3].endswith(FP32_NORMS)]
    bad = [e for e in exact if e[0] > TOL] + [e for e in fp32 if e[0] > FP32_TOL]
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
    worst = assert_qwen3_5_moe_parity(got, ref)
    print(case, worst)
    assert all(h["aux_loss"] > 0 for h in got["history"])
    ep = layout.get("text_ep", 1)
    # every text rank ran the dispatch and combine all-to-alls of every sparse layer (EP really on)
    calls = {o["comm"].get("all_to_all/text.experts", {}).get("calls", 0) for o in got["per_rank"]
             if "lm_head.weight" in o["params"]}
    layers = len(sparse_layers(demo.tiny_model_config(FAMILY).text_config))
    per_step = 2 * layers * CFG.micro_batches * CFG.num_steps
    if changes.get("activation_checkpointing"):  # recomputed blocks redo both in backward
        per_step *= 2
    assert calls == ({per_step} if ep > 1 else {0}), calls
