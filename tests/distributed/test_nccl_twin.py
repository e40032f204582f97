"""The NCCL twin (tests/nccl_twin.py, on for every `run_on_ranks` body) fails where NCCL would
hang, and the boundary's point-to-point rule (`ray_dhp.parallel.boundary.exchange_order`) passes it.

Negative control: `_old_exchange` is the boundary exchange before the rule (every receive posted,
then every send). gloo runs it; under NCCL a collocated pair posts "recv, send" on both sides and
both receives wait for sends queued behind them. The twin must report that deadlock, naming the
operations, for the demo layout here and (slow) for every collocated layout of the parity matrix.

The twin sees every collective where torch dispatches it (tests/twin_collectives.py): DTensor's
(TP/SP redistributes, ``loss_parallel``) and FSDP2's as well as ours. A collocated and a disjoint
layout with text TP + SP and ZeRO-3 pass it with fp64 parity, their logs holding DTensor's and
FSDP2's collectives; an all-reduce that rank 0 alone issues inside the TP forward fails it,
naming the op and where it was issued, with both ranks' lists (before gloo runs it), and so
does one that rank 0 alone issues last (gloo waits forever there: rank 1's exit check says why).
"""

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

from ray_dhp.parallel.comm import record
from tests.distributed.parity import make_steps
from tests.distributed.family_rows import PARITY_DEFAULT as DEFAULT
from tests.distributed.parity import CFG, dense_layout
from tests.spawn import run_on_ranks


def _old_exchange(sends, recv_rows, dim, like, rank, group, inflight, comm, tag):
    """The exchange as it was (kept as the negative control): all irecvs, then all isends."""
    got, recvs = {}, []
    for src, n in recv_rows.items():
        if src == rank:
            got[src] = sends[rank]
            continue
        got[src] = like.new_empty(n, dim)
        recvs.append(dist.irecv(got[src], src=src, group=group))
    sent = 0
    for dst, rows in sends.items():
        if dst == rank:
            continue
        rows = rows.contiguous()
        work = dist.isend(rows, dst=dst, group=group)
        sent += rows.numel() * rows.element_size()
        if inflight is not None:
            inflight.add(work, rows)
        else:
            work.wait()
    if sends or recv_rows:
        record(comm, "p2p", tag, sent)
    for work in recvs:
        work.wait()
    return got


def _demo_boundary(rank, world, old):
    """Collocated SP2/TP2 (the demo's layout): each rank holds half the rows, both need all."""
    from ray_dhp.parallel import boundary as bnd
    from ray_dhp.parallel.topology import Topology

    if old:
        bnd._exchange = _old_exchange
    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    held, needed = {0: torch.arange(3), 1: torch.arange(3, 6)}, {0: range(6), 1: range(6)}
    plan = bnd.plan_boundary(topo, rank, held, needed)
    feats = torch.arange(6 * 4, dtype=torch.float64).view(6, 4)
    inflight = bnd.InFlight()
    out = bnd.features_forward(plan, feats[3 * rank:3 * rank + 3], 4, torch.float64,
                               torch.device("cpu"), inflight=inflight)
    inflight.wait()
    return out


def test_old_exchange_deadlocks_under_the_twin_and_the_rule_does_not():
    with pytest.raises(AssertionError) as err:
        run_on_ranks(_demo_boundary, 2, (True,))
    msg = str(err.value)
    assert "NCCL twin: deadlock" in msg and "#0 with rank" in msg, msg
    assert "is recv ((3, 4), 'torch.float64')" in msg, msg  # both sides' first operation: a receive
    out = run_on_ranks(_demo_boundary, 2, (False,))
    feats = torch.arange(24, dtype=torch.float64).view(6, 4)
    assert all(torch.equal(o, feats) for o in out)


def _random_exchanges(rank, world, seed):
    """Rounds of all-pairs exchanges with random sizes (0 = no message), blocking and in flight."""
    from ray_dhp.parallel import boundary as bnd

    rng = random.Random(seed)
    got_all = []
    for rnd in range(6):
        counts = [[rng.choice([0, 0, 1, 2, 3]) for _ in range(world)] for _ in range(world)]
        sends = {d: torch.full((counts[rank][d], 2), 100.0 * rnd + 10 * rank + d)
                 for d in range(world) if counts[rank][d]}
        recv_rows = {s: counts[s][rank] for s in range(world) if counts[s][rank]}
        inflight = bnd.InFlight() if rnd % 2 else None
        got = bnd._exchange(sends, recv_rows, 2, torch.zeros(0, 2), rank, None, inflight, None, "t")
        if inflight is not None:
            inflight.wait()
        for s, rows in got.items():
            assert torch.equal(rows, torch.full((counts[s][rank], 2), 100.0 * rnd + 10 * s + rank))
        got_all.append(sorted(got))
    return got_all


def test_the_rule_passes_the_twin_for_random_plans():
    out = run_on_ranks(_random_exchanges, 4, (7,))
    assert any(len(g) > 1 for rounds in out for g in rounds)  # ranks did exchange with several peers


def _mismatched_collective(rank, world):
    t = torch.ones(4) if rank == 0 else torch.ones(2, 2)  # same bytes: gloo takes it
    dist.all_reduce(t)
    return t.sum().item()


def test_collectives_of_different_shapes_fail():
    with pytest.raises(AssertionError, match=r"collective #0 on group .* differs"):
        run_on_ranks(_mismatched_collective, 2)


def _one_more_all_reduce_at_the_end(rank, world):
    dist.all_reduce(torch.ones(2))
    if rank == 0:  # gloo waits for rank 1 forever: the twin of rank 1 must say why, at its exit
        dist.all_reduce(torch.ones(3))


def test_a_collective_only_one_rank_issues_last_fails_at_the_other_ranks_exit():
    with pytest.raises(AssertionError, match=r"collective #1 on group .* differs: rank 1 issued nothing; "
                                             r"rank 0 issued all_reduce float32 \(\(3,\),\)"):
        run_on_ranks(_one_more_all_reduce_at_the_end, 2, timeout_s=120)


def _creation_cycle(rank, world):
    """Rank r sends to r+1 first, then receives from r-1: gloo completes it, NCCL's lazily
    created pair communicators wait in a cycle (r waits for r+1, which waits for r+2, ...)."""
    x = torch.ones(2)
    work = dist.isend(x, dst=(rank + 1) % world)
    dist.irecv(torch.empty(2), src=(rank - 1) % world).wait()
    work.wait()


def test_a_pair_communicator_cycle_fails_after_the_timeout_naming_the_operation():
    with pytest.raises(AssertionError, match=r"to create its communicator with rank \d on group"):
        run_on_ranks(_creation_cycle, 3, twin_timeout_s=3)


def _old_engine_body(rank, world, *args):
    from ray_dhp.parallel import boundary as bnd
    from tests.distributed.parity import _engine_body

    bnd._exchange = _old_exchange
    return _engine_body(rank, world, *args)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(DEFAULT),
                         ids=lambda c: f"{c[0]}-{c[1]}-sp{c[2][0]}dp{c[2][1]}-tp{c[3][0]}dp{c[3][1]}")
def test_old_exchange_under_the_twin_on_the_parity_layouts(case, tmp_path):
    """Collocated layouts deadlock (every one in the matrix has SP or TP > 1, so some pair
    exchanges rows both ways); disjoint ones only send one way per pair and pass also with the
    old order. The fixed rule passes them all in test_families.py (which runs under the twin)."""
    from ray_dhp.parallel.topology import Topology
    from tests.distributed.parity import make_steps

    fam, placement, v, t = case
    cfg = dataclasses.replace(CFG, num_steps=1)
    steps = make_steps(tmp_path, fam, cfg)[:1]
    layout = dense_layout(placement, v, t)
    world = Topology.build(**layout).world_size
    args = (fam, layout, cfg, steps, torch.float64, "sequential", False, (), None)
    if placement == "disjoint":
        run_on_ranks(_old_engine_body, world, args)
        return
    with pytest.raises(AssertionError, match=r"NCCL twin: deadlock .* is recv .* is recv"):
        run_on_ranks(_old_engine_body, world, args)


# -- DTensor and FSDP2 collectives ------------------------------------------------------------------

TWIN_CFG = dataclasses.replace(CFG, num_steps=1)
TEXT_SP_ZERO3 = {  # text TP2 x DP2 with sequence parallelism and FSDP2 (ZeRO-3) on the dp dim
    "collocated": dict(placement="collocated", vision_dp=2, vision_sp=2, vision_zero=1),
    "disjoint": dict(placement="disjoint", vision_dp=1, vision_sp=1),
}


def _logged_engine_body(rank, world, *args):
    """`parity._engine_body`, plus what the twin logged: (op as dispatched, issuing torch module)."""
    from collections import Counter

    from tests.distributed.parity import _engine_body
    from tests.nccl_twin import active

    out = _engine_body(rank, world, *args)
    out["twin"] = Counter((src, (via or "").split(":")[0]) for seq in active().log.values()
                          for _, src, via, _ in seq)
    return out


@pytest.mark.parametrize("placement", sorted(TEXT_SP_ZERO3))
def test_dtensor_and_fsdp2_collectives_pass_the_twin_with_text_sp_and_zero3(placement, tmp_path):
    """fp64 parity (tolerance 1e-10, as tests/distributed/test_parity.py) of one step at text
    TP2 x DP2 + SP, text ZeRO-3 (FSDP2), under the twin, and every text rank's log
    holds DTensor's functional collectives and FSDP2's all-gathers and reduce-scatters: the
    twin compared them across ranks."""
    from tests.distributed.parity import assert_parity, merge_ranks, run_reference
    from ray_dhp.parallel.topology import Topology

    layout = dict(TEXT_SP_ZERO3[placement], text_dp=2, text_tp=2, text_sequence_parallel=True,
                  text_zero=3)
    steps = make_steps(tmp_path, "qwen2_5_vl", TWIN_CFG)
    ref = run_reference("qwen2_5_vl", TWIN_CFG, steps, torch.float64)
    topo = Topology.build(**layout)
    outs = run_on_ranks(_logged_engine_body, topo.world_size,
                        ("qwen2_5_vl", layout, TWIN_CFG, steps, torch.float64, "sequential", False, ()))
    assert_parity(merge_ranks(outs), ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
    for rank in topo.text.ranks:
        seen = outs[rank]["twin"]
        dtensor = {src for src, via in seen if via.startswith("torch/distributed/tensor/")}
        fsdp = {src for src, via in seen if via.startswith("torch/distributed/fsdp/")}
        assert {"_c10d_functional.all_gather_into_tensor", "_c10d_functional.reduce_scatter_tensor",
                "_c10d_functional.all_reduce"} <= dtensor, (rank, seen)
        assert fsdp == {"c10d._allgather_base_", "c10d._reduce_scatter_base_"}, (rank, seen)


def _extra_all_reduce_body(rank, world, *args):
    """The engine, with rank 0 alone issuing an all-reduce (a DTensor Partial -> Replicate
    redistribute over the TP mesh) in the forward of the first TP-sharded module it runs."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from tests.distributed.parity import _engine_body

    fired = []

    def inject(module, inputs, output):
        weight = getattr(module, "weight", None)
        if rank != 0 or fired or not isinstance(weight, DTensor):
            return
        mesh = weight.device_mesh
        if "tp" not in (mesh.mesh_dim_names or ()):
            return
        mesh = mesh["tp"] if mesh.ndim > 1 else mesh
        fired.append(module)
        DTensor.from_local(torch.ones(5, 3, dtype=torch.float64), mesh, [Partial()]).redistribute(
            mesh, [Replicate()])

    torch.nn.modules.module.register_module_forward_hook(inject)
    return _engine_body(rank, world, *args)


def test_an_extra_all_reduce_in_the_tp_forward_fails_naming_the_op(tmp_path):
    """Negative control: text TP2 (collocated with vision SP2), rank 0 issues one more
    all-reduce than rank 1 inside the TP forward. The twin fails naming the op, its shape, the
    DTensor code that issued it and the hook that called it, with both ranks' lists."""
    layout = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    steps = make_steps(tmp_path, "qwen2_5_vl", TWIN_CFG)
    with pytest.raises(AssertionError) as err:
        run_on_ranks(_extra_all_reduce_body, 2,
                     ("qwen2_5_vl", layout, TWIN_CFG, steps, torch.float64, "sequential", False, ()),
                     timeout_s=300, twin_timeout_s=60)
    msg = str(err.value)
    assert "NCCL twin: collective #" in msg and "differs" in msg, msg
    assert "all_reduce float64 ((5, 3),) [_c10d_functional.all_reduce via torch/distributed/tensor/" in msg, msg
    assert "test_nccl_twin.py" in msg and "inject]" in msg, msg  # where it was issued
    assert "rank 0's collectives on group" in msg and "rank 1's collectives on group" in msg, msg
