"""The DHP training step: vision (Ulysses SP + DP) -> boundary -> text (TP + DP) -> back.

One `DHPEngine` lives on every rank and holds the module shard(s) that rank hosts. `step()` takes
the step's micro-batches (lists of `Sample`) — the same lists on every rank — and is exactly
`forward_backward()` (steps 1-4, with a pluggable loss: `ray_dhp.step.loss`) then `optimizer_step()`
(step 5); both are public for custom train loops (docs/custom_loop.md):

1. plans, identically on every rank, which vision replica / text replica gets which samples and
   which SP rank computes which feature rows (`layout_micro_batch`; samples shared out by cost,
   `ray_dhp.parallel.balance`);
2. runs the vision forward on local tokens; hands the rows to the text layout (`boundary`);
3. runs the text forward/backward with the loss normalised by the step's global token count
   (or the given ``loss_fn``);
4. returns the feature gradients (exact adjoint) and back-propagates the vision tower;
5. reduces gradients (SUM over SP and DP, see `parallel/data_parallel.py`), clips by the global norm
   counted once over both modules, and steps both optimizers.

For identical data, seed and hyper-parameters the update equals the single-process one
(`ray_dhp.step.reference`), which the tests assert for every layout.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.mesh import DHPGroups
from ray_dhp.step.microbatch import (  # noqa: F401  (re-exported: ray_dhp.step.engine.layout_micro_batch ...)
    MicroBatchLayout, PhaseTimer, _MicroBatch, balancer_for, count_targets, layout_micro_batch,
    shift_labels, upcast)
from ray_dhp.models import family_of, load_model_config
from ray_dhp.models.contract import check_transformers
from ray_dhp.models.loading import build_meta_model, materialize
from ray_dhp.models.tuning import apply_tuning
from ray_dhp.step.gpu import apply_tf32
from ray_dhp.step.precision import accumulate_in_fp32, policy_of, weight_dtype
from ray_dhp.step.schedule import order_for
from ray_dhp.parallel import boundary as bnd
from ray_dhp.parallel import data_parallel as dp
from ray_dhp.parallel.balance import Balancer
from ray_dhp.parallel.comm import CommCounter
from ray_dhp.parallel.fsdp import reduce_dtype_of, shard_text
from ray_dhp.parallel.tensor import apply_tp_plan, partial_grad_params
from ray_dhp.config.tuning import tuning_of
from ray_dhp.step.encoders import EncoderPhases
from ray_dhp.step.text import TextPhase
from ray_dhp.step.updates import UpdateMixin


class DHPEngine(EncoderPhases, TextPhase, UpdateMixin):
    """Holds this rank's shard(s) of the model and runs exact DHP training steps.

    ``cfg``: what the engine reads of the run's configuration (`ray_dhp.config.views.StepConfig`:
    the ``optim`` and ``precision`` sections and the text rows' ``packing`` / ``max_tokens``; from the tree,
    ``TrainLoopConfig.step_config()``); it hands each part its own.
    """

    def __init__(self, model, groups: DHPGroups, cfg,
                 comm: Optional[CommCounter] = None, dtype: Optional[torch.dtype] = None,
                 schedule: str = "sequential", init: str = "source"):
        if init not in ("source", "checkpoint"):
            raise ValueError(f"init must be 'source' or 'checkpoint', got {init!r}")
        self.policy = policy_of(cfg.precision)
        dtype = weight_dtype(self.policy, dtype)
        self.source_model = str(model) if isinstance(model, (str, os.PathLike)) else None
        self.groups, self.cfg, self.comm, self.dtype = groups, cfg, comm, dtype
        apply_tf32(cfg.precision.tf32, groups.device)
        self.schedule = schedule  # the layout was checked against the model by DHPConfig
        self.config = load_model_config(model)
        self.family = family_of(self.config)
        check_transformers(self.family)  # this worker's transformers, not the driver's
        topo = groups.topology
        self._build_shards(model, dtype, fill=init == "source")
        if topo.text.cp > 1 and self.text_model is not None:  # Ulysses CP around the LM's attention
            from ray_dhp.parallel.context import install_context_parallel

            install_context_parallel(self.family.language_model(self.text_model), groups.text_cp,
                                     topo.text.cp, groups.text_cp_rank, self.comm,
                                     self.family.cp_mixers(self.config.text_config)
                                     if self.family.stateful_mixers else (), topo.text.inner,
                                     packed=cfg.packing)
        self.tuning = tuning_of(cfg.optim)  # per-module choices: frozen parameters are left out below
        if self.tuning.lora is not None and self.text_model is not None:  # PEFT LoRA, TP-exact
            from ray_dhp.models.lora import add_lora

            tp = topo.text.inner > 1
            add_lora(self.text_model, self.tuning.lora, cfg.optim.seed, groups.text_mesh["tp"] if tp else None,
                     self.family.text_tp_plan(self.config.text_config) if tp else None)
        if cfg.packing and self.family.stateful_mixers and self.text_model is not None \
                and topo.text.cp == 1:  # under CP the head-sharded mixers take the segments
            from ray_dhp.models.segments import install_segment_rows  # after TP and LoRA

            install_segment_rows(self.family.language_model(self.text_model), self.family.stateful_mixers,
                                 required=True)  # this engine's text forwards are all packed
        self._segment_attention = False  # packed rows' attention per sample (no varlen kernel)
        if cfg.packing and topo.text.cp == 1 and self.text_model is not None:
            from ray_dhp.models.segment_attention import install_segment_attention

            self._segment_attention = not install_segment_attention(
                self.family.language_model(self.text_model), self.family.segment_attention)
        self.sharding = self._shard_stage3()  # module name -> its ZeRO-3 (FSDP2) sharding
        specs = self.family.encoder_specs
        unhosted = tuple(e.prefix for e in specs if topo.encoder(e.name) is None) \
            + tuple(e.prefix + u for e in specs for u in e.unused)
        held = apply_tuning({**{(n, self.family.encoder_prefix(n)): m for n, m in self.shards.items()},
                             ("text", ""): self.text_model}, self.tuning, unhosted)
        self.params, self.frozen_params = held  # module name -> its trainable parameters
        self._partial = (partial_grad_params(self.text_model, self.family.tp_partial_grad_suffixes)
                         if self.text_model is not None and topo.text.inner > 1 else [])
        self._build_optimizers()  # over each module's ZeRO partition (step/updates.py)
        self._router_loss = None  # mixture-of-experts LM: the load-balancing loss (models/moe.py)
        if self.family.moe is not None and self.family.moe.aux_loss and self.text_model is not None:
            from ray_dhp.models.moe import RouterLoss

            self._router_loss = RouterLoss(self.family.language_model(self.text_model), self.family.moe,
                                           self.config.text_config, groups.text_dp)
        # bf16 policies: micro-batch gradients sum in fp32 (at stage 3: FSDP2's shards)
        accumulate_in_fp32([p for n, ps in self.params.items() if n not in self.sharding for p in ps],
                           self.policy)
        if self.policy.grad_dtype != self.policy.param_dtype:
            for sharded in self.sharding.values():
                sharded.accumulate_in(self.policy.grad_dtype)
        self.feature_dims = {m.name: self.family.encoder_dim(m.name, self.config) for m in topo.encoders}
        self.step_count = 0
        self._timer = PhaseTimer(groups.device)
        self._loss_fn, self._num_samples = None, 0  # set by forward_backward for its phases
        self._overlap = False  # forward_backward(last=True): reduce during the last backward

    def _build_shards(self, model, dtype: torch.dtype, fill: bool = True) -> None:
        """Build the model on the meta device, keep the modules this rank hosts (TP-sharded on
        meta), then materialise only those, filled from the directory or the seed's init
        (identical to the reference's); ``fill=False`` (``init="checkpoint"``): allocated only,
        for a checkpoint load to fill; see `ray_dhp.models.loading`."""
        g, topo = self.groups, self.groups.topology
        meta = build_meta_model(model, seed=self.cfg.optim.seed, dtype=dtype)
        full = meta.module
        full.train()
        if self.cfg.optim.activation_checkpointing:  # recompute every vision and text block in backward
            full.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.shards, self.text_model, parts = {}, None, {}
        for m in topo.encoders:  # each encoder this rank hosts
            if g.hosts(m.name):
                self.shards[m.name] = self.family.encoder_module(m.name, full)
                parts.update(self.family.encoder_parts(m.name, full))
        if g.is_text:
            for m in topo.encoders:  # the text shard holds no encoder (rows come through
                self.family.drop_encoder(m.name, full)  # the boundary)
            self.text_model = parts[""] = full
            if topo.text.inner > 1:
                apply_tp_plan(full, g.text_mesh["tp"], self._text_plan(full))
            if topo.text_expert_parallel > 1:  # experts Shard(0) over the EP ranks
                from ray_dhp.parallel.expert import shard_experts

                shard_experts(full, self.family.moe, g.text_ep_mesh, self.comm)
            if topo.text_expert_tp:  # experts' intermediate dim over TP (parallel/expert_tp.py)
                from ray_dhp.parallel.expert_tp import shard_experts_tp

                shard_experts_tp(full, self.family.moe, g.text_mesh["tp"], self.comm)
        materialize(meta, parts, g.device, fill=fill)

    def _shard_stage3(self) -> dict:
        """ZeRO stage 3 of every module this rank hosts at that stage: the LM over its text dp
        ranks (`ray_dhp.parallel.fsdp.shard_text`), an encoder over its whole group (its
        operations' ``shard``, e.g. `ray_dhp.models.fsdp_vision`). After the TP plan and LoRA,
        before the parameter lists are taken (``fully_shard`` replaces the parameters with their
        sharded DTensors). ``{module name: sharding}``; a module at stages 0-2 has none."""
        g, topo, out = self.groups, self.groups.topology, {}
        reduce_dtype = reduce_dtype_of(self.policy, self.dtype)
        if self.text_model is not None and topo.text.zero_stage == 3:
            out["text"] = shard_text(self.text_model, self.family, g.text_mesh["dp"], reduce_dtype,
                                     tp_first=g.text_coord[1] == 0)
        for m in topo.encoders:
            if m.name in self.shards and m.zero_stage == 3:
                ops = self.family.encoder_spec(m.name).operations()
                out[m.name] = ops.shard(self.family, self.shards[m.name], g.encoders[m.name].mesh,
                                        reduce_dtype, self.dtype, g.device)
        return out

    # -- one step ------------------------------------------------------------------------------

    def step(self, micro_batches: list) -> dict:
        """One optimizer step over ``micro_batches`` (list of lists of `Sample`): exactly
        `forward_backward` (default loss) then `optimizer_step`."""
        out = self.forward_backward(micro_batches, last=True)
        out.update(self.optimizer_step())
        return out

    def forward_backward(self, micro_batches: list, loss_fn=None, *, last: bool = False) -> dict:
        """Forward and backward over ``micro_batches`` (the same lists on every rank): gradients
        accumulate in the parameters until `optimizer_step`. ``loss_fn(LossInputs) -> scalar``
        (default `ray_dhp.step.loss.cross_entropy_loss`; contract in `ray_dhp.step.loss`). Collective on
        every rank; returns ``loss`` (the sum of the loss_fn values over micro-batches and text
        replicas, the same on every rank), ``num_targets`` and ``num_samples``. ``last=True``: no
        other call before `optimizer_step`; reductions start in the last backward (`ZeroPartition.arm`)."""
        n_targets = sum(count_targets(mb) for mb in micro_batches)
        if n_targets == 0:
            raise ValueError("the step has no trainable tokens (all labels are -100)")
        self._loss_fn, self._num_samples = loss_fn, sum(len(mb) for mb in micro_batches)
        states = self._states = [_MicroBatch(mb) for mb in micro_batches]
        for state in states:  # known before any phase runs (`_last_with`)
            self._note_inputs(state)
        self._overlap = last
        self._inflight = bnd.InFlight()  # boundary sends not yet waited for
        for phase, k in order_for(self.schedule, len(states)):
            with self._timer(phase):
                getattr(self, "_" + phase)(states[k], n_targets)
        with self._timer("optimizer"):  # as before the split: the boundary's last sends
            self._inflight.wait()
        for m in self.groups.topology.encoders:  # which encoders step (`_trains_this_step`)
            self._had_input[m.name] = self._had_input.get(m.name, False) or any(
                s.inputs[m.name] for s in states)
        leader = self._is_text_leader_of_replica()
        loss = sum(s.loss_sum for s in states) if leader else 0.0
        router = self._router_loss
        aux = float(router.aux_sum) if router is not None and leader else 0.0
        # Control values travel on the training device: NCCL refuses CPU tensors.
        stats = torch.tensor([float(loss), aux], dtype=torch.float64, device=self.groups.device)
        dist.all_reduce(stats)
        out = {"loss": stats[0].item(), "num_targets": n_targets, "num_samples": self._num_samples}
        if self.family.moe is not None:  # the step's load-balancing loss (mean over micro-batches)
            out["aux_loss"] = stats[1].item()
            if router is not None:
                out["expert_load_max_over_mean"] = float(router.load_ratio)
                router.reset()
        return out

    def optimizer_step(self) -> dict:
        """Reduce the accumulated gradients over replicas, clip by the global norm, step both
        optimizers and schedulers, zero the gradients (collective on every rank). Returns
        ``grad_norm`` (before clipping), ``lr`` (the rate this step used) and the ``time_*_s``
        of the phases since the previous optimizer step."""
        lr = self.current_lr()  # the rate this step trains with (the scheduler steps below)
        with self._timer("optimizer"):
            grad_norm = self._reduce_and_clip()
            self._optimizer_step(dp.clip_coefficient(grad_norm, self.cfg.optim.max_grad_norm))
        self.step_count += 1
        times, self._timer = self._timer.as_metrics(), PhaseTimer(self.groups.device)
        return {"grad_norm": grad_norm, "lr": lr, **times}

    def evaluate(self, batches) -> dict:
        """The loss over ``batches`` (an iterable of micro-batch lists) with the current weights,
        forward only: no gradient, no optimizer/scheduler/RNG effect (`ray_dhp.step.evaluation`)."""
        from ray_dhp.step.evaluation import evaluate

        return evaluate(self, batches)

    # -- the four phases of a micro-batch (see ray_dhp.step.schedule): the encoders' phases
    # (_vision_fwd, _send_features, _return_grads) are `EncoderPhases`'; the LM's
    # (_text_fwd_bwd) is `TextPhase`'s (ray_dhp.step.text)

    def balancer(self) -> Balancer:
        """The run's `Balancer` (``cfg.optim.balance``), built on first use from the model config."""
        if getattr(self, "_balancer", None) is None:
            self._balancer = balancer_for(self.cfg.optim.balance, self.config, packing=self.cfg.packing,
                                          max_tokens=self.cfg.max_tokens)
        return self._balancer

    def _text_plan(self, full) -> dict:
        """The family's TP plan; with text sequence parallelism its SP variant (and the deepstack
        seam of families that add vision features between decoder layers)."""
        tc = self.config.text_config
        if not self.groups.topology.text_sequence_parallel:
            return self.family.text_tp_plan(tc)
        from ray_dhp.parallel.text_sp import install_deepstack_shard

        if self.family.num_deepstack(self.config):
            install_deepstack_shard(self.family.language_model(full), self.groups.text_tp, self.comm)
        return self.family.text_sp_plan(tc)

    @property
    def visual(self):
        """This rank's vision shard (None if it hosts none)."""
        return self.shards.get("vision")

    def _autocast(self):
        import contextlib

        if self.policy.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.groups.device.type, dtype=self.policy.autocast_dtype)

    # -- helpers -------------------------------------------------------------------------------

    def _is_text_leader_of_replica(self) -> bool:
        c = self.groups.text_coord
        return c is not None and c[1] == 0

    def current_lr(self) -> float:
        from ray_dhp.step.optim import lr_factor

        return self.cfg.optim.lr * lr_factor(self.step_count, self.cfg.optim)  # the base lr (per-module: x ratio)

    def named_full_parameters(self) -> dict:
        """Full (unsharded) parameters this rank hosts, by the model's own names (collective on the
        ranks of a TP or stage-3 module)."""
        out = {}
        for name, module in self.shards.items():
            prefix = self.family.encoder_prefix(name)
            out.update({f"{prefix}{n}": (p.full_tensor() if _is_dtensor(p) else p).detach().clone()
                        for n, p in module.named_parameters()})
        if self.text_model is not None:
            for n, p in self.text_model.named_parameters():
                out[n] = (p.full_tensor() if _is_dtensor(p) else p).detach().clone()
        return out



def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
