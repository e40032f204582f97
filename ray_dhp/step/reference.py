"""Single-process reference training: the stock transformers model, no parallelism.

This is what the DHP engine must reproduce (same loss and same parameter update for the same
data, seed and hyper-parameters). It shares only the loss normalisation, optimizer and schedule
code with the engine; the forward is the model's own (its own vision tower, its own feature
scatter), so the tests also check our vision drivers and boundary against transformers.
"""

from __future__ import annotations

import torch

from ray_dhp.data.collate import pad_text_batch
from ray_dhp.step.engine import count_targets, shift_labels, upcast
from ray_dhp.step.loss import LossInputs, backward_loss, sample_ids_of
from ray_dhp.models import build_model, load_model_config
from ray_dhp.step.optim import build_optimizer_for
from ray_dhp.parallel.data import clip_coefficient
from ray_dhp.step.precision import policy_of, weight_dtype
from ray_dhp.train.loop_config import TrainLoopConfig
from ray_dhp.step.tuning import freeze, tuning_of


class ReferenceTrainer:
    def __init__(self, model, cfg: TrainLoopConfig, device="cpu", dtype=None):
        self.cfg = cfg
        self.policy = policy_of(cfg)
        dtype = weight_dtype(self.policy, dtype)
        self.config = load_model_config(model)
        self.model = build_model(model, seed=cfg.seed, dtype=dtype).to(device)
        self.dtype = dtype
        self.model.train()
        tuning = tuning_of(cfg)  # per-module choices (ray_dhp.step.tuning), PEFT LoRA adapters
        if tuning.lora is not None:
            from ray_dhp.models.lora import add_lora

            add_lora(self.model, tuning.lora, cfg.seed)
        freeze(self.model, tuning)
        self.device = torch.device(device)
        self.opt, self.sched, self.masters = build_optimizer_for(
            self.model.named_parameters(), cfg, self.policy)

    def step(self, micro_batches: list, loss_fn=None) -> dict:
        """One optimizer step; ``loss_fn`` as in `DHPEngine.forward_backward` (`ray_dhp.step.loss`),
        here given each whole micro-batch as one replica's rows, with plain logits."""
        n_targets = sum(count_targets(mb) for mb in micro_batches)
        n_samples = sum(len(mb) for mb in micro_batches)
        total = 0.0
        for mb in micro_batches:
            batch = pad_text_batch(mb, self.config.text_config.pad_token_id or 0)
            kwargs = {k: v.to(self.device) for k, v in batch.items() if v is not None and k != "labels"}
            if "pixel_values" in kwargs:
                kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
            with self._autocast():
                out = self.model(**kwargs, use_cache=False)
            targets = shift_labels(batch["labels"]).to(self.device)
            inputs = LossInputs(upcast(out.logits), targets, sample_ids_of(batch, mb).to(self.device),
                                list(mb), n_targets, n_samples)
            total += float(backward_loss(loss_fn, inputs, tensor_parallel=False))
        if self.masters is None:
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        else:  # bf16 gradients: the norm in fp64, the clipping in the fp32 masters' gradients
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(sum(g.double().pow(2).sum() for g in grads).sqrt())
            self.masters.grads_to_masters(clip_coefficient(grad_norm, self.cfg.max_grad_norm))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.masters_to_params()
            self.model.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": grad_norm}

    def _autocast(self):
        import contextlib

        if self.policy.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.policy.autocast_dtype)

    def named_parameters(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def named_masters(self) -> dict:
        """The fp32 master weights (bf16_mixed) by parameter name; {} without masters."""
        if self.masters is None:
            return {}
        return {n: p.detach().clone() for n, p in self.masters.named_parameters()}
