"""Single-process reference training: the stock transformers model, no parallelism.

This is what the DHP engine must reproduce (same loss and same parameter update for the same
data, seed and hyper-parameters). It is built from the stock libraries, not from the engine's
helpers, so that parity tests compare the engine with an independent implementation:

* the forward is the model's own (its own vision tower, its own feature scatter);
* LoRA adapters are PEFT's own ``get_peft_model(model, LoraConfig(...))`` with PEFT's default
  initialisation (``lora_A`` Kaiming-uniform with ``a=sqrt(5)``, ``lora_B`` zero); the only
  convention taken from the engine is *which* random numbers: the Kaiming-uniform draw comes
  from a generator seeded by the run seed and the layer name (the engine must give every rank
  the same adapters; PEFT draws from the global RNG), in fp64 and rounded to the weights' dtype;
* modules are told apart by the model's own sub-modules (``model.model.visual``, its
  ``merger`` / ``deepstack_merger_list``; the rest is the language model), frozen with
  ``requires_grad_(False)``;
* the optimizer is a plain ``torch.optim.AdamW`` with one parameter group per trainable
  parameter, its lr and weight decay written out here (per-module values, no decay on tensors
  of fewer than 2 dims);
* under the bf16 policies each micro-batch's bf16 gradients are moved into a plain fp32 sum
  after its backward (``acc = acc + grad.float()``), so they accumulate in fp32 across
  micro-batches; bf16_mixed keeps a plain fp32 copy of every trainable weight: the fp32 sums are
  its gradients, clipped there by ``torch.nn.utils.clip_grad_norm_``, AdamW steps it and the bf16
  weights are rounded from it; bf16 (no copy) rounds the sums to bf16 once for its update.

Shared with the engine (tested on their own, see tests/README.md): the config parsing
(`TrainLoopConfig`, `ray_dhp.config.tuning.tuning_of`: *what* was asked), the batch padding, the
loss normalisation (`ray_dhp.step.loss`) and the lr schedule's factor (`ray_dhp.step.optim.lr_factor`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import zlib
from typing import Optional

import torch

from ray_dhp.data.collate import pad_text_batch
from ray_dhp.models import build_model, family_of, load_model_config
from ray_dhp.step.loss import LossInputs, backward_loss, sample_ids_of
from ray_dhp.step.microbatch import count_targets, shift_labels, upcast
from ray_dhp.step.optim import lr_factor
from ray_dhp.step.precision import policy_of, weight_dtype
from ray_dhp.config.tuning import tuning_of
from ray_dhp.config.sections import OptimConfig, PrecisionConfig

ADAPTER = "default"  # PEFT's default adapter name


class ReferenceTrainer:
    def __init__(self, model, cfg: OptimConfig, device="cpu", dtype=None,
                 precision: Optional[PrecisionConfig] = None):
        self.cfg = cfg  # the run's ``optim`` section
        self.policy = policy_of(precision)  # its ``precision`` section (None: fp32)
        dtype = weight_dtype(self.policy, dtype)
        self.config = load_model_config(model)
        self.model = build_model(model, seed=cfg.seed, dtype=dtype).to(device)
        self.dtype = dtype
        self.device = torch.device(device)
        tuning = tuning_of(cfg)  # what was asked (parsed); how, is written out below
        lora_params = set()
        if tuning.lora is not None:
            lora_params = _add_peft_lora(self.model, tuning.lora, cfg.seed)
        self.model.train()
        trained = []  # (name, parameter, lr, weight decay)
        for name, p, module in _named_by_module(self.model):
            choice = tuning.choice(module)
            trains = (id(p) in lora_params) if module == "llm" and tuning.lora else choice.train
            p.requires_grad_(trains)
            if trains:
                lr = cfg.lr if choice.lr is None else choice.lr
                wd = cfg.weight_decay if choice.weight_decay is None else choice.weight_decay
                trained.append((name, p, lr, wd if p.ndim >= 2 else 0.0))
        self.masters = None  # bf16_mixed: plain fp32 copies, which AdamW steps instead
        if self.policy.master:
            self.masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p, _, _ in trained}
        groups = [{"params": [self.masters[n] if self.masters else p], "lr": lr, "weight_decay": wd}
                  for n, p, lr, wd in trained]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        self._trained = [p for _, p, _, _ in trained]

    def step(self, micro_batches: list, loss_fn=None) -> dict:
        """One optimizer step; ``loss_fn`` as in `DHPEngine.forward_backward` (`ray_dhp.step.loss`),
        here given each whole micro-batch as one replica's rows, with plain logits."""
        n_targets = sum(count_targets(mb) for mb in micro_batches)
        n_samples = sum(len(mb) for mb in micro_batches)
        # A mixture-of-experts LM: the stock model's own load-balancing loss of each micro-batch
        # (its forward with the batch's attention_mask), weighed as in ray_dhp.models.moe.
        spec = family_of(self.config).moe
        aux_coef = self.config.text_config.router_aux_loss_coef if spec and spec.aux_loss else None
        moe = {} if aux_coef is None else {"output_router_logits": True}
        total, sums = 0.0, None
        for mb in micro_batches:
            batch = pad_text_batch(mb, self.config.text_config.pad_token_id or 0)
            kwargs = {k: v.to(self.device) for k, v in batch.items() if v is not None and k != "labels"}
            seconds = kwargs.pop("second_per_grid_ts", None)  # the videos' seconds per patch:
            key = family_of(self.config).video_seconds_key  # absolute-time M-RoPE models only
            if seconds is not None and key in inspect.signature(self.model.forward).parameters:
                kwargs[key] = seconds
            kwargs = family_of(self.config).stock_inputs(self.config, kwargs)
            for key in ("pixel_values", "pixel_values_videos", "input_features"):
                if key in kwargs:
                    kwargs[key] = kwargs[key].to(self.dtype)
            with self._autocast():
                out = self.model(**kwargs, use_cache=False, **moe)
            targets = shift_labels(batch["labels"]).to(self.device)
            inputs = LossInputs(upcast(out.logits), targets, sample_ids_of(batch, mb).to(self.device),
                                list(mb), n_targets, n_samples)
            aux = None if aux_coef is None else out.aux_loss * (aux_coef / len(micro_batches))
            total += float(backward_loss(loss_fn, inputs, tensor_parallel=False, extra=aux))
            sums = self._accumulate_fp32(sums if mb is not micro_batches[0] else None)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        if self.masters is None and sums is not None:  # bf16: clipped in fp32, rounded to bf16 once
            grads = [sums[id(p)] for p in self._trained]
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
            coef = min(1.0, max_norm / (grad_norm + 1e-6))  # clip_grad_norm_'s factor
            for p, g in zip(self._trained, grads):
                p.grad = (g * coef).to(p.dtype)
        elif self.masters is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trained, max_norm))
        else:  # the fp32 sums are the fp32 copies' gradients, the norm and clipping there
            for p, m in zip(self._trained, self.masters.values()):
                m.grad = sums[id(p)]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(list(self.masters.values()), max_norm))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not None:
            with torch.no_grad():
                for p, m in zip(self._trained, self.masters.values()):
                    p.copy_(m)
            self.model.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": grad_norm}

    @torch.no_grad()
    def _accumulate_fp32(self, sums):
        """bf16 weights: add this micro-batch's bf16 gradients into fp32 sums (``sums`` None: the
        first micro-batch) and drop them; fp32 weights: None (``.grad`` accumulates as it is)."""
        if self.dtype != torch.bfloat16:
            return None
        sums = {} if sums is None else sums
        for p in self._trained:
            if p.grad is not None:
                g = p.grad.float()
                sums[id(p)] = g if id(p) not in sums else sums[id(p)] + g
                p.grad = None
            elif id(p) not in sums:
                sums[id(p)] = torch.zeros_like(p, dtype=torch.float32)
        return sums

    def _autocast(self):
        if self.policy.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.policy.autocast_dtype)

    def named_parameters(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def named_masters(self) -> dict:
        """The fp32 master weights (bf16_mixed) by parameter name; {} without masters."""
        return {n: p.detach().clone() for n, p in (self.masters or {}).items()}


def _named_by_module(model) -> list:
    """``(name, parameter, module)`` for every parameter, ``module`` one of "vision" (the
    vision tower), "merger" (its projector: `FamilySpec.merger_prefixes`), another encoder's
    name (e.g. "audio") or "llm" (everything else), told apart by the family's
    vision parts (`FamilySpec.visual`), projector prefixes and encoder modules."""
    family = family_of(model.config)
    visual = family.visual(model)
    by_id = {id(p): family.vision_prefix + n for n, p in visual.named_parameters()}
    merger = {id(p) for p in visual.parameters() if by_id[id(p)].startswith(family.merger_prefixes)}
    tower = set(by_id) - merger
    other = {id(p): e.name for e in family.encoders
             for p in family.encoder_module(e.name, model).parameters()}
    return [(n, p, "merger" if id(p) in merger else "vision" if id(p) in tower
             else other.get(id(p), "llm")) for n, p in model.named_parameters()]


def _add_peft_lora(model, choice, seed: int) -> set:
    """PEFT's adapters on the language model's targeted linears (in place; ``model`` keeps its
    parameter names with PEFT's ``base_layer`` / ``lora_A.default`` / ``lora_B.default``), the
    ``lora_A`` draws re-done per layer name (see the module docstring). Returns the adapter
    parameters' ids."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    language_model = family_of(model.config).language_model(model)
    prefix = next(n for n, m in model.named_modules() if m is language_model)
    names = "|".join(choice.target_modules)
    config = LoraConfig(r=choice.r, lora_alpha=choice.alpha, lora_dropout=0.0,
                        target_modules=rf"{prefix}\.layers\.\d+\.(self_attn|mlp|mlp\.shared_expert)\.({names})")
    get_peft_model(model, config, autocast_adapter_dtype=False)  # wraps; modifies model in place
    ids = set()
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            assert layer.scaling[ADAPTER] == choice.alpha / choice.r and not b.any(), name
            draw = torch.empty(a.shape, dtype=torch.float64)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            torch.nn.init.kaiming_uniform_(draw, a=math.sqrt(5), generator=g)  # PEFT's init of A
            a.copy_(draw)
            ids |= {id(a), id(b)}
    return ids
