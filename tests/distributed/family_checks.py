"""The per-family checks of the parity matrix (`family_rows.Row.check`), where a family is held to
more than `tests.distributed.parity.assert_parity` with one tolerance: fp32-computed norms held per
name, the load-balancing loss and expert-parallel traffic really present, a tower that must not
move. Each takes ``(got, ref, case)`` (`run_engine`'s and `run_reference`'s results and the
`family_rows.Case`); the families' extra cases (`test_qwen3_5.py`, `test_qwen3_5_moe.py`) use the
same assertions."""

from __future__ import annotations

import torch

from ray_dhp import demo
from tests.distributed.generic_cases import ZERO_GRAD
from tests.distributed.parity import assert_parity, copy_errors

# -- Qwen3.5 ---------------------------------------------------------------------------------------
# 1e-10 relative (fp64: only summation orders differ), except the gated attention's per-head
# ``q_norm``/``k_norm`` weights. The stock ``Qwen3_5RMSNorm`` computes in fp32 even in an fp64 model
# (``x.float()``, ``weight.float()``), so their gradient is an fp32 sum over tokens and heads; under
# TP each rank sums its own heads in fp32 and the all-reduce adds the partial sums: another
# summation order of fp32 terms. Two orders of an N-term fp32 sum differ by ~sqrt(N) u (u = 6e-8)
# of the terms' size; N = tokens x local heads ~ 150 x 4, sqrt(N) u ~ 1.5e-6; AdamW's per-entry
# normalisation passes an entry's relative gradient error into its update at most unchanged.
# Measured 2e-8..1e-7 (gradients, parameters and updates); 1e-5 leaves the margin, while a missing
# all-reduce (the partial sum of half the heads) is an O(1) error. The other Qwen3_5RMSNorm weights
# (layer norms, final norm) are replicated whole under TP and summed in the reference's order:
# they pass at 1e-10 without text SP; with it they run on sequence shards (DTensor
# ``SequenceParallel``), so their gradients become the same kind of fp32 partial sums (over tokens)
# and take the same 1e-5 (measured 3e-8..3e-7). The Gated DeltaNet's gated norm computes in the
# model's dtype: 1e-10.
QWEN3_5_FP32_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
QWEN3_5_SEQUENCE_FP32_NORMS = QWEN3_5_FP32_NORMS + (
    "input_layernorm.weight", "post_attention_layernorm.weight", "language_model.norm.weight")


def assert_qwen3_5_parity(got, ref, text_sp=False):
    fp32 = QWEN3_5_SEQUENCE_FP32_NORMS if text_sp else QWEN3_5_FP32_NORMS
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, skip=fp32)
    per_rank = [{k: {n: t for n, t in o[k].items() if n.endswith(fp32)} for k in ("params", "params0")}
                for o in got["per_rank"]]
    errs = (copy_errors(per_rank, ref["params"])
            + copy_errors(per_rank, ref["params"], base="params0", ref_base=ref["params0"]))
    assert errs and max(errs)[0] < 1e-5, max(errs)


def qwen3_5(got, ref, case):
    assert_qwen3_5_parity(got, ref, text_sp=case.layout["text_sequence_parallel"])


# -- Qwen3.5-MoE -----------------------------------------------------------------------------------
# * 1e-10 for parameters, updates and gradients as the dense fp64 matrix (only summation orders
#   differ), except the zero-centred ``Qwen3_5MoeRMSNorm`` weights (``input_layernorm``,
#   ``post_attention_layernorm``, the final ``norm``, the gated attention's ``q_norm``/``k_norm``).
#   That norm computes in fp32 even in an fp64 model (``x.float()``, ``weight.float()``), so the
#   gradient of its weight is an fp32 sum over tokens (and heads). A rank that sums only part of
#   the terms — its TP heads (``q_norm``/``k_norm``, all-reduced), or its data-parallel replica's
#   tokens (every such norm, summed over the replicas) — adds fp32 partial sums in another order.
#   Two orders of an N-term fp32 sum differ by ~sqrt(N) u (u = 6e-8) of the terms' size; N ~ 600
#   (tokens x heads) gives ~1.5e-6, and AdamW's per-entry normalisation passes an entry's relative
#   gradient error into its update at most unchanged. Those weights (gradients, parameters,
#   updates) take 1e-5 (measured below 1e-6; a missing reduction is an O(1) error). So does the
#   Gated DeltaNet's ``A_log`` (``-A_log.float().exp()``: an fp32 sum over the tokens, split over
#   the data-parallel replicas; measured 5e-8). Its gated norm and ``dt_bias`` (added to an fp32
#   tensor: promoted to fp64) compute in the model's dtype: 1e-10.
# * the loss 1e-8 (as ``test_moe.py``): the stock aux loss sums the routing probabilities in fp32
#   (``routing_weights.float()``) even in an fp64 model; a DP split sums them in another order,
#   ~1e-7 of the aux term, which weighs ~1e-2 of the loss. The aux *gradient* is not affected
#   (``d aux / d P_e = E C_e / (L N)^2``: the same integer counts and fp32 operations).
QWEN3_5_MOE_FP32_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
                          "post_attention_layernorm.weight", "language_model.norm.weight",
                          "linear_attn.A_log")
QWEN3_5_MOE_TOL, QWEN3_5_MOE_FP32_TOL = 1e-10, 1e-5
# With text sequence parallelism the fp32 layer/final norms run on sequence shards, so their
# gradients are fp32 partial sums over tokens (~1e-7 relative, the fp32 tolerance), as for
# Qwen3.5. AdamW's first update is lr * sign(g) (m / sqrt(v) = g / |g|), blind to that; the second
# is not, so from step 3 every forward sees norm weights ~1e-8..1e-7 off and every fp64 gradient
# follows (measured: steps 1-2 gradients 3e-12, step 3 1.2e-7; parameters 7.6e-10, updates 2.4e-9
# after lr = 1e-3 scales them). A missing reduction or a wrong shard is an O(1) error.
QWEN3_5_MOE_SP_TOL = {"param": 1e-8, "update": 1e-8, "grad": 1e-6}


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
    """Every copy within its tolerance (above; ``tol``: per kind, `QWEN3_5_MOE_SP_TOL` under text
    sequence parallelism); returns the worst error per kind."""
    assert_parity(got, ref, loss_tol=1e-8)  # loss and grad-norm of every step; hosted == reference
    errs = _errors(got, ref)
    assert len({(r, n) for _, r, what, n in errs if what.startswith("grad")}) > 0
    exact = [e for e in errs if not e[3].endswith(QWEN3_5_MOE_FP32_NORMS)]
    fp32 = [e for e in errs if e[3].endswith(QWEN3_5_MOE_FP32_NORMS)]
    limit = (lambda what: QWEN3_5_MOE_TOL) if tol is None else (lambda what: tol[what.split()[0]])
    bad = [e for e in exact if e[0] > limit(e[2])] + [e for e in fp32 if e[0] > QWEN3_5_MOE_FP32_TOL]
    assert not bad, "out of tolerance (error, rank, what, name):\n" + "\n".join(map(str, bad[:40]))
    return {"exact": max(exact)[:1], "fp32_norms": max(fp32)[:1]}


def qwen3_5_moe(got, ref, case):
    """Every sparse part has a gradient, every copy within its tolerance, the aux loss on, and every
    text rank ran the dispatch and combine all-to-alls of every sparse layer (EP really on)."""
    from ray_dhp.models.qwen3_5_moe import sparse_layers

    grads = ref["grads"][0]
    for part in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                 "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"):
        assert any(n.endswith(part) and g.abs().max() > 0 for n, g in grads.items()), part
    sp = case.layout.get("text_sequence_parallel")
    worst = assert_qwen3_5_moe_parity(got, ref, QWEN3_5_MOE_SP_TOL if sp else None)
    print(case.id, worst)
    assert all(h["aux_loss"] > 0 for h in got["history"])
    ep = case.layout.get("text_ep", 1)
    calls = {o["comm"].get("all_to_all/text.experts", {}).get("calls", 0) for o in got["per_rank"]
             if "lm_head.weight" in o["params"]}
    layers = len(sparse_layers(demo.tiny_model_config(case.row.family).text_config))
    optim = case.row.cfg.optim
    per_step = 2 * layers * optim.micro_batches * optim.num_steps
    if case.changes.get("activation_checkpointing"):  # recomputed blocks redo both in backward
        per_step *= 2
    assert calls == ({per_step} if ep > 1 else {0}), calls


# -- the generic families --------------------------------------------------------------------------

def zero_grad_is_noise(got, ref, case, suffixes=ZERO_GRAD):
    """The key biases left out of the comparison (`generic_cases.ZERO_GRAD`, an exact gradient of
    0) have a gradient below 1e-12 of the step's gradient norm in both runs, every step (on each
    rank, the norm of the gradients it holds: none on a rank whose module had no input)."""
    for run in [ref["grads"]] + [o["grads"] for o in got["per_rank"]]:
        for grads in filter(None, run):
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
            noise = [float(g.norm() / norm) for n, g in grads.items() if n.endswith(suffixes)]
            assert max(noise, default=0.0) < 1e-12, noise


def experts_really_parallel(got, ref, case):
    """The router and the fused experts have gradients, and every text rank dispatched (EP:
    all-to-all) or all-reduced (experts TP) every sparse layer."""
    grads = ref["grads"][0]  # GLM-4.5V's mlp.gate / mlp.experts, ERNIE's mlp.text_moe.gate / ...
    assert any(n.endswith(".gate.weight") and ".mlp." in n for n in grads)
    assert any(n.endswith(".experts.gate_up_proj") and ".mlp." in n for n in grads)
    key = "all_reduce/text.experts_tp" if case.layout.get("text_expert_tp") else "all_to_all/text.experts"
    calls = [o["comm"].get(key, {}).get("calls", 0) for o in got["per_rank"]
             if any("language_model" in n for n in o["params"])]
    assert calls and min(calls) > 0, calls


# -- the Qwen2.5-Omni thinker ----------------------------------------------------------------------

def omni(got, ref, case):
    """The audio tower (held by the text ranks, no sample has audio) gets no gradient: bit-identical
    to its initial values on both sides."""
    audio = [n for n in ref["params"] if n.startswith("model.audio_tower.")]
    assert audio and all(torch.equal(ref["params"][n], ref["params0"][n]) for n in audio)
    assert all(torch.equal(o["params"][n], o["params0"][n]) for o in got["per_rank"]
               for n in audio if n in o["params"])


#: Qwen3-Omni's audio tower: its attention's key biases (no rotary: a softmax ignores a shift
#: shared by every key, so their gradient is exactly 0 and what is computed is rounding noise,
#: which AdamW's per-entry normalisation turns into updates of up to lr)
OMNI3_ZERO_GRAD = ("audio_tower.layers.0.self_attn.k_proj.bias",
                   "audio_tower.layers.1.self_attn.k_proj.bias")


def omni_audio(got, ref, case):
    """The audio tower trains in a group of its own: some rank holds it whole, and the clips move
    it (on both sides, every copy compared by the tolerances); its key biases, left out of the
    comparison (`OMNI3_ZERO_GRAD`), have a gradient that is noise."""
    zero_grad_is_noise(got, ref, case, OMNI3_ZERO_GRAD)
    audio = [n for n in ref["params"] if n.startswith("model.audio_tower.")]
    assert audio and any(not torch.equal(ref["params"][n], ref["params0"][n]) for n in audio)
    held = [o for o in got["per_rank"] if any(n in o["params"] for n in audio)]
    assert held, "no rank holds the audio tower"
    assert all(set(audio) <= set(o["params"]) for o in held), "a rank holds part of the tower"


# -- InternVL3.5: InternVL with a Qwen3 language model (test_internvl.py, tests/ray) ---------------

def internvl3_5_config():
    """The tiny InternVL with a Qwen3 LM (per-head q/k RMSNorms, head_dim 16), as InternVL3.5: the
    demo's ``internvl3_5`` model (`ray_dhp.demo.tiny_model_config`), which ``model.demo`` names."""
    from ray_dhp import demo

    return demo.tiny_model_config("internvl3_5")
