"""The module boundary: vision features in the (vision dp, sp) layout -> the (text dp, tp) layout.

Feature rows are named by a *global row id*: the index of the merged vision row in the
micro-batch's ``pooler_output`` (images in sample order, rows in the model's original order).
Every rank computes the same `BoundaryPlan` from plain data (who holds which ids, who needs which),
so no metadata is exchanged.

Forward: one ``all_to_all_single`` over the world; each vision rank sends each text rank the rows
it needs, the text rank re-orders them. Every TP rank of a text replica receives the rows
(replicated over TP).

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

from ray_dhp.parallel.comm import CommCounter, record
from ray_dhp.topology import Topology


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

    @property
    def num_out_rows(self) -> int:
        return int(sum(self.recv_counts))


def plan_boundary(topology: Topology, rank: int, held: dict, needed: dict) -> BoundaryPlan:
    """Plan one rank's part of the hand-off.

    Args:
        held: vision world rank -> LongTensor of the global row ids it computed, in local order.
        needed: text world rank -> ``range`` of global row ids it consumes (its samples' rows).
    """
    world = topology.world_size
    send_pos, recv_counts, recv_ids = [], [], []
    mine = held.get(rank)
    for dst in range(world):
        if mine is None or dst not in needed:
            send_pos.append(torch.zeros(0, dtype=torch.long))
            continue
        rng = needed[dst]
        mask = (mine >= rng.start) & (mine < rng.stop)
        send_pos.append(mask.nonzero().flatten())
    my_need = needed.get(rank)
    for src in range(world):
        ids = held.get(src)
        if my_need is None or ids is None:
            recv_counts.append(0)
            continue
        sel = ids[(ids >= my_need.start) & (ids < my_need.stop)]
        recv_counts.append(int(sel.numel()))
        recv_ids.append(sel)
    # Which text ranks return gradients to me: TP rank 0 of each replica I sent rows to.
    grad_sources = [
        (c := topology.text.coord(dst)) is not None and c[1] == 0 and send_pos[dst].numel() > 0
        for dst in range(world)
    ]
    ids = torch.cat(recv_ids) if recv_ids else torch.zeros(0, dtype=torch.long)
    perm = torch.argsort(ids)
    if my_need is not None and not torch.equal(ids[perm], torch.arange(my_need.start, my_need.stop)):
        raise RuntimeError("boundary plan: the vision group does not cover the rows a text rank needs")
    tc = topology.text.coord(rank)
    return BoundaryPlan(send_pos, recv_counts, perm, grad_sources,
                        returns_grad=tc is not None and tc[1] == 0)


def _a2a(send: torch.Tensor, in_rows: list, out_rows: list, dim: int, group,
         comm: Optional[CommCounter], tag: str) -> torch.Tensor:
    out = send.new_empty(sum(out_rows), dim)
    record(comm, "all_to_all", tag, send)
    dist.all_to_all_single(out, send.contiguous(), output_split_sizes=list(out_rows),
                           input_split_sizes=list(in_rows), group=group)
    return out


def features_forward(plan: BoundaryPlan, local: Optional[torch.Tensor], dim: int, dtype,
                     device, group=None, comm: Optional[CommCounter] = None) -> torch.Tensor:
    """Send my vision rows where they are needed; return my text rows (``[rows, dim]``)."""
    if local is None:
        local = torch.zeros(0, dim, dtype=dtype, device=device)
    send = torch.cat([local[p] for p in plan.send_pos]) if len(plan.send_pos) else local[:0]
    recv = _a2a(send, [p.numel() for p in plan.send_pos], plan.recv_counts, dim, group, comm,
                "boundary.fwd")
    return recv[plan.recv_perm]


def features_backward(plan: BoundaryPlan, grad_out: Optional[torch.Tensor], num_local: int,
                      dim: int, dtype, device, group=None,
                      comm: Optional[CommCounter] = None) -> torch.Tensor:
    """The adjoint of `features_forward`: gradients of my text rows -> gradients of my vision rows."""
    if plan.returns_grad and grad_out is not None:
        g_recv = torch.empty_like(grad_out)
        g_recv[plan.recv_perm] = grad_out
        in_rows = list(plan.recv_counts)
    else:
        g_recv = torch.zeros(0, dim, dtype=dtype, device=device)
        in_rows = [0] * len(plan.recv_counts)
    out_rows = [p.numel() if src else 0 for p, src in zip(plan.send_pos, plan.grad_sources)]
    back = _a2a(g_recv, in_rows, out_rows, dim, group, comm, "boundary.bwd")
    g_local = torch.zeros(num_local, dim, dtype=dtype, device=device)
    idx = [p for p, src in zip(plan.send_pos, plan.grad_sources) if src]
    if idx:
        g_local.index_add_(0, torch.cat(idx), back)
    return g_local
