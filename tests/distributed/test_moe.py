"""Mixture-of-experts LM (``qwen3_vl_moe``): the DHP step equals the stock single-process model,
load-balancing loss included (`ray_dhp.models.moe` states over which tokens it is taken).

Each case: 3 steps, 2 micro-batches (so the aux loss's per-micro-batch statistics are split over
the text data-parallel ranks and averaged over micro-batches), clipping active, and checks the
loss (cross-entropy + ``router_aux_loss_coef`` x aux) and grad-norm of every step, every rank's
copy of every parameter and update, and every clipped gradient of every step — the routers
(``mlp.gate.weight``) and the fused experts (``mlp.experts.gate_up_proj`` / ``down_proj``)
among them. With EP, text ZeRO stage 1 (the default) also partitions the experts' AdamW moments
over the ranks holding the same experts (EDP replicas x TP ranks: the cases with ``tp2`` or
``edp2``); every rank's copy and the measured per-rank bytes (= the plan) check it.

Tolerances: gradients, parameters and updates 1e-10 as the dense fp64 matrix
(tests/distributed/test_parity.py). The loss 1e-9: the stock aux loss sums the routing
probabilities in fp32 (``routing_weights.float()``) even in an fp64 model, and a DP split sums
them in another order, ~1e-7 relative of the aux term, which weighs ``coef * aux / loss`` ~ 1e-2
of the loss: ~1e-9. The aux gradient is not affected: ``d aux / d P_e = E * C_e / (L N)^2`` is
computed from the same integer counts in the same fp32 operations on both sides.
"""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models.qwen3_vl_moe import sparse_layers
from tests.distributed.parity import moe_layout as _layout
from tests.distributed.parity import (CFG, assert_parity, make_steps, reference_fixture, run_engine,
                                      run_reference)

FAMILY = "qwen3_vl_moe"
TOLS = dict(loss_tol=1e-8, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)


moe_reference = reference_fixture(FAMILY, name="moe_reference")


CASES = [
    pytest.param("collocated", (1, 2), (1, 2), 2, id="collocated-dp2-ep2"),  # the default-run case
    pytest.param("collocated", (2, 1), (2, 1), 1, id="collocated-sp2-tp2", marks=pytest.mark.slow),
    pytest.param("disjoint", (1, 1), (1, 2), 1, id="disjoint-1v-2t-dp2", marks=pytest.mark.slow),
    pytest.param("collocated", (2, 2), (2, 2), 1, id="collocated-sp2dp2-tp2dp2", marks=pytest.mark.slow),
    pytest.param("disjoint", (1, 1), (1, 2), 2, id="disjoint-1v-2t-ep2", marks=pytest.mark.slow),
    pytest.param("collocated", (2, 2), (2, 2), 2, id="collocated-sp2dp2-tp2dp2-ep2", marks=pytest.mark.slow),
    pytest.param("collocated", (1, 4), (1, 4), 4, id="collocated-dp4-ep4", marks=pytest.mark.slow),
    # expert optimizer partition (parallel/expert.py expert_partition): over the 2 EDP replicas
    pytest.param("collocated", (1, 4), (1, 4), 2, id="collocated-dp4-ep2-edp2", marks=pytest.mark.slow),
    pytest.param("disjoint", (2, 1), (1, 2), 2, id="disjoint-sp2-ep2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("placement, vision, text, ep", CASES)
def test_moe_parity_fp64(placement, vision, text, ep, moe_reference):
    _, steps, ref = moe_reference()
    got = run_engine(FAMILY, _layout(placement, vision, text, ep), CFG, steps, torch.float64, grads=True)
    grads = ref["grads"][0]
    assert any(n.endswith("mlp.gate.weight") for n in grads)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in grads)
    assert_parity(got, ref, **TOLS)
    # every text rank ran the dispatch and combine all-to-alls of every sparse layer (EP really on)
    calls = {o["comm"].get("all_to_all/text.experts", {}).get("calls", 0) for o in got["per_rank"]
             if "lm_head.weight" in o["params"]}
    layers = len(sparse_layers(demo.tiny_model_config(FAMILY).text_config))
    assert calls == ({2 * layers * CFG.optim.micro_batches * CFG.optim.num_steps} if ep > 1 else {0}), calls
    assert all(h["aux_loss"] > 0 for h in got["history"])
    # per-rank bytes measured = the plan (`ray-dhp plan`: experts / ep, the rest as without EP);
    # the plan counts the fp32 policy, these runs hold fp64 tensors: exactly twice the bytes
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import policy_of
    from ray_dhp.parallel.topology import Topology

    topo = Topology.build(**_layout(placement, vision, text, ep))
    counts = count_params(demo.tiny_model_config(FAMILY))
    for rank, o in enumerate(got["per_rank"]):
        want = rank_state(counts, topo, rank, policy_of(CFG.precision))
        st = o["state"]
        assert (st["weights"], st["grads"], st["optimizer"]) == \
            (2 * want.weights, 2 * want.grads, 2 * want.optimizer), (rank, st, want)


@pytest.mark.slow
def test_moe_ep2_with_activation_checkpointing(moe_reference):
    """Recomputed blocks redo the dispatch/combine all-to-alls inside backward: the same order
    on every EP rank (the NCCL twin checks it), the router's statistics taken once (the hooks
    record only the first forward); the reference needs no recompute (same numbers)."""
    import dataclasses

    _, steps, ref = moe_reference()
    cfg = dataclasses.replace(CFG, activation_checkpointing=True)
    got = run_engine(FAMILY, _layout("collocated", (1, 2), (1, 2), 2), cfg, steps, torch.float64,
                     grads=True)
    assert_parity(got, ref, **TOLS)


@pytest.mark.slow
def test_bf16_mixed_expert_partition_state_equals_the_plan(tmp_path):
    """Under bf16_mixed the experts' fp32 masters and AdamW moments are split over their EDP
    replicas (DP4 x EP2): every rank's measured weights, gradients, masters and moments equal
    `rank_state` exactly (the fp64 cases above have no masters)."""
    import dataclasses

    from ray_dhp.planning.memory import rank_state

    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import policy_of
    from ray_dhp.parallel.topology import Topology

    cfg = dataclasses.replace(CFG, num_steps=1, precision="bf16_mixed")
    layout = _layout("collocated", (1, 4), (1, 4), 2)
    got = run_engine(FAMILY, layout, cfg, make_steps(tmp_path, FAMILY, cfg), None)
    topo, counts = Topology.build(**layout), count_params(demo.tiny_model_config(FAMILY))
    masters = set()
    for rank, o in enumerate(got["per_rank"]):
        want = rank_state(counts, topo, rank, policy_of(cfg.precision))
        st = o["state"]
        assert (st["weights"], st["grads"], st["masters"], st["optimizer"]) == \
            (want.weights, want.grads, want.masters, want.optimizer), (rank, st, want)
        masters.add(st["masters"])
    assert len(masters) > 1  # the ZeRO-1 partitions differ per rank (not a uniform split)


EXPERT_TP_CASES = [
    pytest.param("collocated", (2, 1), (2, 1), id="collocated-sp2-tp2-experts-tp"),  # default run
    pytest.param("collocated", (2, 2), (2, 2), id="collocated-sp2dp2-tp2dp2-experts-tp",
                 marks=pytest.mark.slow),
    pytest.param("disjoint", (1, 1), (2, 1), id="disjoint-1v-2t-tp2-experts-tp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("placement, vision, text", EXPERT_TP_CASES)
def test_moe_experts_tp_parity_fp64(placement, vision, text, moe_reference):
    """Experts sharded over the TP ranks by their intermediate dim (`ray_dhp.parallel.expert_tp`):
    the same parity as above (same tolerances: the partial sums over the TP ranks reorder fp64
    sums only), every rank holding half of every expert, per-rank bytes measured = the plan."""
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import policy_of
    from ray_dhp.parallel.topology import Topology

    _, steps, ref = moe_reference()
    layout = dict(_layout(placement, vision, text), text_expert_tp=True)
    got = run_engine(FAMILY, layout, CFG, steps, torch.float64, grads=True)
    assert_parity(got, ref, **TOLS)
    tc = demo.tiny_model_config(FAMILY).text_config
    layers = len(sparse_layers(tc))
    topo, counts = Topology.build(**layout), count_params(demo.tiny_model_config(FAMILY))
    for rank, o in enumerate(got["per_rank"]):
        if "lm_head.weight" not in o["params"]:
            continue
        # forward: the partial outputs' all-reduce and the gate/up all-gather, every sparse layer
        assert o["comm"]["all_reduce/text.experts_tp"]["calls"] == layers * CFG.optim.micro_batches * CFG.optim.num_steps
        assert o["comm"]["all_gather/text.experts_tp"]["calls"] == layers * CFG.optim.micro_batches * CFG.optim.num_steps
        want = rank_state(counts, topo, rank, policy_of(CFG.precision))
        st = o["state"]
        assert (st["weights"], st["grads"], st["optimizer"]) == \
            (2 * want.weights, 2 * want.grads, 2 * want.optimizer), (rank, st, want)
    # the plan: the experts' bytes halve on each TP rank against the replicated layout
    replicated = rank_state(counts, Topology.build(**_layout(placement, vision, text)), topo.world_size - 1,
                            policy_of(CFG.precision))
    experts = 3 * tc.num_experts * tc.moe_intermediate_size * tc.hidden_size * layers
    assert replicated.weights - rank_state(counts, topo, topo.world_size - 1, policy_of(CFG.precision)).weights \
        == experts // 2 * 4


@pytest.mark.slow
def test_moe_lora_at_ep2(moe_reference):
    """PEFT LoRA on the MoE LM (default targets: here the attention's q/k/v/o; the tiny model's
    layers are all sparse, so no dense MLP) with the experts partitioned over EP2: against the
    single-process PEFT model (fp64; tolerances as above, the aux loss's fp32 sums included:
    the router is frozen but routes, and its load-balancing loss still enters the loss). The
    router and every expert stay bit-identical on every rank; the adapters move."""
    import dataclasses

    _, steps, _ = moe_reference()
    cfg = dataclasses.replace(CFG, modules={"llm": {"lora": {"r": 4, "alpha": 8}}})
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, _layout("collocated", (1, 2), (1, 2), 2), cfg, steps, torch.float64)
    assert_parity(got, ref, loss_tol=1e-8, param_tol=1e-10, update_tol=1e-10)
    lora = {n for n in ref["params"] if ".lora_B." in n}
    assert lora and all(".self_attn." in n for n in lora)
    assert all(ref["params0"][n].abs().max() == 0 < ref["params"][n].abs().max() for n in lora)
    frozen = [n for n in ref["params"] if n.endswith(("mlp.gate.weight", "mlp.experts.gate_up_proj"))]
    assert frozen
    for out in got["per_rank"]:
        for name in out["params"]:
            if name.startswith("model.language_model.") and ".lora_" not in name:
                assert torch.equal(out["params"][name], out["params0"][name]), name


@pytest.mark.slow
def test_moe_bf16_mixed_losses_track_fp32(tmp_path):
    """bf16_mixed on the MoE LM at EP2 (bf16 weights and activations through the token
    all-to-alls, fp32 masters and gradient accumulation) against the same engine in fp32, same
    steps: every step's loss and aux loss within 5e-3 relative, the 3 steps' loss decrease within
    2e-2 of fp32's. Why: bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per weight and
    activation); the loss, a mean over ~100 tokens of log-probabilities, averages those roundings
    down (measured: 2.6e-4 relative at worst over the steps, 1.4e-3 of the decrease); a router
    whose top-2 margin is below the rounding may route a token elsewhere (discrete), which the
    margin absorbs. A real error (an expert dropped, a wrong aux term, a mis-scaled gradient)
    moves these by far more than 5e-3."""
    import dataclasses

    cfg = dataclasses.replace(CFG, precision="fp32")
    steps = make_steps(tmp_path, FAMILY, cfg)
    layout = _layout("collocated", (1, 2), (1, 2), 2)
    fp32 = run_engine(FAMILY, layout, cfg, steps, None)["history"]
    bf16 = run_engine(FAMILY, layout, dataclasses.replace(cfg, precision="bf16_mixed"), steps, None)["history"]
    for a, b in zip(fp32, bf16):
        assert abs(b["loss"] - a["loss"]) <= 5e-3 * a["loss"], (a["loss"], b["loss"])
        assert abs(b["aux_loss"] - a["aux_loss"]) <= 5e-3 * a["aux_loss"], (a["aux_loss"], b["aux_loss"])
    drop32, drop16 = fp32[0]["loss"] - fp32[-1]["loss"], bf16[0]["loss"] - bf16[-1]["loss"]
    assert drop32 > 0 and abs(drop16 - drop32) <= 2e-2 * drop32, (drop32, drop16)
    print("fp32", [h["loss"] for h in fp32], [h["aux_loss"] for h in fp32],
          "bf16_mixed", [h["loss"] for h in bf16], [h["aux_loss"] for h in bf16])
