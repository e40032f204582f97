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
from tests.distributed.parity import CFG, assert_parity, make_steps, reference_fixture, run_engine

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
    assert calls == ({2 * layers * CFG.micro_batches * CFG.num_steps} if ep > 1 else {0}), calls
    assert all(h["aux_loss"] > 0 for h in got["history"])
    # per-rank bytes measured = the plan (`ray-dhp plan`: experts / ep, the rest as without EP);
    # the plan counts the fp32 policy, these runs hold fp64 tensors: exactly twice the bytes
    from ray_dhp.planning.memory import count_params, rank_state
    from ray_dhp.step.precision import policy_of
    from ray_dhp.step.topology import Topology

    topo = Topology.build(**_layout(placement, vision, text, ep))
    counts = count_params(demo.tiny_model_config(FAMILY))
    for rank, o in enumerate(got["per_rank"]):
        want = rank_state(counts, topo, rank, policy_of(CFG))
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

    from ray_dhp.planning.memory import count_params, rank_state
    from ray_dhp.step.precision import policy_of
    from ray_dhp.step.topology import Topology

    cfg = dataclasses.replace(CFG, num_steps=1, precision="bf16_mixed")
    layout = _layout("collocated", (1, 4), (1, 4), 2)
    got = run_engine(FAMILY, layout, cfg, make_steps(tmp_path, FAMILY, cfg), None)
    topo, counts = Topology.build(**layout), count_params(demo.tiny_model_config(FAMILY))
    masters = set()
    for rank, o in enumerate(got["per_rank"]):
        want = rank_state(counts, topo, rank, policy_of(cfg))
        st = o["state"]
        assert (st["weights"], st["grads"], st["masters"], st["optimizer"]) == \
            (want.weights, want.grads, want.masters, want.optimizer), (rank, st, want)
        masters.add(st["masters"])
    assert len(masters) > 1  # the ZeRO-1 partitions differ per rank (not a uniform split)
