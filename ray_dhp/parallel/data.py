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
    """Give every parameter a gradient (zeros where this rank saw no data for it), laid out like
    the parameter.

    DTensor may return a gradient with other placements than its parameter (the vocab-parallel
    embedding's gradient comes back ``Replicate`` for a ``Shard(0)`` weight); redistributing a
    replicated gradient to a shard is a local slice, and then every reduction and the norm see
    each entry exactly once.
    """
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
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
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            if reduce_dtype is not None and flat.dtype != reduce_dtype:
                flat = flat.to(reduce_dtype)
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
    gradients (identical on every TP rank) are counted once, from this rank.
    """
    if device is None:
        device = local(params[0].grad).device if params else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = local(p.grad).detach().to(device, torch.float64)
        if is_sharded(p.grad):
            sharded += g.pow(2).sum()
        else:
            replicated += g.pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return sharded + replicated


def clip_coefficient(total_norm: float, max_norm: Optional[float]) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` applies: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_grads(params: list, coef: float) -> None:
    if coef == 1.0:
        return
    for p in params:
        local(p.grad).mul_(coef)
