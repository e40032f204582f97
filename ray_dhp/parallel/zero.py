"""ZeRO stages 1 and 2 for one module's replicas (stage 3 is torch FSDP2: `ray_dhp.parallel.fsdp`).

A module's *replicas* are the ranks that hold the same (TP shard of the) module: for the language
model its ``data_parallel`` ranks (one group per TP index), for the vision tower the whole vision
group (its Ulysses SP ranks hold the whole tower too). `ZeroPartition` assigns every trained
parameter (its local TP shard) to one replica, its *owner*, with the same deterministic greedy
partition on every rank (`owners`):

* stage 0: every replica all-reduces every gradient and steps every parameter;
* stage 1: every replica still all-reduces every gradient (SUM), but only the owner keeps the
  parameter's fp32 master and AdamW moments and steps it; the new values are broadcast from the
  owners after the step;
* stage 2: the gradients are SUM-*reduced to their owner* only (one reduce per owner bucket); the
  other replicas free them at once, so after the reduction a rank holds the gradients of its own
  partition; the update and the broadcast are those of stage 1.

The optimizer is plain AdamW over the owned parameters, so DCP checkpoints (keyed by parameter
name) save every parameter's state once and reshard it onto any layout or stage.

The global gradient norm counts every entry once: `ZeroPartition.norm_share` gives this rank's
share of the squared norm, and the shares of all ranks sum to the squared norm of the whole
model (stages 0-1: the module's first rank holds the module's norm, TP-summed; stage 2: each owner
adds the entries it owns, replicated TP entries only on TP rank 0).

Every collective runs on every replica in the same order (owners ascending, buckets in parameter
order), on the gradients' device: valid under NCCL.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel import data as dp
from ray_dhp.parallel.comm import CommCounter, record
from ray_dhp.parallel.tensor import is_sharded, local

ZERO_STAGES = (0, 1, 2, 3)
_BUCKET_BYTES = 32 << 20


def resolve_stage(stage: Optional[int], replicas: int, key: str) -> int:
    """The stage a module runs with: ``stage`` as given, or (None) 1 where the module has more than
    one replica — masters and moments are 12 of the 16 bytes per parameter, stage 1 removes
    ``1 - 1/replicas`` of them for one broadcast of the weights per step — else 0. A stage above 0
    with one replica has nothing to split: refused, naming ``<key>.zero_stage``."""
    if stage is None:
        return 1 if replicas > 1 else 0
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"{key}.zero_stage must be one of {ZERO_STAGES}, got {stage!r}.")
    if stage == 3 and key == "vision":
        raise ValueError("vision.zero_stage=3 is not supported: a vision replica whose share of a "
                         "micro-batch has no image skips the tower, and FSDP's per-block "
                         "collectives need every replica; use vision.zero_stage=2 (the tower's "
                         "masters, moments and reduced gradients partitioned).")
    if stage > 0 and replicas == 1:
        raise ValueError(f"{key}.zero_stage={stage} partitions the module's state over its "
                         f"replicas, but it has only one; set {key}.data_parallel > 1 or "
                         f"{key}.zero_stage=0.")
    return stage


def owners(sizes: list, world: int) -> list:
    """Assign parameters (by element count) to ``world`` ranks, largest first to the least loaded
    rank. Deterministic, so every rank computes the same owners."""
    load = [0] * world
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += sizes[i]
    return out


class ZeroPartition:
    """Stage 0, 1 or 2 of one module on this rank (see the module docstring).

    Args:
        params: the module's trained parameters, in a fixed order (the same on every replica).
        stage: 0, 1 or 2.
        group: the replicas' process group (None or size 1: no reduction).
        ranks: the replicas' world ranks, in group order; ``me`` this rank's index in it.
        leader: this rank holds the module's norm at stages 0-1 (one rank of the module).
        tp_group: the TP group the module's sharded gradients are split over (text), or None.
        tp_first: this rank is TP rank 0 (counts the replicated entries at stage 2).
    """

    def __init__(self, params: list, stage: int, group, ranks: list, me: int, *, leader: bool,
                 tp_group=None, tp_first: bool = True):
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroPartition handles stages 0-2, got {stage}")
        self.params, self.stage, self.group, self.ranks, self.me = params, stage, group, ranks, me
        self.leader, self.tp_group, self.tp_first = leader, tp_group, tp_first
        n = len(ranks)
        self.owner = (owners([local(p).numel() for p in params], n) if stage and n > 1
                      else [me] * len(params))

    def owns(self, p_index: int) -> bool:
        return self.owner[p_index] == self.me

    def mine(self, named: list) -> list:
        """The ``(name, param)`` pairs of ``named`` (same order as ``params``) this rank updates."""
        return [(n, p) for i, (n, p) in enumerate(named) if self.owns(i)]

    def owned(self) -> list:
        return [p for i, p in enumerate(self.params) if self.owns(i)]

    # -- gradients ---------------------------------------------------------------------------

    def reduce(self, comm: Optional[CommCounter], tag: str, reduce_dtype=None) -> None:
        """SUM the gradients over the replicas: all-reduce (stages 0, 1) or reduce to the owner
        (stage 2; the other replicas' gradients are then freed)."""
        if self.stage < 2:
            dp.all_reduce_grads(self.params, self.group, comm, tag, reduce_dtype=reduce_dtype)
            return
        for r, dst in enumerate(self.ranks):
            mine = [p for p, o in zip(self.params, self.owner) if o == r]
            for bucket in _buckets([local(p.grad) for p in mine]):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                if reduce_dtype is not None and flat.dtype != reduce_dtype:
                    flat = flat.to(reduce_dtype)
                record(comm, "reduce", tag, flat)
                dist.reduce(flat, dst=dst, group=self.group)
                if r == self.me:
                    _unflatten(flat, bucket)
            if r != self.me:
                for p in mine:
                    p.grad = None

    def norm_share(self, device) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (fp64 on ``device``); collective
        on the TP group at stages 0-1."""
        if self.stage < 2:
            sq = dp.squared_norm(self.params, self.tp_group, device=device)
            return sq if self.leader else torch.zeros_like(sq)
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.owned():
            if is_sharded(p.grad) or self.tp_first:
                sq += dp.sum_of_squares(local(p.grad).detach()).to(device)
        return sq

    # -- weights -----------------------------------------------------------------------------

    def broadcast(self, comm: Optional[CommCounter], tag: str) -> None:
        """Share the owners' new values with the other replicas (stages 1, 2)."""
        if not self.stage or len(self.ranks) == 1:
            return
        for r, src in enumerate(self.ranks):
            mine = [local(p) for p, o in zip(self.params, self.owner) if o == r]
            for bucket in _buckets(mine):
                flat = torch.cat([b.detach().reshape(-1) for b in bucket])
                dist.broadcast(flat, src=src, group=self.group)
                record(comm, "broadcast", tag, flat)
                if r != self.me:
                    with torch.no_grad():
                        _unflatten(flat, bucket)


def _buckets(tensors: list) -> list:
    """Consecutive runs of ``tensors`` of one dtype and at most ``_BUCKET_BYTES`` (one tensor
    may exceed it alone)."""
    out, size = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and size + n <= _BUCKET_BYTES:
            out[-1].append(t)
            size += n
        else:
            out.append([t])
            size = n
    return out


def _unflatten(flat: torch.Tensor, tensors: list) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


def replica_bytes(n: int, stage: int, grad_bytes: float, weight_bytes: float) -> float:
    """Bytes one replica sends per optimizer step to keep a module of ``grad_bytes`` gradients
    and ``weight_bytes`` weights (its local TP shard) in sync over ``n`` replicas (ring
    collectives: an all-reduce sends ``2 (n-1)/n`` of the buffer, a reduce, reduce-scatter,
    broadcast or all-gather ``(n-1)/n``): stage 0 all-reduces the gradients; stage 1 adds the
    owners' broadcast of the new weights; stage 2 reduces instead of all-reducing; stage 3
    (FSDP2) all-gathers the weights in forward and again in backward and reduce-scatters the
    gradients, once per step."""
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    return {0: 2 * f * grad_bytes, 1: 2 * f * grad_bytes + f * weight_bytes,
            2: f * grad_bytes + f * weight_bytes, 3: f * grad_bytes + 2 * f * weight_bytes}[stage]
