"""ZeRO stage 3: torch FSDP2 (``fully_shard``) for the language model over the ``dp`` dimension of
the text mesh, on top of the DTensor TP plan on ``tp`` (torchtitan's 2-D order: TP first, then
one FSDP unit per decoder layer, the embedding and the head, and the root for what is left); and
for the vision tower over the whole vision group (`ray_dhp.models.fsdp_vision`).

Each unit's parameters are ``Shard(0)`` over the data-parallel replicas (and keep their TP
placement): a rank holds ``1/dp`` of its TP shard's weights, gradients, fp32 masters and AdamW
moments. A unit's weights are all-gathered before its forward (the next unit's are prefetched)
and again before its backward; its gradients are reduce-scattered (SUM: the loss is normalised by
the step's global token count, `ray_dhp.parallel.data_parallel`) right after its backward, in fp32 for
bf16 gradients, in every micro-batch: the gradient shards accumulate over the micro-batches, so
no rank ever holds a module's unsharded gradients beyond the unit running (deferring the
reduce-scatter to the last micro-batch, FSDP2's ``set_requires_gradient_sync(False)``, would keep
every unit's unsharded gradients between micro-batches: 35 GiB per rank for a 72B text shard).
Under the bf16 policies the shards accumulate in fp32 (`FSDPShards.sync`: an fp32 gradient per
shard from the step's first micro-batch, into which FSDP2 adds each reduced bf16 shard), as
plain parameters do; a step of one micro-batch keeps FSDP2's bf16 shard.

The global gradient norm counts each entry once: every rank adds its local shard, the entries of
TP-replicated parameters only on TP rank 0 (`FSDPShards.norm_share`).

FSDP's collectives run in the forward/backward of every unit, so every text replica must run the
same number of forwards per micro-batch: the engine runs a replica's samples as one padded batch
at stage 3 (not as cost-balanced padded groups).
"""

from __future__ import annotations

from typing import Optional

import torch

from ray_dhp.parallel import data_parallel as dp
from ray_dhp.parallel.tensor import local


def text_units(model, family) -> list:
    """The FSDP units of a language model, in forward order: embedding, decoder layers, head."""
    lm = family.language_model(model)
    units = [lm.embed_tokens, *lm.layers]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not lm.embed_tokens.weight:
        units.append(head)
    return units


class FSDPShards:
    """One module's FSDP2 units and root on this rank (see the module docstring).

    Args:
        units: the FSDP units, in forward order; ``root``: the module whose forward runs them
            (it takes the parameters no unit holds).
        dp_mesh: the 1-D mesh of the module's replicas; ``reduce_dtype``: FSDP's reduce dtype.
        tp_first: this rank counts the TP-replicated entries in the norm (TP rank 0; True
            without TP).
        chain: the units that always run in this order, prefetched along it (`overlap`;
            default all of them).
    """

    def __init__(self, units: list, root, dp_mesh, reduce_dtype, tp_first: bool,
                 chain: Optional[list] = None):
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
        self.units = units
        for unit in self.units:
            fully_shard(unit, mesh=dp_mesh, mp_policy=mp)
        fully_shard(root, mesh=dp_mesh, mp_policy=mp)
        self.modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
        for m in self.modules:
            m.set_gradient_divide_factor(1.0)  # SUM over replicas, not a mean
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        self.root, self.tp_first, self.cpu = root, tp_first, dp_mesh.device_type == "cpu"
        self.chain = units if chain is None else chain
        self.overlap(True)

    def overlap(self, on: bool) -> None:
        """Explicit prefetch along ``chain``: a unit's pre-forward starts the next one's
        all-gather and its pre-backward the previous one's. On a CPU device (gloo) the prefetches are issued ``async_op`` so that
        they run on gloo's thread while this unit computes: CPU has no streams, so FSDP2's
        default (stream-ordered) prefetch would gather synchronously. On CUDA FSDP2's own streams
        overlap them (``async_op`` stays off). ``on=False``: FSDP2's defaults (the benchmark's
        ``s3-plain`` contender, `benchmarks/zero_stages.py`)."""
        for a, b in zip(self.chain, self.chain[1:]):
            a.set_modules_to_forward_prefetch([b] if on else [])
            b.set_modules_to_backward_prefetch([a] if on else [])
        if self.cpu:  # torch's private setter (no public one); never called on CUDA
            self.root._set_unshard_async_op(on)

    accumulate_dtype = None  # `accumulate_in`

    def accumulate_in(self, dtype) -> None:
        """Accumulate the gradient shards over micro-batches in ``dtype`` (fp32 for bf16
        weights; None: the weights' dtype, FSDP2's own)."""
        self.accumulate_dtype = dtype

    @torch.no_grad()
    def sync(self, first: bool, last: bool) -> None:
        """Before a micro-batch's backward (``first`` / ``last``: the step's first / last with
        work for this module): every backward reduce-scatters (module docstring); with an
        `accumulate_dtype` and more than one backward in the step, each shard's gradient is held
        in it from the first, and FSDP2 adds each micro-batch's reduced shard into it."""
        self.root.set_requires_gradient_sync(True)
        self.root.set_is_last_backward(True)
        acc = self.accumulate_dtype
        if acc is None:
            return
        for p in self.params:
            g = p.grad
            if g is None:
                if first and last:  # one backward: FSDP2's shard in the weights' dtype
                    p.grad_dtype = None
                    continue
                p.grad_dtype = acc
                p.grad = torch.zeros_like(p, dtype=acc)
            elif g.dtype != acc:  # an earlier call's shard, accumulated further
                p.grad = None
                p.grad_dtype = acc
                p.grad = g.to(acc)

    def norm_share(self, device) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (fp64 on ``device``)."""
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.params:
            placements = getattr(p.grad, "placements", ())
            tp_sharded = len(placements) > 1 and placements[1].is_shard()
            if tp_sharded or self.tp_first:
                sq += dp.sum_of_squares(local(p.grad).detach()).to(device)
        return sq

    # -- the `ray_dhp.parallel.zero.ZeroPartition` interface the update step uses ----------------

    params: list = ()

    def mine(self, named: list) -> list:
        return list(named)  # every rank steps its shard of every parameter

    def reduce(self, comm, tag: str, reduce_dtype=None) -> None:
        """Nothing left to do: the backward reduce-scattered the gradients."""

    def broadcast(self, comm, tag: str) -> None:
        """Nothing to share: each rank's shard is the only copy."""


def shard_text(model, family, dp_mesh, reduce_dtype, tp_first: bool) -> FSDPShards:
    """ZeRO stage 3 of a language model: `FSDPShards` over ``dp_mesh`` (the dp dimension of its
    text mesh), one unit per decoder layer, the embedding and the head (``family``: its
    `FamilySpec`). Call it after the TP plan and LoRA and before the parameter lists are taken
    (``fully_shard`` replaces the parameters with their sharded DTensors)."""
    units = text_units(model, family)
    return FSDPShards(_odd_dtype(units, model) + units, model, dp_mesh, reduce_dtype,
                      tp_first=tp_first, chain=units)


def _odd_dtype(units: list, root) -> list:
    """The sub-modules of ``units`` (and of the ``root`` outside them) whose own parameters have
    another dtype than the rest of their unit (a router kept in fp32 in a model of another dtype,
    an fp32 rotary parameter beside the final norm): each is a unit of its own (FSDP2 gathers one
    dtype per unit), sharded before its parent and gathered by its own pre-forward (outside the
    prefetch chain); the outermost such module only, where one holds another (a router's fp32
    statistics under the fp32 router: one unit)."""
    out = []
    in_units = {id(m) for unit in units for m in unit.modules()}
    for unit in [*units, root]:
        counts: dict = {}
        for p in unit.parameters():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        main = max(counts, key=counts.get, default=None)
        # modules under one already taken (the root: every unit's modules are its units')
        inside: set = set(in_units) if unit is root else set()
        for m in unit.modules():
            own = [p for p in m._parameters.values() if p is not None]  # a dropped slot is None
            if m is not unit and id(m) not in inside and own and all(p.dtype != main for p in own):
                out.append(m)
                inside.update(id(s) for s in m.modules())
    return out


def reduce_dtype_of(policy, dtype):
    """FSDP's gradient reduce dtype: the ``policy``'s (fp32 for bf16 gradients); none in fp64
    (``dtype``: the weights')."""
    return policy.reduce_dtype if dtype != torch.float64 else None
