"""Model state per rank for `ray-dhp plan` (`ray_dhp.planning.memory` re-exports these): what the
engine keeps, from the run's `PrecisionPolicy` (`ray_dhp.step.precision`): weights and gradients in
the policy's dtype for every parameter the rank holds, plus fp32 masters and AdamW moments for
every parameter the rank *updates* (at ZeRO stage 1 or 2 each parameter is updated by one of the
module's replicas: the same greedy partition as the engine, `ray_dhp.parallel.zero.owners`, over
the local TP shards; at stage 3 each rank holds its FSDP2 shard, ``torch.chunk`` rows of every
parameter, `TextParam.fsdp_share`). `rank_state` gives the exact bytes, which the tests compare
with the engine's tensors after a step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ray_dhp.models.sizes import ParamCounts, owned

__all__ = ["RankState", "rank_state"]


@dataclass(frozen=True)
class RankState:
    """Model-state bytes of one rank under a precision policy (see the module docstring)."""

    params: int        # parameters held (local shards)
    updated: int       # parameters this rank's optimizer steps (its ZeRO partition)
    weights: int
    grads: int
    masters: int
    optimizer: int     # AdamW moments
    startup_peak: int  # at engine construction: weights + masters + one full fp32 tensor
    staging: int = 0   # host memory: one copy of the checkpoint state (checkpoint.async_save)
    host: int = 0      # host memory: the offloaded masters and moments (part of ``total``)
    upcast: int = 0    # of the module stepped with the most: updated parameters whose gradients
    # keep the weights' dtype (FSDP2 shards), upcast chunk by chunk in its step
    released: int = 0  # gradient bytes freed before the update: another replica's (ZeRO 1-2)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.masters + self.optimizer

    @property
    def device_total(self) -> int:
        """What stays on the device: ``total`` less the offloaded host part."""
        return self.total - self.host


def rank_state(counts: ParamCounts, topology, rank: int, policy, micro_batches: int = 1) -> RankState:
    """Exact model-state bytes of ``rank`` under ``policy`` (a `PrecisionPolicy`) and the
    modules' ZeRO stages (``topology.vision.zero_stage``, ``topology.text.zero_stage``).

    Gradients are counted at their peak, during backward, where every trained parameter of the
    rank has one (stage 2 frees the others' only when it reduces them, at the end of the step).

    The start-up peak is what the rank holds once its engine is built (its weights and fp32
    masters; AdamW moments appear at the first step; at text stage 3 at least its whole TP
    shard's weights, which exist before FSDP2 shards them) plus one full parameter in fp32, the most
    a rank materialises beyond what it keeps while building (the largest tensor, e.g. the
    embedding, before it is sliced).

    At stage 3 FSDP2's gradient shards keep the weights' dtype for a step of one micro-batch
    and accumulate in the policy's gradient dtype (fp32 for bf16 weights) over several
    (``micro_batches``, `ray_dhp.parallel.fsdp.FSDPShards.sync`).
    """
    tg, vg = topology.text, topology.vision  # the modules `counts` counts, by their layouts
    on_t, on_v = tg.hosts(rank), vg.hosts(rank)
    ep = topology.text_expert_parallel
    if ep > 1 and on_t:  # experts: 1/ep of them, their own partition; the rest as without EP
        counts, experts = _split_experts(counts, ep, topology, rank)
        base = rank_state(counts, dataclasses.replace(topology, text_expert_parallel=1), rank, policy,
                          micro_batches)
        return _plus_experts(base, *experts, policy)
    if topology.text_expert_tp and on_t:  # experts TP-sharded like the dense MLP
        counts = _experts_tp_sharded(counts)
        topology = dataclasses.replace(topology, text_expert_tp=False)
    tp = tg.inner
    v = counts.vision_held_by(rank - vg.offset, vg.size, vg.zero_stage) if on_v else 0
    # the text state is partitioned over the gradient replicas: dp x cp (CP ranks replicate it)
    j, reps = (tg.grad_index(rank), tg.dp * tg.cp) if on_t else (0, 1)
    t = counts.text_held_by(j, reps, tp, tg.zero_stage) if on_t else 0
    vu = tu = 0
    if v:
        vu = counts.vision_updated_by(rank - vg.offset, vg.size, vg.zero_stage)
    if t:
        tu = counts.text_updated_by(j, reps, tp, tg.zero_stage)
    held, updated = v + t, vu + tu
    v_trained = (vu if vg.zero_stage == 3 else v - counts.vision_frozen) if v else 0
    t_trained = ((counts.text_updated_by(j, reps, tp, 0) if tg.zero_stage != 3
                  else tu) if t else 0)
    # gradients accumulate in the policy's grad dtype (fp32 for bf16 weights), except FSDP2's
    # shards of a module at stage 3, which keep the weights' dtype (FSDP2 sums in fp32 itself)
    fsdp = (t_trained if tg.zero_stage == 3 else 0) + (v_trained if vg.zero_stage == 3 else 0)
    # the modules step one after another, each upcasting its own shards chunk by chunk
    upcast = max(tu if tg.zero_stage == 3 else 0, vu if vg.zero_stage == 3 else 0)
    shard_bytes = policy.grad_bytes() if micro_batches > 1 else policy.weight_bytes()
    grads = (v_trained + t_trained - fsdp) * policy.grad_bytes() + fsdp * shard_bytes
    # host optimizer offload (`ray_dhp.step.offload`): the module's masters (without fp32 masters:
    # copies in the weights' dtype) and moments of what the rank updates live on the host
    off = vu * topology.vision.offload + tu * tg.offload
    copy_bytes = 4 if policy.master else policy.weight_bytes()
    masters = 4 * updated if policy.master else copy_bytes * off
    weights = held * policy.weight_bytes()
    optimizer = updated * 2 * _bytes(policy.moment_dtype)
    host = off * (copy_bytes + 2 * _bytes(policy.moment_dtype))
    # a checkpoint holds the fp32 masters of what the rank updates, the weights of the rest
    saved = masters + (held - (updated if policy.master else off)) * policy.weight_bytes()
    # stage 3 shards the weights after they are built: the whole (TP shard of the) module first
    built = ((counts.vision if v else 0) + (counts.text_per_rank(tp) if t else 0)) * policy.weight_bytes()
    # ZeRO 1-2: the gradients another replica updates are freed before the update
    # (`ray_dhp.step.updates`' release of the unowned gradients)
    released = ((v_trained - vu if vg.zero_stage in (1, 2) else 0)
                + (t_trained - tu if tg.zero_stage in (1, 2) else 0)) * policy.grad_bytes()
    return RankState(params=held, updated=updated, weights=weights,
                     grads=grads, masters=masters, optimizer=optimizer, released=released,
                     startup_peak=max(weights + masters - off * copy_bytes, built) + 4 * counts.largest,
                     staging=saved + optimizer, host=host,
                     upcast=upcast if policy.master and shard_bytes != policy.grad_bytes() else 0)


def _split_experts(counts: ParamCounts, ep: int, topology, rank: int):
    """``counts`` without the experts' tensors, and (elements held, trained, updated) of the
    experts of ``rank`` under expert parallelism ``ep`` (replicated over TP; at text ZeRO stages
    1-2 the trained ones' updates split over the ranks holding them as the engine's
    `ray_dhp.parallel.expert.expert_partition` splits them)."""
    from ray_dhp.parallel.expert import replica_index

    experts = [q for q in counts.text_sizes if q.expert]
    held = sum(q.numel for q in experts) // ep
    t = topology.text
    replicas = t.inner * (t.dp * t.cp // ep)  # the experts over the dp x cp replicas
    sizes = [q.numel // ep for q in experts if q.trained]
    trained = updated = sum(sizes)
    if t.zero_stage in (1, 2) and replicas > 1:
        updated = owned(sizes, replica_index(t, ep, rank), replicas)
    frozen = sum(q.numel for q in experts if not q.trained)
    rest = dataclasses.replace(
        counts, text=counts.text - sum(q.numel for q in experts),
        text_frozen=counts.text_frozen - frozen,
        text_sizes=tuple(q for q in counts.text_sizes if not q.expert))
    return rest, (held, trained, updated)


def _experts_tp_sharded(counts: ParamCounts) -> ParamCounts:
    """``counts`` with the experts' tensors TP-sharded (`ray_dhp.parallel.expert_tp`; neither
    along dim 0)."""
    moved = [q for q in counts.text_sizes if q.expert and not q.sharded]
    frozen = sum(q.numel for q in moved if not q.trained)
    return dataclasses.replace(
        counts, text_sharded=counts.text_sharded + sum(q.numel for q in moved),
        text_frozen_sharded=counts.text_frozen_sharded + frozen,
        text_sizes=tuple(dataclasses.replace(q, sharded=True) if q.expert else q
                         for q in counts.text_sizes))


def _plus_experts(base: RankState, held: int, trained: int, updated: int, policy) -> RankState:
    """``base`` plus the experts: ``held`` weights, gradients of the ``trained`` ones (in full
    until the step), masters and moments of the ``updated`` ones (this rank's partition)."""
    masters = 4 * updated if policy.master else 0
    optimizer = updated * 2 * _bytes(policy.moment_dtype)
    weights = held * policy.weight_bytes()
    saved = masters + (held - updated) * policy.weight_bytes() if policy.master else weights
    return dataclasses.replace(
        base, params=base.params + held, updated=base.updated + updated,
        weights=base.weights + weights, grads=base.grads + trained * policy.grad_bytes(),
        masters=base.masters + masters, optimizer=base.optimizer + optimizer,
        startup_peak=base.startup_peak + weights + masters, staging=base.staging + saved + optimizer,
        released=base.released + (trained - updated) * policy.grad_bytes())


def _bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
