"""Under the bf16 policies micro-batch gradients accumulate in fp32, in the engine and in the
single-process reference alike (`ray_dhp.step.precision.accumulate_in_fp32`).

Each backward still computes bf16 gradients; what the test isolates is their *sum* across many
micro-batches. Every incoming gradient of every backward is captured by a tensor hook and summed
in fp64: that is the exact sum the accumulator should hold. fp32 accumulation is within a few
fp32 roundings of it; bf16 accumulation (the control: the engine without `accumulate_in_fp32`)
rounds every partial sum to 8 bits and is off by orders of magnitude more.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ray_dhp import demo
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps, rel_err
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=2, seed=0, weight_decay=0.1,
                      max_grad_norm=None, precision="bf16_mixed")
ONE_RANK = dict(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
M = 12  # micro-batches of one sample each (the two steps' 8 samples, then 4 again)


def _micro_batches(steps) -> list:
    samples = [s for step in steps for mb in step for s in mb]
    return [[samples[i % len(samples)]] for i in range(M)]


def _exact_sums(named):
    """Hooks summing every incoming gradient of ``named`` parameters in fp64 (the exact sum)."""
    sums = {}

    def hook_for(name):
        def hook(grad):
            g = grad.detach().double()
            sums[name] = g if name not in sums else sums[name] + g
        return hook

    handles = [p.register_hook(hook_for(n)) for n, p in named if p.requires_grad]
    return sums, handles


def _worst(named, sums) -> float:
    return max(rel_err(p.grad, sums[n]) for n, p in named if n in sums)


def _engine_body(rank, world, mbs):
    """The engine's accumulated gradients vs the exact sums, with fp32 accumulation and (the
    control) without: gradients left in the weights' dtype, bf16."""
    from ray_dhp.step import engine as engine_mod
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**ONE_RANK), torch.device("cpu"))
    out = {}
    for kind in ("fp32", "bf16"):
        if kind == "bf16":
            engine_mod.accumulate_in_fp32 = lambda params, policy: None
        engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, CFG.step_config())
        named = list(engine.visual.named_parameters()) + list(engine.text_model.named_parameters())
        sums, _ = _exact_sums(named)
        engine.forward_backward(mbs)
        out[kind] = {"worst": _worst(named, sums),
                     "dtypes": {p.grad.dtype for _, p in named if p.grad is not None}}
    return out


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_bf16_gradients_accumulate_in_fp32(tmp_path):
    """12 micro-batches under bf16_mixed: the engine's accumulated fp32 gradients equal the fp64
    sum of the bf16 per-backward gradients to fp32 rounding (bound: 12 additions of 2^-24
    relative each, ~7e-7, with a margin: 1e-5; measured ~1e-8); bf16 accumulation of the same
    gradients is off by > 100x that (each partial sum rounded to 2^-9 relative: measured
    ~5e-3). The reference accumulates the same way (its fp32 sums are the masters' gradients)."""
    from ray_dhp.step.reference import ReferenceTrainer

    mbs = _micro_batches(make_steps(tmp_path, FAMILY, CFG))
    out = run_on_ranks(_engine_body, 1, args=(mbs,))[0]
    fp32, bf16 = out["fp32"], out["bf16"]
    print(f"engine: fp32 accumulation {fp32['worst']:.3g}, bf16 accumulation {bf16['worst']:.3g}")
    assert fp32["dtypes"] == {torch.float32} and bf16["dtypes"] == {torch.bfloat16}
    assert fp32["worst"] <= 1e-5, fp32
    assert bf16["worst"] > 100 * fp32["worst"], (fp32, bf16)

    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), replace(CFG, num_steps=1).optim,
                           precision=CFG.precision)
    named = list(ref.model.named_parameters())
    sums, _ = _exact_sums(named)
    seen = {}
    step = ref.opt.step

    def capturing(*a, **k):  # the fp32 gradients the reference's AdamW steps (no clipping)
        seen.update({n: m.grad.detach().clone() for n, m in ref.masters.items()})
        return step(*a, **k)

    ref.opt.step = capturing
    ref.step(mbs)
    worst = max(rel_err(seen[n], sums[n]) for n in seen if n in sums)
    print(f"reference: fp32 accumulation {worst:.3g}")
    assert worst <= 1e-5, worst
