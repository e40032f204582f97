"""Context parallelism of the language model (``text.context_parallel``, Ulysses all-to-all around
attention, `ray_dhp.parallel.context`) is exact: loss, grad-norm, every clipped gradient of every
step, every parameter and every update on every rank's copy equal the single-process reference
in fp64.

Tolerance 1e-10 (as ``test_parity.py``): a CP rank computes the same terms as the reference —
attention over the whole sequence for its heads, the rest on its slice — so only summation
orders differ (the gradient sum over the CP ranks, the loss sum over slices), ~1e-13 in fp64.

The parity batches (mixed image sizes, a text-only sample, 2 micro-batches, clipping active)
have lengths that are mostly not multiples of 2 x CP, so the pad-to-CP path and slices that cut
an image's rows between ranks run in the default case.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import assert_parity, copy_errors, reference_fixture, run_engine


def _layout(placement, vision, text, cp, text_sp=False, zero=None, ep=1):
    (sp, vdp), (tp, tdp) = vision, text
    out = dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp,
               text_cp=cp, text_sequence_parallel=text_sp, text_ep=ep)
    if zero is not None:
        out["text_zero"] = zero
    return out


CASES = [  # (id, family, placement, vision (sp, dp), text (tp, dp), cp, text sp, text zero)
    ("cp2-collocated", "qwen2_5_vl", "collocated", (2, 1), (1, 1), 2, False, None),
    ("cp2-tp2", "qwen2_5_vl", "collocated", (4, 1), (2, 1), 2, False, None),
    ("cp4", "qwen2_vl", "collocated", (2, 2), (1, 1), 4, False, None),
    ("cp2-tp2-textsp", "qwen2_5_vl", "collocated", (2, 2), (2, 1), 2, True, None),
    ("cp2-disjoint", "qwen2_5_vl", "disjoint", (1, 1), (1, 1), 2, False, None),
    ("cp2-dp2", "qwen2_vl", "collocated", (2, 2), (1, 2), 2, False, None),
    ("cp2-zero2", "qwen2_5_vl", "collocated", (2, 1), (1, 1), 2, False, 2),
    ("cp2-zero3", "qwen2_5_vl", "collocated", (2, 1), (1, 1), 2, False, 3),
    ("qwen3_vl-cp2", "qwen3_vl", "collocated", (2, 1), (1, 1), 2, False, None),
    ("qwen3_vl-cp2-tp2-textsp", "qwen3_vl", "collocated", (4, 1), (2, 1), 2, True, None),
    ("qwen3_vl_moe-cp2", "qwen3_vl_moe", "collocated", (2, 1), (1, 1), 2, False, None),
    ("qwen3_vl_moe-cp2-dp2", "qwen3_vl_moe", "collocated", (2, 2), (1, 2), 2, False, None),
    # expert parallelism over the CP ranks (the EP group is the replica's 2 CP ranks: each
    # dispatches its slice's tokens), and over dp x cp with ZeRO-1 over the expert replicas
    ("qwen3_vl_moe-cp2-ep2", "qwen3_vl_moe", "collocated", (2, 1), (1, 1), 2, False, None, 2),
    ("qwen3_vl_moe-cp2-dp2-ep2", "qwen3_vl_moe", "collocated", (2, 2), (1, 2), 2, False, 1, 2),
    ("qwen3_vl_moe-cp2-tp2-ep2", "qwen3_vl_moe", "collocated", (4, 1), (2, 1), 2, False, None, 2),
    # Gated DeltaNet layers head-sharded by all-to-all (`ray_dhp.parallel.context_mixers`)
    ("qwen3_5-cp2", "qwen3_5", "collocated", (2, 1), (1, 1), 2, False, None),
    ("qwen3_5-cp2-tp2", "qwen3_5", "collocated", (4, 1), (2, 1), 2, False, None),
]


# Qwen3.5's ``Qwen3_5RMSNorm`` computes in fp32 even in an fp64 model (``x.float()``), so a norm
# weight's gradient is an fp32 sum over tokens (and, for the per-head q/k norms, heads). Under CP
# each rank sums its slice's tokens (and its heads) and the dp x cp gradient sum adds the partial
# sums: another order of the same fp32 terms, as under text SP (tests/distributed/test_qwen3_5.py
# derives the bound: N ~ 150 tokens x 4 heads, sqrt(N) u ~ 1.5e-6; 1e-5 leaves the margin, a
# missing partial sum is O(1)). Every other tensor, the Gated DeltaNet's included, at 1e-10.
FP32_NORM_FAMILIES = ("qwen3_5",)
FP32_SEQUENCE_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
                       "post_attention_layernorm.weight", "language_model.norm.weight")


def _params():
    for i, case in enumerate(CASES):
        yield pytest.param(*case[1:], *(() if len(case) > 8 else (1,)),
                           marks=() if i == 0 else (pytest.mark.slow,), id=case[0])


reference = reference_fixture()


@pytest.mark.parametrize("family, placement, vision, text, cp, text_sp, zero, ep", list(_params()))
def test_context_parallel_is_exact_fp64(family, placement, vision, text, cp, text_sp, zero, ep,
                                        reference):
    cfg, steps, ref = reference(family)
    got = run_engine(family, _layout(placement, vision, text, cp, text_sp, zero, ep), cfg, steps,
                     torch.float64, grads=zero != 3)
    # MoE: the stock aux loss sums routing probabilities in fp32, so the loss (only) is looser,
    # as derived in tests/distributed/test_moe.py (~1e-9 relative; the same bound as there)
    skip = FP32_SEQUENCE_NORMS if family in FP32_NORM_FAMILIES else ()
    worst = assert_parity(got, ref, loss_tol=1e-8 if "moe" in family else 1e-10, param_tol=1e-10,
                          update_tol=1e-10, grad_tol=None if zero == 3 else 1e-10, skip=skip)
    if skip:  # the fp32-summed norm weights, at the bound derived above FP32_SEQUENCE_NORMS
        kept = [{k: {n: t for n, t in o[k].items() if n.endswith(skip)} for k in ("params", "params0")}
                for o in got["per_rank"]]
        errs = (copy_errors(kept, ref["params"])
                + copy_errors(kept, ref["params"], base="params0", ref_base=ref["params0"]))
        assert errs and max(errs)[0] < 1e-5, max(errs)
        print(f"fp32-summed norm weights: worst relative error {max(errs)[0]:.1e} ({max(errs)[2]})")
    assert worst[0] < 1e-10
    print(f"worst relative update error {worst[0]:.1e} ({worst[2]}), its parameter {worst[1]:.1e}")
    lengths = {max(int(s.num_tokens) for s in mb) for st in steps for mb in st}
    assert any(n % (2 * cp) for n in lengths)  # a length not divisible by 2 x CP was padded
    comm = got["per_rank"][-1]["comm"]  # the last rank hosts the LM in both placements
    assert any(k.endswith("/text.cp") for k in comm), comm  # the all-to-alls ran
    if family in FP32_NORM_FAMILIES:  # the linear-attention layers were head-sharded
        assert any(k.endswith("/text.cp.mixer") for k in comm), comm
    if ep > 1:  # the experts' dispatch ran over the EP group
        assert any("text.experts" in k for k in comm), comm


@pytest.mark.slow
def test_activation_checkpointing_with_cp_is_exact_fp64(reference):
    """CP2 x TP2 with every block recomputed in backward (the all-to-alls run again in the
    recomputation, in the same order on every CP rank). Tolerance as above."""
    cfg, steps, ref = reference("qwen2_5_vl", activation_checkpointing=True)
    got = run_engine("qwen2_5_vl", _layout("collocated", (4, 1), (2, 1), 2), cfg, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)


def demo_config(family: str):
    from ray_dhp import demo

    return demo.tiny_model_config(family)


def _gqa_model(kv_heads: int):
    from ray_dhp import demo

    config = demo.tiny_model_config("qwen2_5_vl")
    config.text_config.num_key_value_heads = kv_heads
    return config


@pytest.mark.slow
@pytest.mark.parametrize("tp, cp", [(1, 2), (2, 2)], ids=["kv2-cp2", "kv2-tp2-cp2-repeat"])
def test_grouped_query_attention_is_exact_fp64(tmp_path, tp, cp):
    """2 KV heads for 4 query heads: at TP1 x CP2 each CP rank gets one KV head by the all-to-all;
    at TP2 x CP2 a rank's single KV head does not split over CP and is repeated to the query
    heads first (`cp_attention`). Tolerance as above."""
    from tests.distributed.parity import CFG, make_steps, run_reference

    model = _gqa_model(2)
    steps = make_steps(tmp_path, "qwen2_5_vl", CFG)
    ref = run_reference("qwen2_5_vl", CFG, steps, torch.float64, model=model)
    got = run_engine("qwen2_5_vl", _layout("collocated", (2 * tp, 1), (tp, 1), cp), CFG, steps,
                     torch.float64, grads=True, model=model)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)


def _attention_within_slices():
    """Rank side of the negative control: CP attention without the all-to-all (each rank attends
    only within its own slice), registered in place of `cp_attention`."""
    import torch.nn.functional as F

    import ray_dhp.parallel.context as context

    def local_only(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kw):
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    context.cp_attention = local_only


@pytest.mark.slow
def test_attention_within_slices_fails_parity(reference):
    """Negative control: without the all-to-all the second slice never sees the first, and the
    harness reports it (the loss itself is off, far beyond 1e-10)."""
    cfg, steps, ref = reference("qwen2_5_vl")
    got = run_engine("qwen2_5_vl", _layout("collocated", (2, 1), (1, 1), 2), cfg, steps,
                     torch.float64, prepare=_attention_within_slices)
    assert abs(got["history"][0]["loss"] - ref["history"][0]["loss"]) > 1e-6 * ref["history"][0]["loss"]
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)


def _activation_body(rank, world, steps, disjoint=False):
    """LM saved-for-backward bytes of this rank in one step (`benchmarks.measure`), CP = world
    (``disjoint``: world - 1, the first rank the vision tower's)."""
    from benchmarks.measure import ActivationCounter
    from ray_dhp import demo
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.step.engine import DHPEngine
    from tests.distributed.parity import CFG

    topo = Topology.build(placement="disjoint" if disjoint else "collocated", vision_dp=1,
                          vision_sp=1 if disjoint else world, text_dp=1, text_tp=1,
                          text_cp=world - 1 if disjoint else world)
    engine = DHPEngine(demo.tiny_model_config("qwen2_5_vl"), build_groups(topo, torch.device("cpu")), CFG.step_config())
    counter, seen, inner = ActivationCounter(), [], engine._text_forward_backward

    def counted(samples, feats, n_targets):
        with counter.count():
            out = inner(samples, feats, n_targets)
        seen.append(counter.as_dict()["text"])
        return out

    engine._text_forward_backward = counted
    engine.step(steps[0])
    return seen


@pytest.mark.slow
def test_lm_activation_bytes_per_rank_fall_as_one_over_cp(tmp_path):
    """Measured (saved-for-backward bytes of the LM per rank, `benchmarks.measure`), the same
    micro-batches at CP 1, 2, 4: each CP rank keeps ~1/CP of CP1's, and the planner
    (`text_activation_parts`' saved part; the all-to-all buffers are the transient
    `cp_working_bytes`) is within 5% of every micro-batch's measurement. Measured (2026-12-03):
    CP1 2,068,992 B; CP2 0.519x; CP4 0.260x; planner -2.6% at CP1 (the stock path's 4-D
    attention mask, which CP does not build), +0.2% at CP2, +0.0% at CP4. Before the split the
    planner was +12.7% over at CP2/4 (it counted the transient buffers as saved)."""
    from ray_dhp import demo
    from ray_dhp.planning.memory import ActivationSettings, text_activation_parts
    from tests.distributed.parity import CFG, make_steps
    from tests.spawn import run_on_ranks

    steps = make_steps(tmp_path, "qwen2_5_vl", CFG)
    got = {cp: run_on_ranks(_activation_body, cp, args=(steps,)) for cp in (1, 2, 4)}
    base = max(got[1][0])
    tc, fp32 = demo.tiny_model_config("qwen2_5_vl").text_config, ActivationSettings(4, "flash", False)
    for cp in (1, 2, 4):
        worst = max(max(per_rank) for per_rank in got[cp])
        print(f"CP{cp}: LM saved bytes per rank {worst} = {worst / base:.3f} x CP1's {base}")
        assert worst < 1.05 * base / cp, (cp, worst / base, got)
        for mb, measured in zip(steps[0], got[cp][0]):
            length = max(int(x.num_tokens) for x in mb)
            planned, _ = text_activation_parts(tc, len(mb) * length, 1, fp32, length, cp=cp)
            print(f"  CP{cp} micro-batch {len(mb)} x {length}: measured {measured}, planned "
                  f"{planned:.0f} ({planned / measured - 1:+.1%})")
            assert abs(planned / measured - 1) < 0.05, (cp, planned, measured)


@pytest.mark.slow
def test_ring_lm_activation_bytes_match_the_planner(tmp_path):
    """Beyond the heads (CP3 on 4 heads, disjoint 1 + 3: ring attention) the planner's saved
    bytes are Ulysses' (the ring saves the swapped q, k, v, its output and log-sum-exp where SDPA
    saves the all-to-all's q, k, v, output and log-sum-exp; `ray_dhp.planning.ring_cost`):
    measured on every CP rank, each micro-batch within 5%. Measured (2026-12-04): -0.1% on all
    three ranks (732,724 / 732,784 / 732,724 B against 731,760 planned for 4 x 43 tokens)."""
    from ray_dhp import demo
    from ray_dhp.planning.memory import ActivationSettings, text_activation_parts
    from tests.distributed.parity import CFG, make_steps
    from tests.spawn import run_on_ranks

    steps = make_steps(tmp_path, "qwen2_5_vl", CFG)
    got = run_on_ranks(_activation_body, 4, args=(steps, True))
    tc, fp32 = demo.tiny_model_config("qwen2_5_vl").text_config, ActivationSettings(4, "flash", False)
    for rank in (1, 2, 3):
        for mb, measured in zip(steps[0], got[rank]):
            length = max(int(x.num_tokens) for x in mb)
            planned, _ = text_activation_parts(tc, len(mb) * length, 1, fp32, length, cp=3)
            print(f"ring CP3 rank {rank} micro-batch {len(mb)} x {length}: measured {measured}, "
                  f"planned {planned:.0f} ({planned / measured - 1:+.1%})")
            assert abs(planned / measured - 1) < 0.05, (rank, planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("placement, vision", [("collocated", (2, 1)), ("disjoint", (1, 1))],
                         ids=["collocated", "disjoint"])
def test_long_video_under_cp2_is_exact_fp64(tmp_path, placement, vision):
    """A 9 s video (144 merged rows) and a text-only sample in one micro-batch at CP2: the cut
    between the two slices falls inside the video, so each CP rank receives only its slice's
    video rows from the boundary (collocated: from the vision SP2 ranks; disjoint: from the
    vision rank) and returns their gradients. Tolerance as above."""
    from tests.distributed.parity import run_reference
    from tests.distributed.video_cases import LONG_CFG, long_video_steps

    steps = long_video_steps(tmp_path, LONG_CFG)
    video = next(s for s in steps[0][0] if s.image_grid_thw is not None)
    assert [g.tolist() for g in video.image_grid_thw] == [[9, 8, 8]]
    ref = run_reference("qwen2_5_vl", LONG_CFG, steps, torch.float64)
    got = run_engine("qwen2_5_vl", _layout(placement, vision, (1, 1), 2), LONG_CFG, steps,
                     torch.float64, grads=True)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
    print(f"long video cp2 {placement}: worst update error {worst[0]:.2e} ({worst[2]})")
    from ray_dhp.models import family_of

    ops = family_of(demo_config("qwen2_5_vl")).encoder_spec("vision").operations()
    at = ops.row_tokens(video).nonzero().flatten()
    half = -(-max(int(s.num_tokens) for s in steps[0][0]) // 2)  # the CP2 cut of the padded row
    assert at.numel() == 144 and at[0] < half <= at[-1]  # the video spans both slices


LORA = {"llm": {"lora": {"r": 4, "alpha": 8}}}  # the gated attention's q/k/v/o and every MLP


@pytest.mark.slow
def test_qwen3_5_lora_under_cp2_is_exact_fp64(reference):
    """PEFT LoRA on Qwen3.5 at CP2 (collocated SP2) against the single-process PEFT model: the
    adapters (the gated attention's and the MLPs'; the Gated DeltaNet's projections are not
    LoRA targets for this family, `target_modules` refuses them) run on the rank's slice, the
    attention's all-to-alls live in the attention function and the frozen Gated DeltaNet layers
    stay head-sharded. 1e-10 on everything (the frozen base, fp32-summed norms included, stays
    bit-identical)."""
    cfg, steps, ref = reference("qwen3_5", modules=LORA)
    got = run_engine("qwen3_5", _layout("collocated", (2, 1), (1, 1), 2), cfg, steps,
                     torch.float64, grads=True)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10,
                          grad_tol=1e-10)  # the base (its fp32-summed norms too) is frozen
    print(f"qwen3_5 LoRA cp2: worst update error {worst[0]:.1e} ({worst[2]})")
    assert any(".lora_B." in n for n in ref["grads"][0])
    comm = got["per_rank"][-1]["comm"]
    assert any(k.endswith("/text.cp.mixer") for k in comm), comm


def _packed_cfg(cfg):
    from dataclasses import replace

    return replace(cfg, packing=True, max_tokens=80)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads, packed, ckpt, tp", [(4, False, False, 1), (2, False, False, 1),
                                                        (4, True, False, 1), (2, False, True, 1),
                                                        (2, False, False, 2)],
                         ids=["cp3", "cp3-kv2", "cp3-packed", "cp3-kv2-checkpointing", "tp2-cp3-kv2"])
def test_cp_beyond_the_heads_is_exact_fp64(tmp_path, kv_heads, packed, ckpt, tp):
    """CP3 with 4 attention heads (disjoint: 1 vision + 3 text ranks): the heads do not split
    over CP, so ring attention (`ray_dhp.parallel.ring`) keeps every head on the rank's query
    slice, swaps half of it with the mirror rank for the causal balance and passes the K/V
    blocks around the ring (its backward the dK/dV accumulators); with 2 KV heads (the blocks
    carry the KV heads, broadcast over each group in the kernel), and on packed rows
    (per-sample positions on the whole row, the causal mask also within each sample; the
    padded reference), with every block recomputed in backward (the recomputation runs the
    swap and the ring again, in the same order on every CP rank), and at TP2 x CP3 (2 heads and
    1 KV head per TP rank; each CP group strided over the global ranks, 1 + 6 ranks). The sequences are padded to a
    multiple of 3 only: most slices are odd, so not divisible by 2 x CP (the halves are
    unequal). Tolerance as above."""
    from tests.distributed.parity import CFG, make_steps, run_reference

    from dataclasses import replace

    model = _gqa_model(kv_heads)
    cfg = replace(_packed_cfg(CFG) if packed else CFG, activation_checkpointing=ckpt)
    steps = make_steps(tmp_path, "qwen2_5_vl", cfg)
    ref = run_reference("qwen2_5_vl", cfg, steps, torch.float64, model=model)
    got = run_engine("qwen2_5_vl", _layout("disjoint", (1, 1), (tp, 1), 3), cfg, steps,
                     torch.float64, grads=True, model=model)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
    print(f"tp{tp} cp3 beyond the heads (kv {kv_heads}, packed {packed}): worst update {worst[0]:.1e} ({worst[2]})")
    comm = got["per_rank"][-1]["comm"]
    assert "p2p/text.cp.ring" in comm and "p2p/text.cp.swap" in comm, comm  # the ring ran
    assert not any(k.endswith("/text.cp") for k in comm), comm  # and no head all-to-all
    lengths = {max(int(s.num_tokens) for s in mb) for st in steps for mb in st}
    assert any(-(-n // 3) % 2 for n in lengths), lengths  # an odd slice: S not divisible by 2 x CP


@pytest.mark.slow
def test_planned_text_gradient_traffic_under_cp_equals_sent_bytes(tmp_path):
    """`planning.traffic.collective_bytes` at CP2 (one text replica, ZeRO-2): the text gradients
    are reduced over the 2 CP ranks and the new weights broadcast back; the plan charges
    ``(n - 1) / n`` of each buffer the engine's `CommCounter` records (n = 2: exact), as
    tests/distributed/test_zero_traffic.py does over data-parallel replicas. (Before: 0 bytes.)"""
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.cost_types import Layout, Workload
    from ray_dhp.planning.traffic import collective_bytes
    from ray_dhp.step.precision import policy_of
    from tests.distributed.parity import make_steps

    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1, seed=0, precision="fp32")
    layout = dict(_layout("collocated", (2, 1), (1, 1), 2), vision_zero=1, text_zero=2)
    got = run_engine("qwen2_5_vl", layout, cfg, make_steps(tmp_path, "qwen2_5_vl", cfg), None)
    config, policy = demo_config("qwen2_5_vl"), policy_of(cfg.precision)
    plan = collective_bytes(config, count_params(config),
                            Layout("collocated", "sequential", 2, 1, 1, 1, vision_zero=1, text_zero=2,
                                   text_cp=2),
                            Workload(1024, 64, 4, policy=policy, state_bytes=policy.state_bytes()))
    for rank, out in enumerate(got["per_rank"]):
        sent = {k: v["bytes"] for k, v in out["comm"].items()}
        assert plan["text dp gradients"] == (sent["reduce/text.grads"] + sent["broadcast/text.zero"]) / 2, \
            (rank, plan["text dp gradients"], sent)
    print(f"text gradients at CP2: planned {plan['text dp gradients']:.0f} B per rank = sent")
