"""ZeRO stages per module (`ray_dhp.parallel.zero`, `ray_dhp.parallel.fsdp`) are exact: fp64
parity with the single-process reference (loss and grad-norm of every step, every clipped
gradient on the rank that holds it, every rank's copy of every parameter and update) at text
TP2xDP2 and vision SP2xDP2, collocated and disjoint with unequal groups.

Tolerance 1e-10 relative, as the layout matrix (tests/distributed/test_parity.py): in fp64 the
only differences are summation orders (the reduce-to-owner and the FSDP reduce-scatter sum the
replicas in another order than an all-reduce), ~1e-14 measured; a wrong partition (a parameter
stepped twice or never, a gradient counted twice in the norm, a stale replica) is O(1).
"""

import pytest
import torch

from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference
from tests.distributed.zero_cases import CFG, COLLOCATED, FAMILY, TOL


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return make_steps(tmp_path_factory.mktemp("zero"), FAMILY, CFG)


@pytest.fixture(scope="module")
def reference(steps):
    return steps, run_reference(FAMILY, CFG, steps, torch.float64)


def _check(layout, stage, reference):
    steps, ref = reference
    got = run_engine(FAMILY, dict(layout, vision_zero=stage, text_zero=stage), CFG, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, **TOL)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_collocated_tp2dp2_sp2dp2(stage, reference):
    got = _check(COLLOCATED, stage, reference)
    ops = {k.split("/")[0] for o in got["per_rank"] for k in o["comm"]}
    assert ("reduce" in ops) == (stage == 2) and "broadcast" in ops


@pytest.mark.slow
def test_text_fsdp2_tp2dp2_with_vision_stage2(reference):
    """Text stage 3 (FSDP2 on the dp dim of the 2-D text mesh, TP on tp)
    and the vision tower at stage 2 over SP2xDP2 (reduce to the owner, broadcast back); 2
    micro-batches: one reduce-scatter per step. (Stage 1 is the default of every layout of the
    parity matrix with more than one replica, tests/distributed/test_parity.py.)"""
    steps, ref = reference
    got = run_engine(FAMILY, dict(COLLOCATED, vision_zero=2, text_zero=3), CFG, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, **TOL)
    ops = {k for o in got["per_rank"] for k in o["comm"]}
    assert "reduce/vision.grads" in ops and "broadcast/vision.zero" in ops
    assert not any(k.endswith("text.grads") for k in ops)  # FSDP reduced the text gradients


def idle_vision_replicas(steps, layout) -> int:
    """Micro-batches x vision replicas with no image in a micro-batch that has images: where
    vision stage 3 must run the tower's collectives without work (`ray_dhp.models.fsdp_vision`)."""
    from ray_dhp import demo
    from ray_dhp.step.microbatch import balancer_for
    from ray_dhp.step.microbatch import _MicroBatch, layout_micro_batch
    from ray_dhp.parallel.topology import Topology

    config, topo = demo.tiny_model_config(FAMILY), Topology.build(**layout)
    balancer = balancer_for(CFG.optim.balance, config, packing=CFG.data.packing)
    return sum(plan is None for mbs in steps for mb in mbs if _MicroBatch(mb).has_images
               for plan in layout_micro_batch(mb, topo, FAMILY, config.vision_config,
                                              balancer).vision_plans)


def regroup(steps, pattern: str) -> list:
    """The steps' samples (in order) dealt out again as micro-batches following ``pattern``:
    one string per step, micro-batches separated by spaces, ``i`` a sample with an image and
    ``t`` a text-only one (e.g. ``"it ii ii tt"``: the last micro-batch has no image)."""
    pool = {"i": [], "t": []}
    for mbs in steps:
        for mb in mbs:
            for x in mb:
                pool["t" if x.image_grid_thw is None else "i"].append(x)
    return [[[pool[c].pop(0) for c in mb] for mb in step.split()] for step in pattern.split("|")]


def test_vision_fsdp2_sp2dp2_with_idle_replicas(tmp_path):
    """Vision stage 3 (FSDP2 over the whole SP2xDP2 vision group, Ulysses inside each replica)
    with text stage 3, 4 micro-batches of 2 samples: where a micro-batch has one image, one
    vision replica has none and runs the tower's collectives on an idle input (the NCCL twin, on
    in every spawn, checks every rank's collective order; without the idle run the ranks hang);
    step 0's last micro-batch has no image, so its third one reduce-scatters (once per step)."""
    from dataclasses import replace

    cfg = replace(CFG, micro_batches=4)
    steps = regroup(make_steps(tmp_path, FAMILY, cfg), "it ii ii tt|ii it ii ii")
    assert idle_vision_replicas(steps, COLLOCATED) == 2
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, dict(COLLOCATED, vision_zero=3, text_zero=3), cfg, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, **TOL)
    ops = {k for o in got["per_rank"] for k in o["comm"]}
    assert not any(k.endswith(".grads") or k.endswith(".zero") for k in ops), ops  # FSDP's own


@pytest.mark.slow
def test_vision_fsdp2_qwen3_vl(tmp_path):
    """Vision stage 3 for Qwen3-VL's tower: its learned position embedding and deepstack mergers
    are FSDP units too (the deepstack features leave the tower mid-way); idle replicas as in
    the default case, text stage 1."""
    from dataclasses import replace

    cfg = replace(CFG, micro_batches=4)
    steps = regroup(make_steps(tmp_path, "qwen3_vl", cfg), "it ii ii tt|ii it ii ii")
    ref = run_reference("qwen3_vl", cfg, steps, torch.float64)
    got = run_engine("qwen3_vl", dict(COLLOCATED, vision_zero=3, text_zero=1), cfg, steps,
                     torch.float64, grads=True)
    assert_parity(got, ref, **TOL)


D_1V_2T = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=2, text_tp=1)
D_3V_1T = dict(placement="disjoint", vision_dp=3, vision_sp=1, text_dp=1, text_tp=1)
COMBOS = {  # name: (layout, (vision stage, text stage), config changes)
    "disjoint-1v-2t-s1": (D_1V_2T, (0, 1), {}),
    "disjoint-1v-2t-s2": (D_1V_2T, (0, 2), {}),
    "disjoint-1v-2t-s3": (D_1V_2T, (0, 3), {}),
    "disjoint-3v-1t-s1": (D_3V_1T, (1, 0), {}),
    "disjoint-3v-1t-s2": (D_3V_1T, (2, 0), {}),
    "s3-text-sp": (dict(COLLOCATED, text_sequence_parallel=True), (1, 3), {}),
    "s3-lora": (COLLOCATED, (1, 3), {"modules": {"llm": {"lora": {"r": 4, "alpha": 8}}}}),
    "s3-frozen-vision": (COLLOCATED, (0, 3), {"modules": {"vision": {"train": False}}}),
    "s3-one-micro-batch": (COLLOCATED, (2, 3), {"micro_batches": 1}),
    # vision stage 3 (FSDP2 over the vision group): 3 replicas (uneven shards, idle replicas),
    # the pipelined schedule, a frozen tower (weights sharded, no gradient), checkpointing
    "disjoint-3v-1t-v3": (D_3V_1T, (3, 0), {}),
    "disjoint-3v-1t-v3-pipelined": (D_3V_1T, (3, 0), {"schedule": "pipelined"}),
    "v3-frozen-vision": (COLLOCATED, (3, 1), {"modules": {"vision": {"train": False}}}),
    "v3-checkpointing-one-micro-batch": (COLLOCATED, (3, 2), {"activation_checkpointing": True,
                                                              "micro_batches": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMBOS))
def test_stage_combinations(name, tmp_path):
    from dataclasses import replace

    layout, (vz, tz), changes = COMBOS[name]
    changes = dict(changes)
    schedule = changes.pop("schedule", "sequential")
    cfg = replace(CFG, **changes)
    steps = make_steps(tmp_path, FAMILY, cfg)
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, dict(layout, vision_zero=vz, text_zero=tz), cfg, steps,
                     torch.float64, schedule, grads=True)
    assert_parity(got, ref, **TOL)


STAGES = [(0, 0), (1, 1), (2, 2), (3, 3)]  # (vision, text)


def _bytes_body(rank, world, layout, steps, precision):
    from dataclasses import replace

    from ray_dhp import demo
    from ray_dhp.parallel.devcheck import CollectiveDeviceCheck
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    out = {}
    for vz, tz in STAGES:
        groups = build_groups(Topology.build(**layout, vision_zero=vz, text_zero=tz), torch.device("cpu"))
        engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, replace(CFG, precision=precision).step_config())
        with CollectiveDeviceCheck(groups.device, host_groups=[groups.data]) as check:
            engine.step(steps[0])
        out[(vz, tz)] = {**engine.state_bytes(), "checked_calls": check.calls}
    return out


def test_rank_bytes_equal_the_plan_for_every_stage(steps):
    """Weights, gradients, fp32 masters and AdamW moments measured on every rank after one
    bf16_mixed step equal `rank_state` (what `ray-dhp plan` prints) for stages 0-3 at
    TP2xDP2 / SP2xDP2, and every collective passes the device check (NCCL-valid)."""
    from ray_dhp import demo
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.parallel.topology import Topology
    from tests.spawn import run_on_ranks

    outs = run_on_ranks(_bytes_body, 4, args=(COLLOCATED, steps, "bf16_mixed"))
    counts = count_params(demo.tiny_model_config(FAMILY))
    for vz, tz in STAGES:
        topo = Topology.build(**COLLOCATED, vision_zero=vz, text_zero=tz)
        for rank, got in enumerate(outs):
            want = rank_state(counts, topo, rank, POLICIES["bf16_mixed"], CFG.optim.micro_batches)
            g = got[(vz, tz)]
            assert (g["weights"], g["grads"], g["masters"], g["optimizer"]) == \
                (want.weights, want.grads, want.masters, want.optimizer), (vz, tz, rank, g, want)
            assert g["checked_calls"] > 0
    s0, s1, s3 = (outs[0][s]["total"] for s in ((0, 0), (1, 1), (3, 3)))
    assert s3 < s1 < s0  # each stage holds less


# -- checkpoints across stages (DCP by parameter name reshards FSDP2 / TP / ZeRO partitions) ----

TP2_DP2_S3 = dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2,
                  vision_zero=2, text_zero=3)
TP2_S0 = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
V3_T3 = dict(TP2_DP2_S3, vision_zero=3)  # both modules FSDP2-sharded


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(TP2_DP2_S3, TP2_S0), (TP2_S0, TP2_DP2_S3),
                                           (V3_T3, TP2_S0)],
                         ids=["stage3-tp2dp2-to-stage0-tp2", "stage0-tp2-to-stage3-tp2dp2",
                              "vision-stage3-sp2dp2-to-stage0-sp2"])
def test_resume_across_stages_is_exact(before, after, tmp_path, tmp_path_factory):
    """3 steps at one stage + save + load at another + 3 steps == 6 uninterrupted reference
    steps (losses, every rank's copy of every parameter; tests/distributed/test_checkpoint.py's
    invariant and tolerance); AdamW moments, schedule and data position all travel."""
    from tests.distributed.checkpoint_cases import assert_resume_is_exact

    assert_resume_is_exact(before, after, tmp_path, tmp_path_factory)


@pytest.mark.slow
def test_export_of_a_stage3_checkpoint_is_the_trained_model(tmp_path, tmp_path_factory):
    """`export_hf` of a checkpoint saved at text stage 3 (FSDP2 x TP shards in DCP, read one
    tensor at a time) gives exactly the parameters the ranks held."""
    import os

    import transformers

    from ray_dhp import demo, export_hf
    from tests.distributed import checkpoint_cases as ck

    data = str(demo.make_dataset(tmp_path_factory.mktemp("data"), num_samples=16, seed=0,
                                 text_only_every=4, image_sizes=((56, 56), (84, 56), (112, 84))))
    got = ck.run(TP2_DP2_S3, data, stop=2, save_at=(2,), ckpt_root=str(tmp_path / "ck"))
    out = export_hf(os.path.join(tmp_path, "ck", "checkpoint_000002"), tmp_path / "hf")
    exported = dict(transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).named_parameters())
    assert set(exported) == set(got["params"])
    for name, p in got["params"].items():
        assert torch.equal(exported[name], p), name
