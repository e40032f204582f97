"""The update half of `ray_dhp.step.engine.DHPEngine` (step 5 of its docstring): gradient
reduction over the replicas, the global norm counted once over both modules, clipping, both
optimizers (fp32 masters under ``bf16_mixed``) and ZeRO-1 for the vision group.

`UpdateMixin` holds no state of its own: it works on the engine's ``groups``, ``cfg``, ``policy``,
``comm``, parameter lists, optimizers and masters, which `DHPEngine.__init__` sets up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_dhp.parallel import data as dp
from ray_dhp.parallel.comm import record
from ray_dhp.step.optim import build_optimizer_for, zero1_owners
from ray_dhp.step.precision import local_nbytes


class UpdateMixin:
    """Gradients -> clipped update -> stepped optimizers, for `DHPEngine`."""

    # -- ZeRO-1 for the vision group -----------------------------------------------------------

    def _build_vision_optimizer(self) -> None:
        """AdamW for the vision tower; with ``vision_zero1`` each vision rank keeps the optimizer
        state of its share of the parameters only (ZeRO stage 1): every rank still all-reduces all
        gradients (they are needed for the global norm anyway), only the owner updates a
        parameter, and the new values are broadcast from the owners after the step. Plain AdamW
        over a subset keeps DCP checkpointing by parameter name working unchanged."""
        self._owners = None
        named = [(n, p) for n, p in self.visual.named_parameters()
                 if p.requires_grad] if self.visual is not None else []
        v = self.groups.topology.vision
        if named and self.cfg.vision_zero1 and v.size > 1:
            self._owners = zero1_owners([p.numel() for _, p in named], v.size)
            me = self.groups.rank - v.offset
            named = [(n, p) for (n, p), o in zip(named, self._owners) if o == me]
        self.vision_opt, self.vision_sched, self.vision_masters = build_optimizer_for(
            named, self.cfg, self.policy, prefix="model.visual.")

    def _zero1_broadcast(self) -> None:
        if self._owners is None:
            return
        v = self.groups.topology.vision
        for owner in range(v.size):
            params = [p for p, o in zip(self.vision_params, self._owners) if o == owner]
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=v.offset + owner, group=self.groups.vision_all)
            record(self.comm, "broadcast", "vision.zero1", flat)
            off = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()

    # -- gradients -----------------------------------------------------------------------------

    def _reduce_and_clip(self) -> float:
        """Reduce the gradients over replicas; the global norm (each parameter counted once).
        Every control value lives on ``groups.device`` (valid under NCCL and gloo alike)."""
        g, dev = self.groups, self.groups.device
        up = torch.float32 if self.dtype in (torch.bfloat16, torch.float16) else None
        v_sq = t_sq = torch.zeros((), dtype=torch.float64, device=dev)
        if g.is_vision:
            params = dp.ensure_grads(self.vision_params)
            dp.all_reduce_grads(params, g.vision_all, self.comm, "vision.grads", reduce_dtype=up)
            v_sq = dp.squared_norm(params, device=dev)
        if g.is_text:
            params = dp.ensure_grads(self.text_params)
            dp.all_reduce_grads(self._partial, g.text_tp, self.comm, "text.partial_grads", reduce_dtype=up)
            dp.all_reduce_grads(params, g.text_dp, self.comm, "text.grads", reduce_dtype=up)
            t_sq = dp.squared_norm(params, g.text_tp, device=dev)
        topo = g.topology
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        parts = torch.stack([v_sq if g.rank == topo.vision.offset else zero,
                             t_sq if g.rank == topo.text.offset else zero])
        dist.all_reduce(parts)
        return float(parts.sum().sqrt())

    def _optimizer_step(self, coef: float) -> None:
        """Clip by ``coef`` and step both optimizers. With fp32 masters (bf16_mixed) the bf16
        gradients are upcast into the masters' gradients, clipped there in fp32, the masters
        stepped, and the bf16 weights refreshed from them."""
        modules = ((self.vision_params, self.vision_opt, self.vision_sched, self.vision_masters),
                   (self.text_params, self.text_opt, self.text_sched, self.text_masters))
        self.last_grad_bytes = sum(local_nbytes(p.grad) for p in self.vision_params + self.text_params
                                   if p.grad is not None)
        self._release_unowned_grads()
        for params, opt, sched, masters in modules:
            if masters is not None:  # fp32 master gradients one chunk at a time
                masters.step(opt, coef)
            else:
                dp.scale_grads(params, coef)
                if opt is not None:
                    opt.step()
            if opt is not None:
                sched.step()
        for p in self.vision_params + self.text_params:  # incl. those another rank updates
            p.grad = None
        self._zero1_broadcast()

    def _release_unowned_grads(self) -> None:
        """Free the gradients of the ViT parameters another rank updates (ZeRO-1): reduced and
        counted in the norm already, not needed by this rank's update."""
        if self._owners is None:
            return
        me = self.groups.rank - self.groups.topology.vision.offset
        for p, o in zip(self.vision_params, self._owners):
            if o != me:
                p.grad = None

    def params_from_masters(self) -> None:
        """After loading masters (a checkpoint): round them into the weights, and share the
        ZeRO-1 owners' values with the other vision ranks (collective on vision ranks)."""
        for masters in (self.vision_masters, self.text_masters):
            if masters is not None:
                masters.masters_to_params()
        if self.policy.master:  # same on every rank: the broadcast is collective
            self._zero1_broadcast()

    def state_bytes(self) -> dict:
        """Bytes of model state this rank holds, measured from its tensors
        (`ray_dhp.planning.memory.measure_engine_state`)."""
        from ray_dhp.planning.memory import measure_engine_state

        return measure_engine_state(self)
