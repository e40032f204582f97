"""The update half of `ray_dhp.step.engine.DHPEngine` (step 5 of its docstring): gradient
reduction over the replicas, the global norm counted once over every module, clipping, one
optimizer per module (fp32 masters under ``bf16_mixed``) over its ZeRO partition
(`ray_dhp.parallel.zero`).

`UpdateMixin` holds no state of its own: it works on the engine's ``groups``, ``cfg``, ``policy``,
``comm``, parameter lists, optimizers and masters, which `DHPEngine.__init__` sets up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_dhp.parallel import data_parallel as dp
from ray_dhp.parallel.expert import expert_params, expert_partition, reduce_expert_grads
from ray_dhp.parallel.zero import ZeroPartition
from ray_dhp.step.offload import host_bytes
from ray_dhp.step.optim import build_optimizer_for
from ray_dhp.step.precision import local_nbytes, restore_grad_dtype, round_grads_for_update


class UpdateMixin:
    """Gradients -> clipped update -> stepped optimizers, for `DHPEngine`."""

    # -- optimizers over each module's ZeRO partition (ray_dhp.parallel.zero) -----------------

    def _build_optimizers(self) -> None:
        """AdamW for each module this rank hosts (the encoders in module order, then the LM)
        over the parameters this rank updates: all of them at stage 0, its ZeRO partition at
        stages 1-2 (`ray_dhp.parallel.zero`). ``self.opts[name]``: (optimizer, scheduler,
        fp32 masters or None)."""
        g, topo = self.groups, self.groups.topology
        self.zero, self.opts = {}, {}
        for m in topo.encoders:
            module = self.shards.get(m.name)
            if module is None:
                continue
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            sharded = self.sharding.get(m.name)
            if sharded is not None:  # stage 3 (e.g. models/fsdp_vision.py)
                z = self.zero[m.name] = sharded
                z.params = [p for _, p in named]
            else:
                self.zero[m.name] = z = ZeroPartition(
                    [p for _, p in named], m.zero_stage, g.encoders[m.name].all, m.ranks,
                    g.rank - m.offset, leader=g.rank == m.offset)
            self.opts[m.name] = build_optimizer_for(
                z.mine(named), self.cfg.optim, self.policy, prefix=self.family.encoder_prefix(m.name),
                offload=m.offload)
        self.expert_params = []  # expert parallelism: reduced over EDP, own partition (parallel/expert.py)
        if self.text_model is not None:
            t, (_, k) = topo.text, g.text_coord
            named = [(n, p) for n, p in self.text_model.named_parameters() if p.requires_grad]
            if topo.text_expert_parallel > 1:
                ids = {id(p) for p in expert_params(self.text_model, self.family.moe)}
                experts = [(n, p) for n, p in named if id(p) in ids]
                named = [(n, p) for n, p in named if id(p) not in ids]
                self.expert_params = [p for _, p in experts]
                self.zero["experts"] = expert_partition(self.expert_params, g)
                experts = self.zero["experts"].mine(experts)
            sharded = self.sharding.get("text")
            if sharded is not None:  # stage 3 (ray_dhp.parallel.fsdp)
                z = self.zero["text"] = sharded
                z.params = [p for _, p in named]
            else:
                self.zero["text"] = z = ZeroPartition(
                    [p for _, p in named], t.zero_stage, g.text_dp,
                    t.dp_groups()[k], t.grad_index(g.rank), leader=g.rank == t.offset,
                    tp_group=g.text_tp, tp_first=k == 0, late=self._partial)
            self.opts["text"] = build_optimizer_for(
                z.mine(named) + (experts if self.expert_params else []), self.cfg.optim, self.policy,
                offload=t.offload)
        for z in self.zero.values():
            if hasattr(z, "install_hooks"):  # a ZeroPartition (FSDP2 reduces in its own hooks)
                z.install_hooks()
        self._had_input = {}  # module name -> any input since the last optimizer step

    # the vision side's and the LM's state by their old names (readers outside the engine)
    vision_params = property(lambda self: self.params.get("vision", []))
    text_params = property(lambda self: self.params.get("text", []))
    vision_opt = property(lambda self: self._opt_part("vision", 0))
    vision_sched = property(lambda self: self._opt_part("vision", 1))
    vision_masters = property(lambda self: self._opt_part("vision", 2))
    text_opt = property(lambda self: self._opt_part("text", 0))
    text_sched = property(lambda self: self._opt_part("text", 1))
    text_masters = property(lambda self: self._opt_part("text", 2))

    def _opt_part(self, name: str, i: int):
        got = self.opts.get(name)
        return None if got is None else got[i]

    def _all_params(self) -> list:
        return [p for ps in self.params.values() for p in ps]

    def _trains_this_step(self, name: str) -> bool:
        """Does module ``name`` step this time? Not an encoder that had no input since the last
        optimizer step: the single-process model gives its parameters no gradient, so AdamW
        leaves them (and their moments) untouched, weight decay included. The LM always has
        input; a module at ZeRO-3 (the vision tower) runs its collectives in every step and
        steps always."""
        if self.groups.topology.encoder(name) is None or name in self.sharding:  # not input-gated
            return True
        return self._had_input.get(name, False)

    def _zero_broadcast(self) -> None:
        for name, z in self.zero.items():
            z.broadcast(self.comm, f"{name}.zero")

    # -- gradients -----------------------------------------------------------------------------

    def _reduce_and_clip(self) -> float:
        """Reduce the gradients over replicas; the global norm (each parameter counted once).
        Every control value lives on ``groups.device`` (valid under NCCL and gloo alike)."""
        g, dev, topo = self.groups, self.groups.device, self.groups.topology
        up = self._reduce_dtype()
        dp.ensure_grads([p for n, ps in self.params.items() if self._trains_this_step(n) for p in ps])
        self.last_grad_bytes = sum(local_nbytes(p.grad) for p in self._all_params()
                                   if p.grad is not None)  # before stage 2 frees the others'
        shares = []
        for m in topo.encoders:  # module order: the same collectives in the same order everywhere
            sq = torch.zeros((), dtype=torch.float64, device=dev)
            if g.hosts(m.name) and self._trains_this_step(m.name):
                self.zero[m.name].reduce(self.comm, f"{m.name}.grads", reduce_dtype=up)
                sq = self.zero[m.name].norm_share(dev)
            shares.append(sq)
        t_sq = torch.zeros((), dtype=torch.float64, device=dev)
        if g.is_text:
            dp.all_reduce_grads(self._partial, g.text_tp, self.comm, "text.partial_grads", reduce_dtype=up)
            self.zero["text"].reduce(self.comm, "text.grads", reduce_dtype=up)
            t_sq = self.zero["text"].norm_share(dev)
            if self.expert_params:  # summed over the replicas holding the same experts only
                t_sq = t_sq + reduce_expert_grads(self, up)
        parts = torch.stack(shares + [t_sq])  # each rank's share; every entry counted once in all
        dist.all_reduce(parts)
        return float(parts.sum().sqrt())

    def _reduce_dtype(self):
        return torch.float32 if self.dtype in (torch.bfloat16, torch.float16) else None

    def _arm_reduce(self, module: str, last_backward: bool) -> None:
        """Before ``module``'s last backward of a step ``forward_backward(..., last=True)`` runs:
        let its gradient buckets start reducing in that backward (`ZeroPartition.arm`)."""
        z = self.zero.get(module)
        if last_backward and self._overlap and hasattr(z, "arm"):
            z.arm(self.comm, f"{module}.grads", reduce_dtype=self._reduce_dtype())

    def _optimizer_step(self, coef: float) -> None:
        """Clip by ``coef`` and step each module's optimizer (`_trains_this_step`; its
        scheduler steps regardless). With fp32 masters (bf16_mixed) the bf16 gradients are
        upcast into the masters' gradients, clipped there in fp32, the masters stepped, and
        the bf16 weights refreshed from them."""
        self._release_unowned_grads()
        for name, params in self.params.items():
            opt, sched, masters = self.opts.get(name, (None, None, None))
            if not self._trains_this_step(name):
                pass
            elif masters is not None:  # fp32 master gradients one chunk at a time
                masters.step(opt, coef)
            elif self.policy.param_dtype != self.policy.grad_dtype:  # bf16: fp32 sums rounded once
                round_grads_for_update(params, coef)
                if opt is not None:
                    opt.step()
                restore_grad_dtype(params, self.policy)
            else:  # at ZeRO stage 2 only the owned gradients are left
                dp.scale_grads([p for p in params if p.grad is not None], coef)
                if opt is not None:
                    opt.step()
            if opt is not None:
                sched.step()
        for p in self._all_params():  # incl. those another rank updates
            p.grad = None
        self._had_input = {}
        self._zero_broadcast()

    def _release_unowned_grads(self) -> None:
        """Free the gradients of the parameters another replica updates (ZeRO stages 1-2):
        reduced and counted in the norm already, not needed by this rank's update."""
        for z in self.zero.values():
            if hasattr(z, "owns"):  # a ZeroPartition (FSDP's shards are all this rank's own)
                for i, p in enumerate(z.params):
                    if not z.owns(i):
                        p.grad = None

    def params_from_masters(self) -> None:
        """After loading masters (a checkpoint): round them into the weights, and share the
        ZeRO owners' values with the other replicas (collective on each module's replicas)."""
        for _, _, masters in self.opts.values():
            if masters is not None:
                masters.masters_to_params()
        topo = self.groups.topology  # the same on every rank: the broadcast is collective
        if self.policy.master or any(m.offload for m in topo.modules):
            self._zero_broadcast()

    def state_bytes(self) -> dict:
        """Bytes of model state this rank holds, measured from its tensors
        (`measure_engine_state`)."""
        return measure_engine_state(self)


def measure_engine_state(engine) -> dict:
    """Bytes a `DHPEngine` holds, measured from its tensors: weights (local shards), the
    gradients the last step held when the optimizer ran (``engine.last_grad_bytes``; 0 before the
    first step), fp32 masters and the optimizers' tensors (AdamW moments, after a step). Compare
    with `ray_dhp.planning.memory.rank_state`."""
    params = [p for ps in engine.params.values() for p in ps] + getattr(engine, "frozen_params", [])
    opts = list(engine.opts.values())  # (optimizer, scheduler, masters) per hosted module
    out = {"weights": sum(local_nbytes(p) for p in params),
           "grads": getattr(engine, "last_grad_bytes", 0),
           "masters": sum(m.nbytes() for _, _, m in opts if m is not None),
           "optimizer": sum(local_nbytes(v) for opt, _, _ in opts
                            if opt is not None for st in opt.state.values()
                            for v in st.values() if torch.is_tensor(v) and v.dim() > 0)}
    out["total"] = sum(out.values())
    out["host"] = host_bytes(engine)  # part of the total
    return out
