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

Every collective runs on every replica in the same order, on the gradients' device: valid under
NCCL. The gradient buckets (`ZeroPartition.buckets`) are a fixed list computed alike on every
replica, and bucket k is launched only after buckets 0..k-1: from the module's last backward of
the step (`ZeroPartition.arm`), as soon as its gradients and those of every earlier bucket are
final (post-accumulate-grad hooks, overlapping the reduction with the rest of the backward),
else by `ZeroPartition.reduce`. So the replicas' collectives on the module's group are the same
sequence whatever order the hooks fire in (a rank with no data for some parameter just launches
later); no other collective runs on that group during the backward. At most `MAX_IN_FLIGHT`
buckets reduce at once (each holds a flat buffer in the reduce dtype).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel import data_parallel as dp
from ray_dhp.parallel.comm import CommCounter, record
from ray_dhp.parallel.tensor import is_sharded, local

ZERO_STAGES = (0, 1, 2, 3)
_BUCKET_BYTES = 32 << 20  # weight broadcasts (gradient buckets: `ray_dhp.parallel.data_parallel._BUCKET_BYTES`)
MAX_IN_FLIGHT = 2  # gradient buckets reducing at once (each holds one flat buffer)


def resolve_stage(stage: Optional[int], replicas: int, key: str) -> int:
    """The stage a module runs with: ``stage`` as given, or (None) 1 where the module has more than
    one replica — masters and moments are 12 of the 16 bytes per parameter, stage 1 removes
    ``1 - 1/replicas`` of them for one broadcast of the weights per step — else 0. A stage above 0
    with one replica has nothing to split: refused, naming ``<key>.zero_stage``."""
    if stage is None:
        return 1 if replicas > 1 else 0
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"{key}.zero_stage must be one of {ZERO_STAGES}, got {stage!r}.")
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
        late: parameters whose gradients are summed over the TP group first (by the caller, after
            the backward): never launched from backward, their buckets come last.
    """

    def __init__(self, params: list, stage: int, group, ranks: list, me: int, *, leader: bool,
                 tp_group=None, tp_first: bool = True, late: list = ()):
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroPartition handles stages 0-2, got {stage}")
        self.params, self.stage, self.group, self.ranks, self.me = params, stage, group, ranks, me
        self.leader, self.tp_group, self.tp_first = leader, tp_group, tp_first
        late_ids = {id(p) for p in late}
        self.late = {i for i, p in enumerate(params) if id(p) in late_ids}
        self._armed, self._plan, self._inflight = False, None, []
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

    # -- gradients: buckets in a fixed order, launched early from backward hooks -------------

    def reduce(self, comm: Optional[CommCounter], tag: str, reduce_dtype=None) -> None:
        """SUM the gradients over the replicas: all-reduce (stages 0, 1) or reduce to the owner
        (stage 2; the other replicas' gradients are then freed). The buckets `arm` let backward
        launch already are not launched again: the rest are launched here, in bucket order, and
        all are waited for before this returns."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        self._arm(comm, tag, reduce_dtype)
        dp.ensure_grads(self.params)  # zeros where this rank saw no data (not launched yet)
        while self._next < len(self._plan):
            self._launch()
        while self._inflight:
            self._complete()
        if self.stage == 2:
            for i in range(len(self.params)):
                if not self.owns(i):
                    self.params[i].grad = None
        self._armed = False

    def arm(self, comm: Optional[CommCounter], tag: str, reduce_dtype=None) -> None:
        """Let the coming backward (the module's last of the step) launch each bucket as soon
        as it and every bucket before it are complete (`install_hooks`), overlapping the
        reduction with the rest of the backward; `reduce` launches the rest and waits."""
        if self.group is not None and dist.get_world_size(self.group) > 1:
            self._arm(comm, tag, reduce_dtype)

    def install_hooks(self) -> None:
        """A post-accumulate-grad hook on every parameter: once armed, a parameter whose
        gradient is final marks it ready (nothing happens while unarmed)."""
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))

    def buckets(self) -> list:
        """The reduction's buckets as ``(owner index or None, parameter indices)``, in the order
        they are launched on every replica: parameters in backward order (the reverse of
        ``params``; the ``late`` ones last), cut into runs of one gradient dtype of at most the
        bucket size (`ray_dhp.parallel.data_parallel._BUCKET_BYTES`, one tensor may exceed it); at stage 2
        the owners' buckets one owner after the other."""
        order = [i for i in reversed(range(len(self.params))) if i not in self.late] + \
            [i for i in reversed(range(len(self.params))) if i in self.late]
        dtype = [p.grad_dtype or p.dtype for p in self.params]
        size = [local(p).numel() * torch.empty((), dtype=d).element_size()
                for p, d in zip(self.params, dtype)]
        runs = [(None, order)] if self.stage < 2 else \
            [(r, [i for i in order if self.owner[i] == r]) for r in range(len(self.ranks))]
        out = []
        for dst, idx in runs:
            cur, n = [], 0
            for i in idx:
                if cur and (dtype[i] != dtype[cur[0]] or n + size[i] > dp._BUCKET_BYTES):
                    out.append((dst, cur))
                    cur, n = [], 0
                cur.append(i)
                n += size[i]
            if cur:
                out.append((dst, cur))
        return out

    def _arm(self, comm, tag, reduce_dtype) -> None:
        if self._armed:
            return
        self._armed, self._args = True, (comm, tag, reduce_dtype)
        self._plan = self._plan or self.buckets()
        self._ready, self._next, self._inflight = set(), 0, []

    def _grad_ready(self, i: int) -> None:
        if not self._armed or i in self.late:
            return
        dp.ensure_grads([self.params[i]])  # a DTensor gradient in its parameter's placements
        self._ready.add(i)
        while self._next < len(self._plan) and self._ready.issuperset(self._plan[self._next][1]):
            self._launch()

    def _launch(self) -> None:
        """Launch bucket ``_next`` (async); at most `MAX_IN_FLIGHT` buckets' buffers at once."""
        comm, tag, reduce_dtype = self._args
        dst, idx = self._plan[self._next]
        self._next += 1
        if len(self._inflight) >= MAX_IN_FLIGHT:
            self._complete()
        grads = [local(self.params[i].grad) for i in idx]
        flat = torch.empty(sum(g.numel() for g in grads), device=grads[0].device,
                           dtype=reduce_dtype or grads[0].dtype)  # made in the reduce dtype
        _pack(flat, grads)
        if dst is None:
            record(comm, "all_reduce", tag, flat)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            record(comm, "reduce", tag, flat)
            work = dist.reduce(flat, dst=self.ranks[dst], group=self.group, async_op=True)
        self._inflight.append((dst, grads, flat, work))

    def _complete(self) -> None:
        """Wait for the oldest bucket in flight and write its sums into the gradients (stage 2:
        only on the owner)."""
        dst, grads, flat, work = self._inflight.pop(0)
        work.wait()
        if dst is None or dst == self.me:
            _unflatten(flat, grads)

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


def _pack(flat: torch.Tensor, tensors: list) -> None:
    off = 0
    for t in tensors:
        flat[off:off + t.numel()].copy_(t.reshape(-1))
        off += t.numel()


def _unflatten(flat: torch.Tensor, tensors: list) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


def replica_bytes(n: int, stage: int, grad_bytes: float, weight_bytes: float,
                  micro_batches: int = 1) -> float:
    """Bytes one replica sends per optimizer step to keep a module of ``grad_bytes`` gradients
    and ``weight_bytes`` weights (its local TP shard) in sync over ``n`` replicas (ring
    collectives: an all-reduce sends ``2 (n-1)/n`` of the buffer, a reduce, reduce-scatter,
    broadcast or all-gather ``(n-1)/n``): stage 0 all-reduces the gradients; stage 1 adds the
    owners' broadcast of the new weights; stage 2 reduces instead of all-reducing; stage 3
    (FSDP2) all-gathers the weights in forward and again in backward and reduce-scatters the
    gradients, in each of the step's ``micro_batches`` (`ray_dhp.parallel.fsdp`)."""
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    if stage == 3:
        return micro_batches * (f * grad_bytes + 2 * f * weight_bytes)
    return {0: 2 * f * grad_bytes, 1: 2 * f * grad_bytes + f * weight_bytes,
            2: f * grad_bytes + f * weight_bytes}[stage]
