"""Gradient buckets reduced during the backward (`ray_dhp.parallel.zero.ZeroPartition.arm`).

The buckets are one fixed list on every replica and bucket k is launched only after buckets
0..k-1, so the collectives on the module's group are the same sequence on every rank whatever
order the post-accumulate-grad hooks fire in. Shown here with two ranks whose gradients become
final in opposite orders (the NCCL twin of `tests.spawn` compares the ranks' collective
sequences at exit), exact in fp64 at stages 0-2; and in the engine: with
``forward_backward(last=True)`` the reductions start inside the backward, without it none do.
"""

from __future__ import annotations

import torch

from tests.spawn import run_on_ranks

SIZES = (300, 7, 1200, 64, 513, 90)  # elements; 8 KiB buckets: several buckets, one alone


def _body(rank, world):
    return {stage: _stage(rank, stage) for stage in (0, 1, 2)}


def _stage(rank, stage):
    import torch.distributed as dist

    from ray_dhp.parallel import data_parallel as dp
    from ray_dhp.parallel.comm import CommCounter
    from ray_dhp.parallel.zero import ZeroPartition

    dp._BUCKET_BYTES = 8 << 10
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in SIZES]
    group = dist.new_group([0, 1])
    z = ZeroPartition(params, stage, group, [0, 1], rank, leader=rank == 0)
    z.install_hooks()
    comm = CommCounter()
    z.arm(comm, "t")
    # rank 0's gradients become final in backward order (the buckets' order), rank 1's in the
    # opposite order: rank 0 launches every bucket inside its backwards, rank 1 only at its last
    order = list(reversed(range(len(params)))) if rank == 0 else list(range(len(params)))
    launched = []
    for i in order:
        g = torch.Generator().manual_seed(100 * rank + i)
        coef = torch.randn(SIZES[i], dtype=torch.float64, generator=g)
        (params[i] * coef).sum().backward()  # one backward per parameter: its hook fires
        launched.append(comm.total().calls)
    z.reduce(comm, "t")
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    return {"launched": launched, "calls": comm.total().calls, "grads": grads,
            "buckets": len(z.buckets()), "owners": list(z.owner)}


def _expected(i):
    out = torch.zeros(SIZES[i], dtype=torch.float64)
    for rank in (0, 1):
        g = torch.Generator().manual_seed(100 * rank + i)
        out += torch.randn(SIZES[i], dtype=torch.float64, generator=g)
    return out


def test_buckets_launch_in_one_order_whatever_order_gradients_arrive():
    by_rank = run_on_ranks(_body, 2)
    for stage in (0, 1, 2):
        _check(stage, [out[stage] for out in by_rank])


def _check(stage, outs):
    first, second = outs
    n = first["buckets"]
    assert n >= (3 if stage < 2 else 2) and first["calls"] == second["calls"] == n
    assert first["launched"][-1] == n  # all launched during rank 0's backwards
    assert second["launched"][-1] == n
    if stage < 2:  # rank 1's first bucket (the last parameters) is complete only at its end
        assert second["launched"][:-1] == [0] * (len(SIZES) - 1)
    assert 1 <= first["launched"][-2] < n  # buckets left before the backwards were over
    for rank, out in enumerate(outs):
        for i, g in enumerate(out["grads"]):
            if stage == 2 and out["owners"][i] != rank:
                assert g is None  # reduced to its owner, freed here
            else:
                assert torch.equal(g, _expected(i)), (rank, i)  # exact: a sum of two terms


def _engine_body(rank, world, steps, cfg):
    from ray_dhp import demo
    from ray_dhp.parallel.comm import CommCounter
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    layout = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    comm = CommCounter()
    engine = DHPEngine(demo.tiny_model_config("qwen2_5_vl"), groups, cfg.step_config(), comm=comm,
                       dtype=torch.float64)
    out = {}
    for last in (False, True):
        comm.reset()
        engine.forward_backward(steps[0], last=last)
        out[last] = comm.total("all_reduce", "vision.grads").calls
        engine.optimizer_step()
        out[f"{last}-after"] = comm.total("all_reduce", "vision.grads").calls
    return out


def test_engine_reduces_during_the_last_backward(tmp_path):
    """SP2 vision replicas: with ``last=True`` every vision bucket is launched before
    ``forward_backward`` returns; without it, all of them in ``optimizer_step``."""
    from ray_dhp.config.train_loop import TrainLoopConfig
    from tests.distributed.parity import make_steps

    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1, seed=0)
    steps = make_steps(tmp_path, "qwen2_5_vl", cfg)
    outs = run_on_ranks(_engine_body, 2, args=(steps, cfg))
    for out in outs:
        assert out[False] == 0 and out["False-after"] > 0
        assert out[True] == out["True-after"] == out["False-after"]
