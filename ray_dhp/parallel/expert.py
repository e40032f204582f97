"""Expert parallelism: each sparse layer's experts partitioned over ``expert_parallel`` ranks.

Which ranks: the EP group is ``ep`` consecutive text *gradient replicas* of one TP index
(replica ``j`` is EP rank ``j % ep`` of EP group ``j // ep``), as in Megatron and torchtitan.
The gradient replicas are the ``dp x cp`` rows of the text mesh (`ModuleLayout.grad_index`):
EP needs ranks that hold *different* tokens — data-parallel replicas do, and so do the
context-parallel ranks of one replica (each holds its slice of the sequence outside attention,
where the sparse blocks run: `ray_dhp.parallel.context`); the TP ranks of a replica hold the
same (replicated) tokens, so partitioning experts over them would only split the compute of
identical tokens. With CP the EP group takes the CP ranks first (innermost after TP), so CP2 x
EP2 keeps the experts' all-to-alls inside the replica's node-local CP x TP block. The ranks
with the same EP index in the other EP groups hold the same experts and form the
expert-data-parallel (EDP) group, size ``dp x cp / ep``: expert gradients are summed over it
only (each EP rank's experts saw tokens from all of its EP group's ranks already, through the
all-to-all). Non-expert parameters keep TP / DP (x CP) as before.

At text ZeRO stages 1-2 the experts' masters and AdamW moments are partitioned over the ranks
holding the same experts (`expert_partition`: the EDP replicas and their TP ranks).

The forward of a sparse block on one rank, for its ``T`` tokens routed top-k (the stock router):

1. the ``T * k`` (token, expert) assignments are sorted by expert — so by destination rank,
   rank ``r`` holding experts ``[r E/ep, (r+1) E/ep)``; the per-destination counts are exchanged
   (`dist.all_to_all_single` of an int64 device tensor; the splits are uneven, no capacity
   factor, no token is dropped);
2. the hidden states of the assignments and their expert ids go to the experts' ranks
   (all-to-all, `_AllToAll`: its autograd adjoint is the all-to-all with the splits swapped);
3. the received rows are grouped by local expert and pass that expert's SwiGLU
   (``torch._grouped_mm`` on CUDA where available, a loop over the local experts otherwise);
4. the outputs go back (all-to-all), are scaled by their routing weights and summed into the
   tokens (``index_add_``), as the stock transformers experts module does (the fused
   ``gate_up_proj`` layout).

Every EP rank runs the same three all-to-alls per sparse layer in the same order, forward and
(reversed) backward: valid under NCCL. The experts' parameters are DTensors ``Shard(0)`` over a
1-D EP mesh (full tensors by ``full_tensor()``, checkpoints and exports see the stock names).
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.comm import CommCounter, record

__all__ = ["ep_groups", "edp_groups", "replica_groups", "shard_experts", "expert_params",
           "expert_partition"]


def _replicas(t) -> int:
    """The text gradient replicas the experts are partitioned over: ``dp x cp``."""
    return t.dp * t.cp


def _at(t, replica: int, k: int) -> int:
    """World rank of gradient replica ``replica`` (`ModuleLayout.grad_index`), TP index ``k``."""
    return t.offset + replica * t.inner + k


def ep_groups(text_layout, ep: int) -> list:
    """Rank lists of the EP groups: per TP index, blocks of ``ep`` consecutive replicas."""
    t = text_layout
    return [[_at(t, b * ep + e, k) for e in range(ep)]
            for k in range(t.inner) for b in range(_replicas(t) // ep)]


def edp_groups(text_layout, ep: int) -> list:
    """Rank lists of the expert-data-parallel groups: same TP index, same EP index."""
    t = text_layout
    return [[_at(t, b * ep + e, k) for b in range(_replicas(t) // ep)]
            for k in range(t.inner) for e in range(ep)]


def replica_groups(text_layout, ep: int) -> list:
    """Rank lists of the expert *replica* groups: all the ranks holding the same experts (one
    EP index: its EDP replicas and, as the sparse blocks are replicated over TP, their TP
    ranks), ordered by (TP index, EDP index)."""
    t = text_layout
    return [[_at(t, b * ep + e, k) for k in range(t.inner) for b in range(_replicas(t) // ep)]
            for e in range(ep)]


def replica_index(text_layout, ep: int, world_rank: int) -> int:
    """The index of ``world_rank`` in its expert replica group (`replica_groups`)."""
    t = text_layout
    j, k = t.grad_index(world_rank), (world_rank - t.offset) % t.inner
    return k * (_replicas(t) // ep) + j // ep


def expert_partition(params: list, groups):
    """The experts' optimizer partition (a `ray_dhp.parallel.zero.ZeroPartition`): at text ZeRO
    stages 1-2 the fp32 masters and AdamW moments of the local experts are split over the
    ranks holding the same experts (`replica_groups`), each parameter updated by one of them and
    broadcast after the step (ZeRO-1: the gradients are still summed over the EDP group by
    `reduce_expert_grads`, and kept in full until the step); stage 0 or one replica: no split."""
    from ray_dhp.parallel.zero import ZeroPartition

    topo = groups.topology
    t, ep = topo.text, topo.text_expert_parallel
    ranks = next(r for r in replica_groups(t, ep) if groups.rank in r)
    stage = 1 if t.zero_stage in (1, 2) and len(ranks) > 1 else 0
    return ZeroPartition(params, stage, groups.text_erep, ranks,
                         replica_index(t, ep, groups.rank), leader=False)


def expert_modules(model: torch.nn.Module, spec) -> list:
    return [m for n, m in model.named_modules() if n.endswith("." + spec.experts_suffix)]


def expert_params(model: torch.nn.Module, spec) -> list:
    """The experts' parameters (``gate_up_proj``, ``down_proj`` of every sparse layer)."""
    return [p for m in expert_modules(model, spec) for p in m.parameters(recurse=False)]


def shard_experts(model: torch.nn.Module, spec, ep_mesh, comm: Optional[CommCounter] = None) -> None:
    """On the meta model: make every experts module's parameters ``Shard(0)`` DTensors over
    ``ep_mesh`` (materialised later with their slice of the init or checkpoint) and give the
    module the expert-parallel forward."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for m in expert_modules(model, spec):
        for name, p in list(m.named_parameters(recurse=False)):
            d = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
            m._parameters[name] = torch.nn.Parameter(d, requires_grad=p.requires_grad)
        m.ep_group, m.ep_comm = ep_mesh.get_group(), comm
        m.forward = types.MethodType(_ep_forward, m)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, comm):
        ctx.splits, ctx.group, ctx.comm = (out_splits, in_splits), group, comm
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        record(comm, "all_to_all", "text.experts", x)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        record(ctx.comm, "all_to_all", "text.experts.grad", grad)
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The stock experts' ``forward`` with this rank's experts only (module docstring)."""
    group, comm = self.ep_group, self.ep_comm
    ep = dist.get_world_size(group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    n_local = gate_up.shape[0]
    top_k = top_k_index.shape[1]
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token = order // top_k
    expert = flat_expert[order]
    send = torch.bincount(expert // n_local, minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # the counts: int64 on the device
    in_splits, out_splits = send.tolist(), recv.tolist()
    x = _AllToAll.apply(hidden_states[token], out_splits, in_splits, group, comm)
    got_expert = expert.new_empty(sum(out_splits))
    dist.all_to_all_single(got_expert, expert.contiguous(), out_splits, in_splits, group=group)
    grouped = x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) and hasattr(torch, "_grouped_mm")
    y = local_experts(self.act_fn, x, got_expert - dist.get_rank(group) * n_local, gate_up, down,
                      grouped)
    y = _AllToAll.apply(y, in_splits, out_splits, group, comm)
    weights = top_k_weights.reshape(-1)[order]
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, token, (y * weights[:, None]).to(out.dtype))


def local_experts(act_fn, x, local_expert, gate_up, down, grouped: bool) -> torch.Tensor:
    """Rows ``x`` through their local experts' SwiGLU (``local_expert``: each row's index into
    ``gate_up [e, 2I, H]`` / ``down [e, H, I]``), in ``x``'s order. ``grouped``: two
    ``torch._grouped_mm`` over the rows sorted by expert (CUDA; fp32/bf16); else a loop over
    the local experts (the CPU path, and fp64)."""
    order = torch.argsort(local_expert, stable=True)
    counts = torch.bincount(local_expert, minlength=gate_up.shape[0])
    xs = x[order]
    if grouped:
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = torch._grouped_mm(act_fn(gate) * up, down.transpose(1, 2), offs=offs)
    else:
        parts = []
        for e, rows in enumerate(xs.split(counts.tolist())):
            gate, up = torch.nn.functional.linear(rows, gate_up[e]).chunk(2, dim=-1)
            parts.append(torch.nn.functional.linear(act_fn(gate) * up, down[e]))
        ys = torch.cat(parts)
    return ys.index_select(0, torch.argsort(order))


def reduce_expert_grads(engine, reduce_dtype=None) -> torch.Tensor:
    """SUM the experts' gradients over the expert-data-parallel group; return this rank's share
    of the global squared norm: the local experts' squares on the first EDP replica of the
    first TP rank (each expert entry counted once over the world), 0 elsewhere."""
    from ray_dhp.parallel import data_parallel as dp
    from ray_dhp.parallel.tensor import local

    g = engine.groups
    dp.all_reduce_grads(engine.expert_params, g.text_edp, engine.comm, "text.expert_grads",
                        reduce_dtype=reduce_dtype)
    t, k = g.topology.text, g.text_coord[1]
    share = torch.zeros((), dtype=torch.float64, device=g.device)
    if k == 0 and t.grad_index(g.rank) < g.topology.text_expert_parallel:
        for p in engine.expert_params:
            share += dp.sum_of_squares(local(p.grad).detach()).to(g.device)
    return share
