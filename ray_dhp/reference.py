"""Single-process reference training: the stock transformers model, no parallelism.

This is what the DHP engine must reproduce (same loss and same parameter update for the same
data, seed and hyper-parameters). It shares only the loss normalisation, optimizer and schedule
code with the engine; the forward is the model's own (its own vision tower, its own feature
scatter), so the tests also check our vision drivers and boundary against transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ray_dhp.data.collate import pad_text_batch
from ray_dhp.engine import count_targets, shift_labels, upcast
from ray_dhp.models import build_model, load_model_config
from ray_dhp.optim import build_optimizer
from ray_dhp.train_config import TrainLoopConfig


class ReferenceTrainer:
    def __init__(self, model, cfg: TrainLoopConfig, device="cpu", dtype=torch.float32):
        self.cfg = cfg
        self.config = load_model_config(model)
        self.model = build_model(model, seed=cfg.seed, dtype=dtype).to(device)
        self.dtype = dtype
        self.model.train()
        self.device = torch.device(device)
        self.opt, self.sched = build_optimizer(self.model.named_parameters(), cfg)

    def step(self, micro_batches: list) -> dict:
        n_targets = sum(count_targets(mb) for mb in micro_batches)
        total = 0.0
        for mb in micro_batches:
            batch = pad_text_batch(mb, self.config.text_config.pad_token_id or 0)
            kwargs = {k: v.to(self.device) for k, v in batch.items() if v is not None and k != "labels"}
            if "pixel_values" in kwargs:
                kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
            out = self.model(**kwargs, use_cache=False)
            targets = shift_labels(batch["labels"]).to(self.device)
            loss_sum = F.cross_entropy(upcast(out.logits).flatten(0, 1), targets.flatten(),
                                       ignore_index=-100, reduction="sum")
            (loss_sum / n_targets).backward()
            total += loss_sum.item()
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": total / n_targets, "grad_norm": float(grad_norm)}

    def named_parameters(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
