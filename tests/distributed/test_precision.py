"""Precision policies on spawned gloo ranks: what each rank holds equals the plan, bf16_mixed's
fp32 masters equal the single-process reference's, resuming bf16_mixed is exact, and every
collective is one NCCL would accept (the fake-device check of `ray_dhp.parallel.devcheck`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from ray_dhp import demo
from ray_dhp.step.precision import POLICY_NAMES
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps, rel_err
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1, seed=0, weight_decay=0.1,
                      max_grad_norm=1.0)
SP2_TP2 = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
DISJOINT_1_2 = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2)
DISJOINT_2_2 = dict(placement="disjoint", vision_dp=2, vision_sp=1, text_dp=1, text_tp=2)
SKIP = ("k_proj.bias",)  # exactly-zero true gradient (softmax shift invariance): noise only


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return make_steps(tmp_path_factory.mktemp("prec"), FAMILY, CFG)


def _engine(layout, cfg):
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    return DHPEngine(demo.tiny_model_config(FAMILY), groups, cfg.step_config()), groups


def _bytes_body(rank, world, layout, steps):
    """For every policy: one step under the collective device check; the measured bytes."""
    from ray_dhp.parallel.devcheck import CollectiveDeviceCheck

    out = {}
    for name in POLICY_NAMES:
        engine, groups = _engine(layout, replace(CFG, precision=name))
        with CollectiveDeviceCheck(groups.device, host_groups=[groups.data]) as check:
            engine.step(steps[0])
        out[name] = {**engine.state_bytes(), "checked_calls": check.calls}
    return out


@pytest.mark.parametrize("layout", [SP2_TP2, pytest.param(DISJOINT_2_2, marks=pytest.mark.slow)],
                         ids=["sp2-tp2", "disjoint-2v-2t"])
def test_rank_bytes_equal_the_plan_for_every_policy(layout, steps):
    """Weights, gradients, fp32 masters and AdamW moments measured from each rank's tensors
    after one step equal `ray_dhp.planning.memory.rank_state` (what `ray-dhp plan` prints) exactly, for
    every policy; with 2 vision ranks and ZeRO-1 (the default) the ViT's masters and moments are
    split by the engine's own partition. Every collective of the step passes the device check."""
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES

    outs = run_on_ranks(_bytes_body, Topology.build(**layout).world_size, args=(layout, steps))
    topo = Topology.build(**layout)
    counts = count_params(demo.tiny_model_config(FAMILY))
    for rank, got in enumerate(outs):
        for name in POLICY_NAMES:
            want = rank_state(counts, topo, rank, POLICIES[name])
            g = got[name]
            assert (g["weights"], g["grads"], g["masters"], g["optimizer"]) == \
                (want.weights, want.grads, want.masters, want.optimizer), (rank, name, g, want)
            assert g["checked_calls"] > 0
    # the policies differ where the table says: bf16 weights are half of fp32's
    assert outs[0]["bf16_mixed"]["weights"] * 2 == outs[0]["fp32"]["weights"]


def _masters_body(rank, world, layout, steps, cfg):
    """One step; the engine's fp32 masters (full tensors), the gradients the optimizer saw, the
    bf16 weights after the step."""
    engine, _ = _engine(layout, cfg)
    seen = {}
    for masters, opt, prefix in ((engine.vision_masters, engine.vision_opt, "model.visual."),
                                 (engine.text_masters, engine.text_opt, "")):
        if opt is None:
            continue
        _capture_grads(opt, masters.named_parameters, prefix, seen)
    m0 = _full(engine)
    engine.step(steps[0])
    return {"masters0": m0, "masters": _full(engine), "grads": seen,
            "params": engine.named_full_parameters()}


def _capture_grads(opt, named_masters, prefix, seen):
    step = opt.step

    def capturing(*a, **k):
        for n, p in named_masters():  # the engine steps a chunk per call
            if p.grad is not None:
                seen[prefix + n] = _as_full(p.grad).clone()
        return step(*a, **k)

    opt.step = capturing


def _as_full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _full(engine) -> dict:
    out = {}
    for masters, prefix in ((engine.vision_masters, "model.visual."), (engine.text_masters, "")):
        if masters is not None:
            out.update({prefix + n: _as_full(p).clone() for n, p in masters.named_parameters()})
    return out


def _reference(cfg, steps):
    from ray_dhp.step.reference import ReferenceTrainer

    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), cfg.optim, precision=cfg.precision)
    seen = {}
    _capture_grads(ref.opt, ref.masters.items, "", seen)
    m0 = ref.named_masters()
    ref.step(steps[0])
    return {"masters0": m0, "masters": ref.named_masters(), "grads": seen}


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("layout", [SP2_TP2, pytest.param(DISJOINT_1_2, marks=pytest.mark.slow)],
                         ids=["sp2-tp2", "disjoint-1v-2t"])
def test_bf16_mixed_masters_equal_the_reference(layout, steps):
    """bf16_mixed at SP2/TP2 vs one process with the same policy, after one step.

    Not bit-exact: TP rounds partial sums of row-parallel layers to bf16 before reducing, SP
    and DP round per-shard gradients, so the gradients differ by bf16 rounding. Tolerances:
    (1) the fp32 gradients the optimizer steps agree per tensor to 2^-4 relative (a few bf16
    roundings, 2^-8 relative each, compounded through 2 text layers and the ViT; measured
    <= ~1e-2); (2) given both gradients, the fp32 masters must agree exactly as far as the
    AdamW step allows: at step 1 AdamW moves an entry by lr * g / (|g| + eps) (bias-corrected
    moments), so |m_dhp - m_ref| <= lr * |g_d/(|g_d|+eps) - g_r/(|g_r|+eps)| + fp32 rounding.
    Where the signs agree the masters are equal up to rounding; a flip (only for gradients
    near zero) costs at most 2 lr. (3) The bf16 weights are the masters rounded to bf16.
    """
    cfg = replace(CFG, precision="bf16_mixed")
    ref = _reference(cfg, steps)
    outs = run_on_ranks(_masters_body, Topology.build(**layout).world_size,
                        args=(layout, steps, cfg))
    got = {"masters0": {}, "masters": {}, "grads": {}, "params": {}}
    for o in outs:
        for k in got:
            got[k].update(o[k])
    assert set(got["masters"]) == set(ref["masters"])
    worst = 0.0
    eps = cfg.optim.eps
    for name, m_r in ref["masters"].items():
        assert torch.equal(got["masters0"][name], ref["masters0"][name]), name  # same init
        g_d, g_r = got["grads"][name], ref["grads"][name]
        if not name.endswith(SKIP):
            err = rel_err(g_d, g_r)
            worst = max(worst, err)
            assert err <= 2 ** -4, (name, err)
        u_d, u_r = g_d / (g_d.abs() + eps), g_r / (g_r.abs() + eps)
        bound = cfg.optim.lr * (u_d - u_r).abs() + 4 * 2 ** -24 * m_r.abs() + 1e-9
        diff = (got["masters"][name] - m_r).abs()
        assert bool((diff <= bound).all()), (name, float((diff - bound).max()))
        assert torch.equal(got["params"][name], got["masters"][name].to(torch.bfloat16)), name
    assert worst > 0  # the comparison is not vacuous (bf16 gradients do differ by layout)


def _old_squared_norm(params, tp_group=None, device=None):
    """The norm as it was before the NCCL fix: CPU fp64 scalars all-reduced over the TP group."""
    import torch.distributed as dist

    from ray_dhp.parallel.tensor import is_sharded, local

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = local(p.grad).detach().double()
        if is_sharded(p.grad):
            sharded += g.pow(2).sum()
        else:
            replicated += g.pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return sharded + replicated


def _check_body(rank, world, steps):
    """The device check on a real gloo group: a host scalar over a training group is caught,
    the same value created on the group's device passes, the host (data) group may carry it;
    an engine step with the pre-fix gradient norm (CPU scalars over the TP group) is caught."""
    import torch.distributed as dist

    from ray_dhp.parallel import data_parallel as dp
    from ray_dhp.parallel.devcheck import CollectiveDeviceCheck

    engine, groups = _engine(SP2_TP2, CFG)
    dp.squared_norm = _old_squared_norm
    old = None
    try:
        with CollectiveDeviceCheck(groups.device, host_groups=[groups.data]):
            engine.step(steps[0])
    except AssertionError as e:
        old = str(e)

    data = groups.data
    dev = torch.device("cpu")
    caught = None
    with CollectiveDeviceCheck(dev, host_groups=[data]) as check:
        dist.all_reduce(torch.zeros((), dtype=torch.float64, device=dev))
        dist.all_reduce(torch.ones(3), group=data)
        try:
            dist.all_reduce(torch.stack([torch.zeros(()), torch.ones(())]))
        except AssertionError as e:
            caught = str(e)
    return caught, check.calls, old


def test_device_check_catches_a_host_tensor(steps):
    caught, calls, old = run_on_ranks(_check_body, 2, args=(steps,))[0]
    assert caught is not None and "host tensor" in caught and "NCCL" in caught
    assert calls == 1  # the device tensor; the data group's host tensor is allowed, not counted
    assert old is not None and "dist.all_reduce sends a host tensor (shape (), torch.float64)" in old


def _resume_body(rank, world, layout, cfg, data, ckpt, mode):
    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler

    engine, _ = _engine(layout, cfg)
    sampler = StepSampler(read_annotations(data), demo.tiny_processor(FAMILY),
                          resolve_data_root(data), cfg.sampler_config())
    if mode == "resume":
        checkpoint.load(ckpt, engine, sampler)
    losses = []
    for _ in range(engine.step_count, 2 if mode == "save" else cfg.optim.num_steps):
        losses.append(engine.step(sampler.next_step())["loss"])
    if mode == "save":
        checkpoint.save(ckpt, engine, sampler)
    return {"losses": losses, "masters": _full(engine), "params": engine.named_full_parameters()}


def test_bf16_mixed_resume_is_exact(tmp_path):
    """2 steps + save + load + 2 steps == 4 steps, bit for bit: the checkpoint holds the fp32
    masters and AdamW moments (not the bf16 weights), and the masters are stored in fp32."""
    import torch.distributed.checkpoint as dcp

    cfg = replace(CFG, precision="bf16_mixed", num_steps=4, lr_schedule="cosine", warmup_steps=1)
    data = str(demo.make_dataset(tmp_path / "data", num_samples=16, seed=0, text_only_every=4,
                                 image_sizes=((56, 56), (84, 56))))
    ckpt = str(tmp_path / "ckpt")
    world = Topology.build(**SP2_TP2).world_size  # 2 vision ranks: ZeRO-1 splits the masters
    full = run_on_ranks(_resume_body, world, args=(SP2_TP2, cfg, data, ckpt, "full"))
    run_on_ranks(_resume_body, world, args=(SP2_TP2, cfg, data, ckpt, "save"))
    resumed = run_on_ranks(_resume_body, world, args=(SP2_TP2, cfg, data, ckpt, "resume"))
    md = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    dtypes = {v.properties.dtype for k, v in md.items() if k.startswith("model.")}
    assert dtypes == {torch.float32}
    assert resumed[-1]["losses"] == full[-1]["losses"][2:]
    for a, b in zip(full, resumed):
        for kind in ("masters", "params"):
            for n, t in a[kind].items():
                assert torch.equal(t, b[kind][n]), (kind, n)
    assert os.path.isfile(os.path.join(ckpt, "COMMIT"))
    _check_export(ckpt, tmp_path, resumed)


def _check_export(ckpt, tmp_path, saved_run):
    """``export --dtype bfloat16`` of the bf16_mixed checkpoint (step 2) writes bf16 weights equal
    to the masters rounded to bf16, says so in config.json, and copies generation_config.json and
    the chat template from the source model directory."""
    import json

    from safetensors import safe_open

    from ray_dhp.checkpointing.export import export_hf

    source = tmp_path / "source"
    source.mkdir()
    (source / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    (source / "chat_template.jinja").write_text("{{ messages }}")
    out = export_hf(ckpt, tmp_path / "hf", dtype="bfloat16", source=str(source))
    assert json.loads(open(os.path.join(out, "generation_config.json")).read())["temperature"] == 0.25
    assert open(os.path.join(out, "chat_template.jinja")).read() == "{{ messages }}"
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
        saved = "model.layers.0.mlp.down_proj.weight"  # transformers' on-disk (legacy) name
        masters_at_2 = _masters_at_step_2(ckpt, "model.language_model.layers.0.mlp.down_proj.weight")
        assert torch.equal(f.get_tensor(saved), masters_at_2.to(torch.bfloat16))


def _masters_at_step_2(ckpt, name):
    from ray_dhp.checkpointing.export import read_model_tensors

    t = read_model_tensors(ckpt)[name]
    assert t.dtype == torch.float32
    return t
