"""The module boundary: vision features in the (vision dp, sp) layout -> the (text dp, tp) layout.

Feature rows are named by a *global row id*: the index of the merged vision row in the
micro-batch's ``pooler_output`` (images in sample order, rows in the model's original order).
Every rank computes the same `BoundaryPlan` from plain data (who holds which ids, who needs which),
so no metadata is exchanged.

Forward: point-to-point, non-blocking sends; each vision rank sends each text rank the rows it
needs (only the pairs that exchange rows communicate; a rank's rows to itself are copied), the
text rank re-orders them. Every TP rank of a text replica receives the rows (replicated over TP).
The sends are waited for at the end of the step (`InFlight`), so under the pipelined schedule a
vision rank goes on to its next phase without waiting for the text rank to take the features
(after the pair's first exchange, which creates its NCCL communicator with both ranks).

Point-to-point ordering (what makes it safe under NCCL, `exchange_order`): NCCL runs the
``isend``/``irecv`` of a pair of ranks on one two-rank communicator and one stream, in posting
order, and creates that communicator at the pair's first operation, blocking until both ranks
reach it. So every rank posts its messages peer by peer, peers in ascending rank order; within
a pair the lower rank sends first and receives second, the higher rank receives first and sends
second. Each pair's k-th operations are then a send and its matching receive, and the blocking
points (communicator creation, a wait) cannot form a cycle: a rank waiting on peer p means p is
still busy with a peer below this rank, and such a chain of ever lower ranks cannot close. It
holds for any plan, for both placements and both schedules: every rank walks the same phases
(`ray_dhp.step.schedule`) and each phase is one exchange. The CPU test suite checks it under
NCCL's semantics (``tests/nccl_twin.py``).

Backward (the exact adjoint): under tensor parallelism every TP rank of a replica ends with the
*full* gradient of the replicated features (DTensor all-reduces it at the first column-parallel
layer), so only TP rank 0 returns gradients; summing over TP ranks would multiply them by ``tp``.
Each global row belongs to exactly one text replica, so each vision row gets exactly one gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.comm import CommCounter, exchange_order, record
from ray_dhp.parallel.topology import Topology


def split_evenly(n: int, parts: int) -> list[range]:
    """Contiguous chunks of ``range(n)``, sizes differing by at most one (earlier chunks larger)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class BoundaryPlan:
    send_pos: list            # per world rank: LongTensor of my local row positions to send it
    recv_counts: list         # per world rank: rows I receive from it
    recv_perm: torch.Tensor   # received (concatenated by source) -> my text layout
    grad_sources: list        # per world rank: True if that rank returns gradients to me
    returns_grad: bool        # I am a text TP-rank-0 (I send gradients back)
    rank: int = 0             # my world rank

    @property
    def num_out_rows(self) -> int:
        return int(sum(self.recv_counts))


def _ids(x) -> torch.Tensor:
    """A ``range`` or a LongTensor of global row ids, as a LongTensor."""
    return torch.arange(x.start, x.stop) if isinstance(x, range) else torch.as_tensor(x, dtype=torch.long)


def plan_boundary(topology: Topology, rank: int, held: dict, needed: dict) -> BoundaryPlan:
    """Plan one rank's part of the hand-off.

    Args:
        held: vision world rank -> LongTensor of the global row ids it computed, in local order.
        needed: text world rank -> the global row ids it consumes (its samples' rows), each
            once: a ``range`` (contiguous samples) or a LongTensor (any samples in any order,
            e.g. a balanced assignment laid out as packed rows); it receives them in that order.
    """
    world = topology.world_size
    needed = {r: _ids(x) for r, x in needed.items()}
    send_pos, recv_counts, recv_ids = [], [], []
    mine = held.get(rank)
    for dst in range(world):
        if mine is None or dst not in needed:
            send_pos.append(torch.zeros(0, dtype=torch.long))
            continue
        send_pos.append(torch.isin(mine, needed[dst]).nonzero().flatten())
    my_need = needed.get(rank)
    for src in range(world):
        ids = held.get(src)
        if my_need is None or ids is None:
            recv_counts.append(0)
            continue
        sel = ids[torch.isin(ids, my_need)]
        recv_counts.append(int(sel.numel()))
        recv_ids.append(sel)
    # Which text ranks return gradients to me: TP rank 0 of each replica I sent rows to.
    grad_sources = [
        (c := topology.text.coord(dst)) is not None and c[1] == 0 and send_pos[dst].numel() > 0
        for dst in range(world)
    ]
    ids = torch.cat(recv_ids) if recv_ids else torch.zeros(0, dtype=torch.long)
    perm = torch.argsort(ids)
    if my_need is not None:  # received (ascending after argsort) -> the order it needs them in
        perm = perm[torch.argsort(torch.argsort(my_need))]
        if not torch.equal(ids[perm], my_need):
            raise RuntimeError("boundary plan: the vision group does not cover the rows a text "
                               "rank needs (exactly once)")
    tc = topology.text.coord(rank)
    return BoundaryPlan(send_pos, recv_counts, perm, grad_sources,
                        returns_grad=tc is not None and tc[1] == 0, rank=rank)


class InFlight:
    """Sends posted but not yet waited for (their buffers stay alive here); `wait` them before the
    buffers may change — the engine does at the end of the step."""

    def __init__(self):
        self._works: list = []

    def add(self, work, tensor) -> None:
        self._works.append((work, tensor))

    def wait(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works.clear()


def _exchange(sends: dict, recv_rows: dict, dim: int, like: torch.Tensor, rank: int, group,
              inflight: Optional[InFlight], comm: Optional[CommCounter], tag: str) -> dict:
    """Point-to-point in `exchange_order` (non-blocking), then wait for the receives only.
    ``sends``: peer -> rows to send; ``recv_rows``: peer -> rows to receive. Messages to oneself
    are copied. Returns peer -> received rows."""
    got, recvs, sent = {}, [], 0
    if rank in recv_rows:
        got[rank] = sends[rank]
    for kind, peer in exchange_order(rank, sends, recv_rows):
        if kind == "recv":
            got[peer] = like.new_empty(recv_rows[peer], dim)
            recvs.append(dist.irecv(got[peer], src=peer, group=group))
            continue
        rows = sends[peer].contiguous()
        work = dist.isend(rows, dst=peer, group=group)
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


def features_forward(plan: BoundaryPlan, local: Optional[torch.Tensor], dim: int, dtype,
                     device, group=None, comm: Optional[CommCounter] = None,
                     inflight: Optional[InFlight] = None) -> torch.Tensor:
    """Send my vision rows where they are needed (non-blocking sends, kept in ``inflight``);
    return my text rows (``[rows, dim]``) once they arrived."""
    if local is None:
        local = torch.zeros(0, dim, dtype=dtype, device=device)
    sends = {dst: local[p] for dst, p in enumerate(plan.send_pos) if p.numel() > 0}
    recv_rows = {src: n for src, n in enumerate(plan.recv_counts) if n > 0}
    got = _exchange(sends, recv_rows, dim, local, plan.rank, group, inflight, comm, "boundary.fwd")
    if not recv_rows:
        return local.new_zeros(0, dim)
    return torch.cat([got[src] for src in sorted(got)])[plan.recv_perm]


def features_backward(plan: BoundaryPlan, grad_out: Optional[torch.Tensor], num_local: int,
                      dim: int, dtype, device, group=None,
                      comm: Optional[CommCounter] = None,
                      inflight: Optional[InFlight] = None) -> torch.Tensor:
    """The adjoint of `features_forward`: gradients of my text rows -> gradients of my vision rows."""
    sends = {}
    if plan.returns_grad and grad_out is not None:
        g_recv = torch.empty_like(grad_out)
        g_recv[plan.recv_perm.to(grad_out.device)] = grad_out  # back to "concatenated by source" order
        off = 0
        for src, n in enumerate(plan.recv_counts):
            if n > 0:
                sends[src] = g_recv[off:off + n]
                off += n
    recv_rows = {dst: p.numel() for dst, (p, from_dst) in enumerate(zip(plan.send_pos, plan.grad_sources))
                 if from_dst and p.numel() > 0}
    like = torch.zeros(0, dim, dtype=dtype, device=device)
    got = _exchange(sends, recv_rows, dim, like, plan.rank, group, inflight, comm, "boundary.bwd")
    g_local = torch.zeros(num_local, dim, dtype=dtype, device=device)
    for dst in sorted(got):
        g_local.index_add_(0, plan.send_pos[dst].to(device), got[dst])  # plans are host tensors
    return g_local
