"""Shared parity harness: DHP engine on spawned gloo ranks vs the single-process reference.

Both sides get the same micro-batches (made once here), seed and hyper-parameters. The engine
side returns, per rank, the loss and grad-norm of every step plus the full parameters it hosts
(and, with ``grads=True``, the clipped gradients the optimizer sees at every step); the
reference gives the same for the unsharded model.

Every rank's copy is checked: a parameter held by several ranks (the vision tower on every
SP/DP rank, replicated text norms and biases on every TP rank, every DP replica) is compared
with the reference once per rank that holds it, so a replica that drifts is caught even when
the other copies are right.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.step.reference import ReferenceTrainer
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.spawn import run_on_ranks

# The parity configuration of the fp64 family matrices: 3 steps of 2 micro-batches, clipping active
# (max_grad_norm 0.5 is below the tiny models' grad-norms), weight decay, warm-up then cosine.
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1)


#: The generic families (`ray_dhp.models.generic`, nothing written for them) in the fp64 parity
#: matrix (`tests/distributed/test_generic.py`) and the trainer test
#: (`tests/ray/test_generic_trainer.py`); docs/supported_models.md lists them as verified.
GENERIC_FAMILIES = ("gemma3", "llava", "paligemma", "aya_vision", "cohere2_vision", "mistral3",
                    "idefics3", "smolvlm", "glm4v", "glm46v", "lighton_ocr", "glmga",
                    "hyperclovax_vision_v2", "got_ocr2", "pp_chart2table", "shieldgemma2",
                    "lfm3_vl", "glm_ocr", "video_llava", "glm4v_moe", "lfm2_vl",
                    "kimi_k25", "cosmos3_edge", "paddleocr_vl", "llava_onevision1_5", "ernie4_5_vl_moe", "llama4",
                    "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "gemma4", "llava_onevision",
                    "llava_next", "llava_next_video", "mistral_large4", "minimax_m3_vl", "qwen4_exp",
                    "exaone4_5")
#: the generic families with a mixture-of-experts LM among them, verified with expert parallelism
#: too (`tests/distributed/test_generic_moe.py`)
GENERIC_MOE_FAMILIES = ("glm4v_moe", "ernie4_5_vl_moe")


def make_steps(tmp_path, family: str, cfg: TrainLoopConfig, *, num_samples=16, text_only_every=4,
               image_sizes=((56, 56), (84, 56), (112, 84)), processor=None):
    """The first ``cfg.optim.num_steps`` steps over the demo set (``processor``: default the family's
    demo processor)."""
    path = demo.make_dataset(tmp_path / f"data_{family}", num_samples=num_samples, seed=cfg.optim.seed,
                             text_only_every=text_only_every, image_sizes=image_sizes)
    return sampler_steps(path, demo.tiny_processor(family) if processor is None else processor, cfg)


def sampler_steps(path, processor, cfg: TrainLoopConfig, *, allow_audio: bool = False) -> list:
    """The first ``cfg.optim.num_steps`` steps a `StepSampler` makes of the data file ``path``
    with ``processor`` (what the loop's loader hands the engine); ``allow_audio``: records with
    audio train (a layout with an audio group, as the loader sets it)."""
    sampler = StepSampler(read_annotations(path), processor, resolve_data_root(path), cfg.sampler_config())
    sampler.allow_audio = allow_audio
    return [sampler.next_step() for _ in range(cfg.optim.num_steps)]


def named_full_grads(engine) -> dict:
    """The gradients this rank holds for its parameters, unsharded (collective on a DTensor module);
    frozen parameters (`ray_dhp.config.tuning`) have none and are left out, and so are, after the
    reduction at ZeRO stage 2, those another replica owns (`ray_dhp.parallel.zero`)."""
    out = {}
    for name, module in engine.shards.items():  # every encoder this rank hosts
        prefix = engine.family.encoder_prefix(name)
        out.update({f"{prefix}{n}": _full(p.grad) for n, p in module.named_parameters()
                    if p.requires_grad and p.grad is not None})
    if engine.text_model is not None:
        for n, p in engine.text_model.named_parameters():
            if not p.requires_grad or p.grad is None:
                continue
            out[n] = _full(p.grad)
    return out


def _full(g: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``g``, unsharded (a DTensor's ``full_tensor``: collective)."""
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def capture_grads(engine) -> list:
    """Record, at every step, the reduced and clipped gradients (what the optimizer is given):
    the engine reduces in ``_reduce_and_clip`` and scales by the clipping coefficient at the start
    of ``_optimizer_step(coef)``; the same product is taken here (an exact fp multiply)."""
    seen, optimizer_step = [], engine._optimizer_step

    def wrapped(coef):
        seen.append({n: g * coef for n, g in named_full_grads(engine).items()})
        return optimizer_step(coef)

    engine._optimizer_step = wrapped
    return seen


def perturb_local(engine, name: str, eps: float) -> None:
    """Test-only drift: add ``eps`` to the first entry of THIS rank's copy of ``name`` (its local
    shard for a TP-sharded weight), in place, without telling any other rank."""
    params = {f"model.visual.{n}": p for n, p in engine.visual.named_parameters()} if engine.visual else {}
    if engine.text_model is not None:
        params.update(engine.text_model.named_parameters())
    if name in params:
        p = params[name]
        with torch.no_grad():
            (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] += eps


def _engine_body(rank, world, family, layout, cfg, steps, dtype, schedule, grads, drift, model=None,
                 prepare=None):
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.comm import CommCounter

    if prepare is not None:
        prepare()
    topo = Topology.build(**layout)
    groups = build_groups(topo, torch.device("cpu"))
    comm = CommCounter()
    model = demo.tiny_model_config(family) if model is None else model
    engine = DHPEngine(model, groups, cfg.step_config(), comm=comm, dtype=dtype, schedule=schedule)
    params0 = engine.named_full_parameters()
    seen = capture_grads(engine) if grads else None
    history = [engine.step(mbs) for mbs in steps]
    for r, name, eps in drift:
        if r == rank:
            perturb_local(engine, name, eps)
    return {"history": history, "params0": params0, "params": engine.named_full_parameters(),
            "grads": seen, "comm": comm.as_dict(), "state": engine.state_bytes()}


def merge_ranks(outs: list) -> dict:
    """One dict per quantity from the per-rank results, plus ``per_rank`` (every copy, by rank).
    ``params``/``params0`` hold one copy of each tensor (the last rank's): use them only where a
    single copy is enough (e.g. as a reference); `assert_parity` checks every copy."""
    params, params0 = {}, {}
    for o in outs:
        params.update(o["params"])
        params0.update(o["params0"])
    return {"history": outs[0]["history"], "params": params, "params0": params0, "per_rank": outs}


def dense_layout(placement: str, vision: tuple, text: tuple, text_sp: bool = False) -> dict:
    """A layout dict for `run_engine`: ``vision=(sp, dp)``, ``text=(tp, dp)``, text sequence
    parallelism ``text_sp``."""
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp,
                text_sequence_parallel=text_sp)


def moe_layout(placement: str, vision: tuple, text: tuple, ep: int = 1) -> dict:
    """A layout dict for `run_engine`: ``vision=(sp, dp)``, ``text=(tp, dp)``, expert parallelism ``ep``."""
    (sp, vdp), (tp, tdp) = vision, text
    out = dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp)
    if ep > 1:
        out["text_ep"] = ep
    return out


def run_engine(family: str, layout: dict, cfg: TrainLoopConfig, steps, dtype=None,
               schedule: str = "sequential", *, grads: bool = False, drift=(), model=None,
               prepare=None) -> dict:
    """Run the DHP engine on spawned ranks; ``grads``: also record the clipped gradients of every
    step; ``drift``: ``(rank, name, eps)`` perturbations applied after training (harness tests);
    ``model``: a model directory or config (default: the family's tiny config); ``prepare``: a
    module-level function every rank calls before building its engine (a negative control's
    injected bug)."""
    world = Topology.build(**layout).world_size
    outs = run_on_ranks(_engine_body, world, args=(family, layout, cfg, steps, dtype, schedule,
                                                   grads, tuple(drift), model, prepare))
    return merge_ranks(outs)


def run_reference(family: str, cfg: TrainLoopConfig, steps, dtype=None, model=None) -> dict:
    ref = ReferenceTrainer(demo.tiny_model_config(family) if model is None else model, cfg.optim, precision=cfg.precision, dtype=dtype)
    params0 = ref.named_parameters()
    grads = []
    ref.opt.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
        {n: p.grad.detach().clone() for n, p in ref.model.named_parameters() if p.grad is not None}))
    history = [ref.step(mbs) for mbs in steps]
    return {"history": history, "params": ref.named_parameters(), "params0": params0, "grads": grads}


def _directory_body(rank, world, family, layout, cfg, data, model_dir, ckpt):
    from ray_dhp.checkpointing.staging import BackgroundWriter
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(model_dir, groups, cfg.step_config(), dtype=torch.float64)
    processor = demo.tiny_processor(family)
    sampler = StepSampler(read_annotations(data), processor, resolve_data_root(data), cfg.sampler_config())
    params0 = engine.named_full_parameters()
    history = [engine.step(sampler.next_step()) for _ in range(cfg.optim.num_steps)]
    writer = BackgroundWriter(groups.device)
    writer.start(ckpt, engine, sampler, processor=processor)
    writer.wait()
    return {"history": history, "params0": params0, "params": engine.named_full_parameters()}


def run_from_directory(tmp_path, family: str, layout: dict, cfg: TrainLoopConfig) -> tuple:
    """The family's tiny model saved by ``save_pretrained``, really sharded (100 KB files): the
    stock ``from_pretrained`` model's trajectory and the engine's (reading only its slices, fp64,
    on spawned ranks) over the same samples, then a checkpoint of the engine. Returns ``(got,
    ref, ckpt)``."""
    import os

    from ray_dhp.models import build_model

    model_dir = str(tmp_path / "tiny")
    build_model(demo.tiny_model_config(family), seed=5).save_pretrained(model_dir, max_shard_size="100KB")
    assert len([f for f in os.listdir(model_dir) if f.endswith(".safetensors")]) > 2
    steps = make_steps(tmp_path, family, cfg)  # the same samples as the engine's sampler's
    ref = run_reference(family, cfg, steps, torch.float64, model=model_dir)
    data = str(demo.make_dataset(tmp_path / "data", num_samples=16, seed=cfg.optim.seed, text_only_every=4,
                                 image_sizes=((56, 56), (84, 56), (112, 84))))
    ckpt = str(tmp_path / "ckpt" / "checkpoint_000001")
    world = Topology.build(**layout).world_size
    got = merge_ranks(run_on_ranks(_directory_body, world,
                                   args=(family, layout, cfg, data, model_dir, ckpt)))
    return got, ref, ckpt


def assert_export_round_trip(ckpt: str, out_dir: str, model_cls, params: dict) -> None:
    """``export_hf`` of ``ckpt`` loads through ``model_cls.from_pretrained`` with exactly
    ``params`` (names and values, bit for bit)."""
    from ray_dhp import export_hf

    out = export_hf(ckpt, out_dir)
    exported = dict(model_cls.from_pretrained(out, dtype=torch.float64).named_parameters())
    assert set(exported) == set(params)
    for name, p in params.items():
        assert torch.equal(exported[name], p), name


class Reference(NamedTuple):
    cfg: TrainLoopConfig
    steps: list
    ref: dict


#: every reference built in this test process, by `reference_key`: the matrix
#: (`test_families.py`) and a family's own file (`test_parity.py`'s Qwen2.5-VL cases, ...) ask for
#: the same fp64 run, which is deterministic; built once, it is shared (a tiny model's run, ~10 MB)
_REFERENCES: dict = {}


def reference_key(family: str, cfg: TrainLoopConfig, dtype, make, prepare=None) -> tuple:
    return (family, repr(cfg), str(dtype), make) + ((prepare,) if prepare is not None else ())


def shared_reference(tmp_path_factory, family: str, cfg: TrainLoopConfig = CFG, *,
                     dtype=torch.float64, make=make_steps, prepare=None) -> Reference:
    """``Reference(cfg, steps, ref)``: the steps ``make(tmp, family, cfg)`` and the stock
    single-process model's trajectory on them (`run_reference` in ``dtype``), built once per test
    process for each ``(family, cfg, dtype, make)`` (``tmp_path_factory``: pytest's, session-wide);
    ``prepare``: run before the reference, returns its undo (`fp64_delta_rule`)."""
    key = reference_key(family, cfg, dtype, make, prepare)
    if key not in _REFERENCES:
        steps = make(tmp_path_factory.mktemp(family), family, cfg)
        undo = prepare() if prepare is not None else None
        try:
            _REFERENCES[key] = Reference(cfg, steps, run_reference(family, cfg, steps, dtype))
        finally:
            if undo is not None:
                undo()
    return _REFERENCES[key]


def reference_fixture(family: str | None = None, cfg: TrainLoopConfig = CFG, *,
                      dtype=torch.float64, make=make_steps, name: str = "reference", prepare=None):
    """A module-scoped pytest fixture named ``name`` whose value is
    ``get(family=family, **changes) -> Reference(cfg, steps, ref)``: ``cfg`` with ``changes``
    (`dataclasses.replace`), the steps ``make(tmp_path, family, cfg)`` made of it and the stock
    single-process model's trajectory on them (`run_reference` in ``dtype``), built once per
    ``(family, cfg, dtype, make)`` in the test process (`shared_reference`). Assign it in a test
    module: ``reference = reference_fixture("qwen3_5")``."""

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        def get(fam: str | None = family, **changes) -> Reference:
            return shared_reference(tmp_path_factory, fam, dataclasses.replace(cfg, **changes),
                                    dtype=dtype, make=make, prepare=prepare)

        return get

    return fixture


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    den = b.double().norm()
    num = (a.double() - b.double()).norm()
    return float(num / den) if den > 0 else float(num)


def copy_errors(per_rank: list, ref: dict, *, key: str = "params", base=None, ref_base=None,
                skip=()) -> list:
    """``(error, rank, name)`` for every rank's copy of every tensor in ``per_rank[r][key]``
    against ``ref[name]``; with ``base``/``ref_base`` (the matching initial tensors) the error
    of the update ``x - x0`` instead."""
    errs = []
    for rank, out in enumerate(per_rank):
        for name, g in out[key].items():
            if name.endswith(tuple(skip)):
                continue
            r = ref[name]
            assert g.shape == r.shape, (rank, name, g.shape, r.shape)
            if base is None:
                errs.append((rel_err(g, r), rank, name))
            else:
                errs.append((rel_err(g - per_rank[rank][base][name], r - ref_base[name]), rank, name))
    return errs


def parity_failures(got: dict, ref: dict, *, loss_tol: float, param_tol=None, update_tol=None,
                    grad_tol=None, grad_steps=None, skip=()) -> list:
    """Everything out of tolerance, as ``(what, error, rank, name)``: the loss and grad-norm of
    every step (rank ``None``), then every rank's copy of every parameter and of its update and,
    with ``grad_tol``, of the clipped gradient of the first ``grad_steps`` steps (all if None).
    A tolerance of None skips that check; ``skip``: name suffixes left out of the parameter,
    update and gradient checks."""
    per_rank = got["per_rank"]
    hosted = set().union(*(o["params"] for o in per_rank))
    assert hosted == set(ref["params"]), hosted ^ set(ref["params"])
    bad = []
    for k, (g, r) in enumerate(zip(got["history"], ref["history"], strict=True)):
        for key in ("loss", "grad_norm"):
            err = abs(g[key] - r[key]) / abs(r[key])
            if err > loss_tol:
                bad.append((f"{key} step {k + 1}", err, None, None))
    if param_tol is not None:
        bad += [("param", *e) for e in copy_errors(per_rank, ref["params"], skip=skip) if e[0] > param_tol]
    if update_tol is not None:
        bad += [("update", *e) for e in copy_errors(per_rank, ref["params"], base="params0",
                                                    ref_base=ref["params0"], skip=skip)
                if e[0] > update_tol]
    if grad_tol is not None:
        for k, ref_grads in enumerate(ref["grads"][:grad_steps]):
            step = [{"grads": o["grads"][k]} for o in per_rank]
            bad += [(f"grad step {k + 1}", *e)
                    for e in copy_errors(step, ref_grads, key="grads", skip=skip) if e[0] > grad_tol]
    return bad


def assert_parity(got: dict, ref: dict, **tols) -> tuple:
    """`parity_failures` must be empty; returns the worst (update error, parameter error, name)
    over every rank's copy (``None`` when updates are not checked)."""
    bad = parity_failures(got, ref, **tols)
    assert not bad, "out of tolerance (what, error, rank, name):\n" + "\n".join(map(str, bad))
    if tols.get("update_tol") is None:
        return None
    skip = tols.get("skip", ())
    e_params = {(r, n): e for e, r, n in copy_errors(got["per_rank"], ref["params"], skip=skip)}
    e_updates = copy_errors(got["per_rank"], ref["params"], base="params0", ref_base=ref["params0"],
                            skip=skip)
    return max((e, e_params[(r, n)], n) for e, r, n in e_updates)


# fp32 tolerance of the fp32 cases (test_parity.py, test_text_sp.py), derived.
# fp32 rounds to u = 2^-24 ~ 6e-8. A sharded run computes the same sums
# in another order (matmuls over row/column shards, BLAS blocking that depends on the shapes, the
# CPU's kernels and the thread count, all-reduces over <= 2 ranks). Two orders of an N-term sum
# differ by ~sqrt(N) u of the terms' magnitude (random-walk rounding; N u is the worst case). The
# longest sums here are the weight gradients and the logits: N ~ tokens per step x width ~
# 150 x 128 ~ 2e4, sqrt(N) u ~ 9e-6; the norms over a tensor (and the loss, a mean) average the
# entries' independent errors, so 1e-5 bounds the loss, the grad-norm and every step-1 gradient
# tensor. Measured: <= 4e-7 (loss, grad-norm) and <= 6e-7 (step-1 gradients, worst the key
# biases), the same at 1 and 2 threads; the single-process reference run with AVX2 instead of
# AVX512 kernels (ATEN_CPU_CAPABILITY=avx2) moves them by <= 1e-7 and 7e-7. A real bug is O(1).
#   NOT compared in fp32: parameters after an AdamW step. Adam normalises each entry by its own
# magnitude; about half the entries of the key biases have a gradient below 1% of the tensor's
# largest, down to ~1e-10 in absolute value (they nearly cancel across positions: rotary makes
# q.R(j)b_k depend on the key position j, but only weakly in the slowly rotating dimensions),
# near or below Adam's eps (1e-8) and dominated by the noise above, so they move by up to lr
# depending on the kernels. With the zero-initialised
# biases' norm only ~steps x lr, their relative error after 5 steps is ~1e-4: measured 4e-5 to
# 1e-4 vs the reference in test_parity.py, and 1e-4 between the reference's own AVX512 and AVX2
# runs. Gradients after step 1 inherit that (measured up to 6e-6), so only step 1's are compared;
# the later steps through the loss and grad-norm (insensitive to those tiny-gradient entries) and,
# exactly, by the fp64 cases.
FP32_TOL = 1e-5


def packable_steps(tmp_path, fam, cfg):
    """`make_steps` for the packing cases, checked meaningful: several packed rows per
    micro-batch and several samples in some row, as one text replica lays them out (`pack_bins`:
    `pack_order`, then `pack_rows`; a ``reference_fixture`` ``make``)."""
    from ray_dhp.parallel.packed_rows import pack_bins

    steps = make_steps(tmp_path, fam, cfg)
    rows = [pack_bins([s.num_tokens for s in mb], cfg.data.max_tokens) for st in steps for mb in st]
    assert all(len(r) > 1 for r in rows) and any(len(x) > 1 for r in rows for x in r)
    return steps
