"""Context parallelism of the LM (``text.context_parallel``): the key in the Python API and the
run file, the topology's cp axis, the driver's refusals naming the key, and the slice helpers
(the exactness itself: tests/distributed/test_context_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.layout import DHPConfig, ModuleParallel
from ray_dhp.parallel.context import local_rows, slice_sequence
from ray_dhp.parallel.nodes import fill_nodes
from ray_dhp.parallel.topology import Topology


def test_topology_puts_cp_between_dp_and_tp():
    t = Topology.build(placement="collocated", vision_dp=1, vision_sp=8, text_dp=2, text_tp=2,
                       text_cp=2)
    text = t.text
    assert t.world_size == 8 and text.size == 8 and t.text_context_parallel == 2
    assert text.inner_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # TP groups
    assert text.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert text.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients: dp x cp ranks
    assert [text.coord(r) for r in (2, 5)] == [(0, 0), (1, 1)]  # (data replica, tp rank)
    assert [text.cp_coord(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert "text(dp=1, cp=1, tp=0)" in t.describe()
    assert t.text.zero_stage == 1  # default: more than one gradient replica
    # node-local: a replica's cp x tp block stays on one 4-GPU node
    assert fill_nodes(t, 4) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_config_and_run_file_take_the_key(tmp_path):
    from ray_dhp.run_file import load_run_file

    cfg = DHPConfig(model=demo.tiny_model_config(), vision=ModuleParallel(sequence_parallel=4),
                    text=ModuleParallel(tensor_parallel=2, context_parallel=2))
    assert cfg.num_workers == 4 and cfg.topology().text.cp == 2
    path = tmp_path / "run.yaml"
    path.write_text("model: {demo: qwen2_5_vl}\nvision: {sequence_parallel: 2}\n"
                    "text: {context_parallel: 2}\n")
    assert load_run_file(str(path), []).dhp_config().topology().text.cp == 2


@pytest.mark.parametrize("family, kw, match", [
    ("qwen3_5", dict(vision=ModuleParallel(sequence_parallel=4),
                     text=ModuleParallel(tensor_parallel=2, context_parallel=4), placement="disjoint"),
     r"text.context_parallel=4: text.tensor_parallel x text.context_parallel = 8 does not divide "
     r"the 4 linear-attention key heads"),
    ("qwen2_5_vl", dict(vision=ModuleParallel(context_parallel=2), text=ModuleParallel(data_parallel=2)),
     "vision.context_parallel"),
    ("qwen3_5_moe", dict(vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(context_parallel=2)),
     "linear-attention layers"),
    ("qwen3_5", dict(vision=ModuleParallel(sequence_parallel=4),
                     text=ModuleParallel(context_parallel=2, tensor_parallel=2, sequence_parallel=True)),
     "linear-attention layers under text.sequence_parallel"),
    ("qwen3_vl_moe", dict(vision=ModuleParallel(sequence_parallel=2),
                          text=ModuleParallel(context_parallel=2, expert_parallel=4)),
     r"text.expert_parallel=4 must be a positive integer dividing text.data_parallel x "
     r"text.context_parallel \(1 x 2\)"),
    ("qwen3_vl_moe", dict(vision=ModuleParallel(sequence_parallel=4),
                          text=ModuleParallel(context_parallel=2, tensor_parallel=2,
                                              expert_tensor_parallel=True)),
     "text.context_parallel > 1 is not covered with text.expert_tensor_parallel"),
])
def test_driver_refuses_naming_the_key(family, kw, match):
    with pytest.raises(ValueError, match=match):
        DHPConfig(model=demo.tiny_model_config(family), **kw)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_deepstack_moe_and_linear_attention_families_are_accepted(family):
    """Qwen3-VL's deepstack rows cross the boundary with the merged rows (each CP rank gets its
    slice's) and are added on the local slice; a MoE LM routes per token and its load-balancing
    statistics are reduced over the dp x cp ranks; Qwen3.5's Gated DeltaNet layers are
    head-sharded by all-to-all (`ray_dhp.parallel.context_mixers`): exact
    (tests/distributed/test_context_parallel.py)."""
    cfg = DHPConfig(model=demo.tiny_model_config(family), vision=ModuleParallel(sequence_parallel=2),
                    text=ModuleParallel(context_parallel=2))
    assert cfg.topology().text.cp == 2


def test_packing_with_cp_passes_the_driver(tmp_path):
    """``data.packing`` with ``text.context_parallel`` is accepted (exact: the slow
    tests/distributed/test_context_parallel_packing.py)."""
    from ray_dhp.run_file import load_run_file

    path = tmp_path / "run.yaml"
    path.write_text("model: {demo: qwen2_5_vl}\nvision: {sequence_parallel: 2}\n"
                    "text: {context_parallel: 2}\ndata: {packing: true}\n")
    load_run_file(str(path), []).validate()


def test_slices_and_their_feature_rows():
    t = torch.arange(12).view(2, 6)
    assert slice_sequence(t, 2, 1).tolist() == [[3, 4, 5], [9, 10, 11]]
    with pytest.raises(ValueError, match="not a multiple"):
        slice_sequence(torch.zeros(1, 5), 2, 0)
    # sample 0: rows at tokens 1, 2, 4; sample 1 (shorter, padded to 6): rows at 0, 3
    masks = [torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool), torch.tensor([1, 0, 0, 1], dtype=torch.bool)]
    assert local_rows(masks, 6, 2, 0).tolist() == [0, 1, 3]  # tokens 0-2
    assert local_rows(masks, 6, 2, 1).tolist() == [2, 4]     # tokens 3-5
    # packed: a sample with rows at its tokens 0, 1 lies at column 2 of its row: the cut at 3
    # falls between its rows (one padded row each, both would be in the first slice)
    two = [torch.tensor([1, 1, 0], dtype=torch.bool)]
    assert local_rows(two, 6, 2, 0).tolist() == [0, 1]
    assert local_rows(two, 6, 2, 0, starts=[2]).tolist() == [0]
    assert local_rows(two, 6, 2, 1, starts=[2]).tolist() == [1]


def test_segment_attention_keeps_samples_apart():
    """`segment_attention` on packed rows equals causal attention of each segment alone."""
    from ray_dhp.parallel.context import segment_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 3, 8, 13, 16])  # row 0: [0, 3) [3, 8); row 1: [0, 5) [5, 8)
    out = segment_attention(q, k, v, cu)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for r, lo, hi in [(0, 0, 3), (0, 3, 8), (1, 0, 5), (1, 5, 8)]:
        alone = sdpa(q[r:r + 1, :, lo:hi], k[r:r + 1, :, lo:hi], v[r:r + 1, :, lo:hi], is_causal=True)
        assert torch.equal(out[r:r + 1, :, lo:hi], alone)
    assert not torch.allclose(out, sdpa(q, k, v, is_causal=True))
    with pytest.raises(ValueError, match="crosses the end of row"):
        segment_attention(q, k, v, torch.tensor([0, 10, 16]))


def test_planner_divides_lm_activations_by_cp():
    """`text_activation_bytes` at CP: the saved activations of the rank's slice (``tokens / cp``)
    plus the attention output in the reverse all-to-all's buffer (``o_proj`` keeps it), so
    ~1/(tp x cp) of the tokens' bytes; the all-to-all send/receive buffers of q, k, v and the
    output are the transient working set (`cp_working_bytes`), in the rank's total, not its
    saved activations. `ray-dhp plan` prints the CP degree and its groups, and the text state is
    partitioned over the dp x cp gradient replicas (ZeRO-1 here: each CP rank updates half)."""
    import re

    from ray_dhp.cli.plan import plan_text
    from ray_dhp.planning.memory import ActivationSettings, cp_working_bytes, text_activation_bytes
    from ray_dhp.run_file import load_run_file

    tc = demo.tiny_model_config().text_config  # h 64, 4 heads (4 KV), head_dim 16, 2 layers
    s = ActivationSettings(dtype_bytes=2, attention="flash", checkpointing=False)
    full = text_activation_bytes(tc, 65536, 2, s)
    for cp in (2, 4):
        got = text_activation_bytes(tc, 65536, 2, s, cp=cp)
        back = 65536 / cp * 64 / 2 * 2 * 2  # tokens x h / tp x bytes x layers
        assert got == text_activation_bytes(tc, 65536 / cp, 2, s) + back
        assert full / cp < got < full / cp * 1.1
    buffers = 2 * (65536 / 2) * (2 * 64 + 2 * 4 * 16) / 2 * 2  # qkvo / tp, x2 (send, recv)
    assert cp_working_bytes(tc, 65536, 2, 2, s) == buffers
    # TP2 x CP4 on 4 heads: beyond the heads, ring attention (`ray_dhp.planning.ring_cost`): the
    # swap halves of q, k, v (2 bytes), 2 K/V blocks + 2 dK/dV accumulators and dq (fp32), one
    # tile pair's scores (3 x 2 heads x 1024^2 x 4 bytes), for 16,384 tokens per rank
    n = 65536 / 4
    ring = n * 2 * (32 + 2 * 32) + n * 4 * (8 * 32 + 32) + 3 * 2 * 1024 ** 2 * 4
    assert cp_working_bytes(tc, 65536, 2, 4, s) == ring
    assert cp_working_bytes(tc, 65536, 2, 1, s) == 0
    # a sample padded to a multiple of cp: 43 tokens -> 2 slices of 22
    assert text_activation_bytes(tc, 43, 2, s, 43, cp=2) == text_activation_bytes(tc, 44, 2, s, 44, cp=2)
    gqa = tc.__class__(**{**tc.to_dict(), "num_key_value_heads": 2})  # 1 KV head per TP rank,
    # repeated to the query heads before the all-to-all: the buffers of 4 KV heads
    assert cp_working_bytes(gqa, 1024, 2, 2, s) == cp_working_bytes(tc, 1024, 2, 2, s)

    example = "examples/qwen2_5_vl_32b_8gpu.yaml"
    text = {cp: plan_text(load_run_file(example, ["text.tensor_parallel=4", f"text.context_parallel={cp}",
                                                  f"vision.sequence_parallel={4 * cp}"]),
                          vision_tokens=[4096], text_tokens=65536) for cp in (1, 2)}
    assert "context parallel 2 (text.context_parallel" in text[2]
    assert "cp groups [[0, 4], [1, 5], [2, 6], [3, 7]]" in text[2]
    act = {cp: float(re.search(r"rank 0 memory: .*text act +([\d.]+) GiB", t).group(1))
           for cp, t in text.items()}
    assert 0.5 < act[2] / act[1] < 0.55, act  # ~1/2 plus o_proj's input buffer
    assert "+ CP all-to-all buffers" in text[2] and "CP all-to-all" not in text[1]


def test_plan_partitions_text_state_over_dp_x_cp():
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.step.precision import POLICIES

    counts = count_params(demo.tiny_model_config())
    pol = POLICIES["fp32"]
    one = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=2, text_tp=1)
    cp2 = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=1,
                         text_cp=2)
    # CP ranks partition the LM's optimizer state like data-parallel replicas (ZeRO-1)
    assert [rank_state(counts, cp2, r, pol) for r in (0, 1)] == \
        [rank_state(counts, one, r, pol) for r in (0, 1)]


def test_expert_parallel_groups_take_the_cp_ranks():
    """CP2 x EP2 (one replica): the EP group is the replica's two CP ranks; with DP2 the experts'
    replicas are the dp x cp rows with the same EP index (`ray_dhp.parallel.expert`)."""
    from ray_dhp.parallel.expert import edp_groups, ep_groups, replica_groups, replica_index
    from ray_dhp.parallel.topology import Topology

    t = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=1,
                       text_cp=2, text_ep=2).text
    assert ep_groups(t, 2) == [[0, 1]] and edp_groups(t, 2) == [[0], [1]]
    t = Topology.build(placement="collocated", vision_dp=1, vision_sp=8, text_dp=2, text_tp=2,
                       text_cp=2, text_ep=2).text  # ranks (dp, cp, tp) row-major
    assert ep_groups(t, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp_groups(t, 2) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert replica_groups(t, 2) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert [replica_index(t, 2, r) for r in (0, 4, 1, 5)] == [0, 1, 2, 3]


def test_linear_attention_heads_bound_the_cp_degree():
    """tp x cp must divide the Gated DeltaNet's key heads too (family fact: `cp_mixers`)."""
    from ray_dhp.models.qwen3_5 import cp_mixers
    from ray_dhp.parallel.context import refusal
    from ray_dhp.models import family_of

    config = demo.tiny_model_config("qwen3_5")
    config.text_config.linear_num_key_heads = 2  # 4 value heads: 2 per key head
    config.text_config.linear_num_value_heads = 4
    assert cp_mixers(config.text_config)[0][0] == "linear_attn"
    why = refusal(family_of(config), config, 4, 1)
    assert "does not divide the 2 linear-attention key heads" in why and "text.context_parallel=4" in why
    assert refusal(family_of(config), config, 2, 1) is None


def test_recommend_ranks_context_parallel_degrees():
    """`recommend(..., context_parallel=True)` (``ray-dhp plan --recommend --context-parallel``)
    adds every text CP degree: each candidate's run-file fragment builds the same workers, the
    cost model divides the LM's compute by CP and adds its all-to-alls, and a CP degree beyond
    the heads is priced as ring attention (`ray_dhp.planning.ring_cost`)."""
    from ray_dhp.planning.recommend import Workload, enumerate_layouts, recommend

    config = demo.tiny_model_config()  # 4 heads
    assert {lay.text_cp for lay in enumerate_layouts(4, 1)} == {1}
    assert {lay.text_cp for lay in enumerate_layouts(4, 1, context_parallel=True)} == {1, 2, 3, 4}
    cands = recommend(config, 4, Workload(1024, 4096, 4), context_parallel=True)
    cp = [c for c in cands if c.layout.text_cp > 1]
    assert cp and all(c.layout.text_cp > 1 for c in cp if "cp" in c.layout.describe())
    for c in cp:
        frag = c.layout.run_file_fragment()
        assert frag["text"]["context_parallel"] == c.layout.text_cp
        assert c.layout.num_workers == 4
    # disjoint 1 + 3: 3 does not divide 4 heads: ring attention, priced (its point-to-point)
    three = [c for c in cp if c.layout.text_cp == 3]
    assert three and all(c.feasible and c.phases.text_comm > 0 for c in three), three
    by = {(c.layout.placement, c.layout.vision_sp, c.layout.text_tp, c.layout.text_cp, c.layout.text_sp,
           c.layout.text_zero): c for c in cands if c.feasible}
    one, two = by.get(("collocated", 4, 1, 1, False, None)), by.get(("collocated", 4, 1, 2, False, None))
    # DP4 vs CP2 x DP2: the same tokens per rank (compute), plus CP's all-to-alls
    assert one and two and one.phases.text_comm == 0 < two.phases.text_comm
    compute = [c.phases.text - c.phases.text_comm for c in (one, two)]
    assert abs(compute[0] - compute[1]) < 1e-9 * compute[0]


def test_traffic_reduces_text_gradients_over_dp_x_cp():
    """`planning.traffic`: each CP rank back-propagates its slice, so the text gradients are
    reduced over the dp x cp replicas (the engine's ``dp_groups``): CP2 x DP1 sends what DP2
    does (it sent nothing before), per ZeRO stage; the groups are the dp x cp ranks; the TP
    all-reduces carry the rank's ``1 / cp`` of the tokens; the q/k/v/output all-to-alls appear
    under CP only (the engine's bytes: the slow tests/distributed/test_context_parallel.py)."""
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.zero import replica_bytes
    from ray_dhp.planning.cost_types import Layout, Workload
    from ray_dhp.planning.traffic import collective_bytes, collective_groups

    config = demo.tiny_model_config("qwen2_5_vl")
    counts = count_params(config)

    def plan(tp=1, dp=1, cp=1, zero=0):
        layout = Layout("collocated", "sequential", tp * dp * cp, 1, tp, dp, text_zero=zero, text_cp=cp)
        return collective_bytes(config, counts, layout, Workload(1024, 64, 4)), layout.topology()

    for zero in (0, 1, 2, 3):
        (cp2, topo), (dp2, _) = plan(cp=2, zero=zero), plan(dp=2, zero=zero)
        assert cp2["text dp gradients"] == dp2["text dp gradients"] > 0
        assert cp2["text dp gradients"] == replica_bytes(2, zero, counts.text * 4, counts.text * 4)
    assert plan()[0]["text dp gradients"] == 0 and plan()[0]["text cp all-to-all"] == 0
    groups = collective_groups(topo, 4)
    assert groups["text dp gradients"] == topo.text.dp_groups() == [[0, 1]]
    assert groups["text cp all-to-all"] == topo.text.cp_groups() == [[0, 1]]
    assert cp2["text cp all-to-all"] > 0
    tp2, tp2cp2 = plan(tp=2)[0], plan(tp=2, cp=2)[0]
    assert tp2cp2["text tp all-reduce"] == tp2["text tp all-reduce"] / 2


def test_ring_traffic_is_priced_beyond_the_heads():
    """CP3 on 4 heads runs ring attention: `planning.traffic` lists its point-to-point under
    ``text cp ring`` (none under the all-to-all), the CP group its ranks; CP2 the reverse. The
    ring's bytes per layer are `ring_sent_bytes`, which tests/distributed/test_ring_attention.py
    checks against the bytes the ring records."""
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.cost_types import Layout, Workload
    from ray_dhp.planning.ring_cost import ring_form
    from ray_dhp.planning.traffic import collective_bytes, collective_groups

    config = demo.tiny_model_config("qwen2_5_vl")
    tc = config.text_config
    assert ring_form(tc, 1, 3) and ring_form(tc, 2, 4) and not ring_form(tc, 2, 2)
    for cp, ring in ((3, True), (2, False)):
        layout = Layout("disjoint", "sequential", 1, 1, 1, 1, text_cp=cp)
        got = collective_bytes(config, count_params(config), layout, Workload(1024, 64, 4))
        assert (got["text cp ring"] > 0) == ring and (got["text cp all-to-all"] > 0) != ring, got
        groups = collective_groups(layout.topology(), 4)
        assert groups["text cp ring"] == groups["text cp all-to-all"] == layout.topology().text.cp_groups()
