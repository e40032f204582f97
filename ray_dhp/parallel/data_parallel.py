"""Gradient reduction across replicas and the global gradient norm.

The loss of every micro-batch is normalised by the *global* number of target tokens of the step,
so each rank's gradient is a partial sum of the single-process gradient: the right reduction is a
SUM over data-parallel replicas (and over SP ranks for the replicated vision weights), not a mean.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ray_dhp.parallel.comm import CommCounter, record
from ray_dhp.parallel.tensor import is_sharded, local

_BUCKET_BYTES = 32 << 20


def ensure_grads(params: Iterable[torch.Tensor]) -> list:
    """Give every parameter a gradient (zeros where this rank saw no data for it, in the
    parameter's ``grad_dtype``: fp32 accumulation under the bf16 policies), laid out like the
    parameter.

    DTensor may return a gradient with other placements than its parameter (the vocab-parallel
    embedding's gradient comes back ``Replicate`` for a ``Shard(0)`` weight); redistributing a
    replicated gradient to a shard is a local slice, and then every reduction and the norm see
    each entry exactly once.
    """
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p, dtype=p.grad_dtype or p.dtype)
        elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)
        out.append(p)
    return out


def all_reduce_grads(params: list, group, comm: Optional[CommCounter], tag: str,
                     reduce_dtype: Optional[torch.dtype] = None) -> None:
    """SUM-all-reduce the (local shards of the) gradients of ``params`` over ``group``, bucketed.

    ``reduce_dtype`` (e.g. fp32 for bf16 gradients): each bucket is upcast, summed in that
    dtype, and rounded back into the gradients once. The buckets live on the gradients' device.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [local(p.grad) for p in params]
    bucket: list = []
    size = 0
    for g in grads + [None]:
        if g is not None and (not bucket or (size + g.numel() * g.element_size() <= _BUCKET_BYTES
                                             and g.dtype == bucket[0].dtype)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:  # one flat buffer, made directly in the reduce dtype (no second copy)
            flat = torch.empty(sum(b.numel() for b in bucket), dtype=reduce_dtype or bucket[0].dtype,
                               device=bucket[0].device)
            off = 0
            for b in bucket:
                flat[off:off + b.numel()].copy_(b.reshape(-1))
                off += b.numel()
            record(comm, "all_reduce", tag, flat)
            dist.all_reduce(flat, group=group)
            off = 0
            for b in bucket:
                b.copy_(flat[off:off + b.numel()].view_as(b))
                off += b.numel()
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


def squared_norm(params: list, tp_group=None, device=None) -> torch.Tensor:
    """Sum of squared gradient entries (fp64, on ``device``: the group's device, so the TP
    all-reduce is valid under NCCL), each parameter counted once across TP ranks.

    TP-sharded gradients contribute their local shard (summed over the TP group); replicated
    gradients (identical on every TP rank) are counted once, from this rank. No gradient is
    copied whole (`sum_of_squares`).
    """
    if device is None:
        device = local(params[0].grad).device if params else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        sq = sum_of_squares(local(p.grad).detach()).to(device)
        if is_sharded(p.grad):
            sharded += sq
        else:
            replicated += sq
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return sharded + replicated


_NORM_SLICE = 1 << 22  # elements upcast at a time by `sum_of_squares` (16 MiB in fp32)


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """``sum(g**2)`` as an fp64 scalar on ``g``'s device, without an fp64 (or fp32) copy of the
    whole of ``g``: slices of `_NORM_SLICE` elements are reduced with ``vector_norm`` accumulating in
    fp32 (fp64 for fp64 gradients; a fused upcast on CUDA, a slice-sized one on CPU) and their
    squares summed in fp64. The fp32 accumulation of a bf16 gradient rounds far below the bf16
    gradient's own rounding; fp64 gradients (the exactness tests) stay in fp64 throughout."""
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    flat = g.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    for piece in flat.split(_NORM_SLICE):
        total += torch.linalg.vector_norm(piece, dtype=acc).double().square()
    return total


def clip_coefficient(total_norm: float, max_norm: Optional[float]) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` applies: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_grads(params: list, coef: float) -> None:
    if coef == 1.0:
        return
    for p in params:
        if p.grad is not None:  # None: a parameter another rank updates (ZeRO-1), freed
            local(p.grad).mul_(coef)
