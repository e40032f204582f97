"""The update half of `ray_dhp.step.engine.DHPEngine` (step 5 of its docstring): gradient
reduction over the replicas, the global norm counted once over both modules, clipping, both
optimizers (fp32 masters under ``bf16_mixed``) over each module's ZeRO partition
(`ray_dhp.parallel.zero`).

`UpdateMixin` holds no state of its own: it works on the engine's ``groups``, ``cfg``, ``policy``,
``comm``, parameter lists, optimizers and masters, which `DHPEngine.__init__` sets up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_dhp.parallel import data as dp
from ray_dhp.step.optim import build_optimizer_for
from ray_dhp.step.precision import local_nbytes, restore_grad_dtype, round_grads_for_update


class UpdateMixin:
    """Gradients -> clipped update -> stepped optimizers, for `DHPEngine`."""

    # -- optimizers over each module's ZeRO partition (ray_dhp.parallel.zero) -----------------

    def _build_optimizers(self) -> None:
        """AdamW for each module over the parameters this rank updates: all of them at stage 0,
        its ZeRO partition at stages 1-2 (`ray_dhp.parallel.zero`)."""
        from ray_dhp.parallel.zero import ZeroPartition

        g, topo = self.groups, self.groups.topology
        self.zero = {}
        if self.visual is not None:
            v = topo.vision
            named = [(n, p) for n, p in self.visual.named_parameters() if p.requires_grad]
            if self.vision_fsdp is not None:  # stage 3 (ray_dhp.parallel.fsdp_vision)
                z = self.zero["vision"] = self.vision_fsdp
                z.params = [p for _, p in named]
            else:
                self.zero["vision"] = z = ZeroPartition(
                    [p for _, p in named], v.zero_stage, g.vision_all, v.ranks, g.rank - v.offset,
                    leader=g.rank == v.offset)
            self.vision_opt, self.vision_sched, self.vision_masters = build_optimizer_for(
                z.mine(named), self.cfg, self.policy, prefix=self.family.vision_prefix,
                offload=v.offload)
        else:
            self.vision_opt = self.vision_sched = self.vision_masters = None
        self.expert_params = []  # expert parallelism: reduced over EDP, own partition (parallel/expert.py)
        if self.text_model is not None:
            t, (j, k) = topo.text, g.text_coord
            named = [(n, p) for n, p in self.text_model.named_parameters() if p.requires_grad]
            if topo.text_expert_parallel > 1:
                from ray_dhp.parallel.expert import expert_params

                ids = {id(p) for p in expert_params(self.text_model, self.family.moe)}
                experts = [(n, p) for n, p in named if id(p) in ids]
                named = [(n, p) for n, p in named if id(p) not in ids]
                self.expert_params = [p for _, p in experts]
                from ray_dhp.parallel.expert import expert_partition

                self.zero["experts"] = expert_partition(self.expert_params, g)
                experts = self.zero["experts"].mine(experts)
            if self.fsdp is not None:  # stage 3 (ray_dhp.parallel.fsdp)
                z = self.zero["text"] = self.fsdp
                z.params = [p for _, p in named]
            else:
                self.zero["text"] = z = ZeroPartition(
                    [p for _, p in named], t.zero_stage, g.text_dp,
                    [t.rank_at(d, k) for d in range(t.dp)], j, leader=g.rank == t.offset,
                    tp_group=g.text_tp, tp_first=k == 0, late=self._partial)
            self.text_opt, self.text_sched, self.text_masters = build_optimizer_for(
                z.mine(named) + (experts if self.expert_params else []), self.cfg, self.policy,
                offload=t.offload)
        else:
            self.text_opt = self.text_sched = self.text_masters = None
        for z in self.zero.values():
            if hasattr(z, "install_hooks"):  # a ZeroPartition (FSDP2 reduces in its own hooks)
                z.install_hooks()

    def _zero_broadcast(self) -> None:
        for name, z in self.zero.items():
            z.broadcast(self.comm, f"{name}.zero")

    # -- gradients -----------------------------------------------------------------------------

    def _reduce_and_clip(self) -> float:
        """Reduce the gradients over replicas; the global norm (each parameter counted once).
        Every control value lives on ``groups.device`` (valid under NCCL and gloo alike)."""
        g, dev = self.groups, self.groups.device
        up = self._reduce_dtype()
        v_sq = t_sq = torch.zeros((), dtype=torch.float64, device=dev)
        dp.ensure_grads(self.vision_params + self.text_params)
        self.last_grad_bytes = sum(local_nbytes(p.grad) for p in self.vision_params + self.text_params
                                   if p.grad is not None)  # before stage 2 frees the others'
        if g.is_vision:
            self.zero["vision"].reduce(self.comm, "vision.grads", reduce_dtype=up)
            v_sq = self.zero["vision"].norm_share(dev)
        if g.is_text:
            dp.all_reduce_grads(self._partial, g.text_tp, self.comm, "text.partial_grads", reduce_dtype=up)
            self.zero["text"].reduce(self.comm, "text.grads", reduce_dtype=up)
            t_sq = self.zero["text"].norm_share(dev)
            if self.expert_params:  # summed over the replicas holding the same experts only
                from ray_dhp.parallel.expert import reduce_expert_grads

                t_sq = t_sq + reduce_expert_grads(self, up)
        parts = torch.stack([v_sq, t_sq])  # each rank's share; every entry counted once in all
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
        """Clip by ``coef`` and step both optimizers. With fp32 masters (bf16_mixed) the bf16
        gradients are upcast into the masters' gradients, clipped there in fp32, the masters
        stepped, and the bf16 weights refreshed from them."""
        modules = ((self.vision_params, self.vision_opt, self.vision_sched, self.vision_masters),
                   (self.text_params, self.text_opt, self.text_sched, self.text_masters))
        self._release_unowned_grads()
        for params, opt, sched, masters in modules:
            if masters is not None:  # fp32 master gradients one chunk at a time
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
        for p in self.vision_params + self.text_params:  # incl. those another rank updates
            p.grad = None
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
        for masters in (self.vision_masters, self.text_masters):
            if masters is not None:
                masters.masters_to_params()
        topo = self.groups.topology  # the same on every rank: the broadcast is collective
        if self.policy.master or topo.vision.offload or topo.text.offload:
            self._zero_broadcast()

    def state_bytes(self) -> dict:
        """Bytes of model state this rank holds, measured from its tensors
        (`ray_dhp.planning.memory.measure_engine_state`)."""
        from ray_dhp.planning.memory import measure_engine_state

        return measure_engine_state(self)

