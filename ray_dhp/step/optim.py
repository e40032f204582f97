"""Optimizer and learning-rate schedule (the same code for the sharded engine and the reference)."""

from __future__ import annotations

import math

import torch

from ray_dhp.config.sections import OptimConfig
from ray_dhp.config.tuning import tuning_of
from ray_dhp.models.tuning import hyper


def param_groups(named_params, weight_decay: float, lr: float = None, tuning=None,
                 prefix: str = "") -> list:
    """AdamW groups: no decay on norms and biases (parameters with fewer than 2 dims); with a
    `ray_dhp.config.tuning.Tuning`, one group per module's (lr, weight decay) (parameter names are
    ``prefix + name`` in the full model). Decayed groups come first, then the others, in the
    order their first parameter appears (one group of each without per-module choices)."""
    decay, no_decay = {}, {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        p_lr, p_wd = (lr, weight_decay) if tuning is None else hyper(tuning, prefix + name, lr, weight_decay)
        if p.ndim >= 2:
            decay.setdefault((p_lr, p_wd), []).append(p)
        else:
            no_decay.setdefault((p_lr, 0.0), []).append(p)
    groups = []
    for table in (decay, no_decay):
        for (g_lr, g_wd), params in table.items():
            group = {"params": params, "weight_decay": g_wd}
            if g_lr is not None and g_lr != lr:
                group["lr"] = g_lr
            groups.append(group)
    return groups


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warmup, then decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(1, cfg.num_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# Devices whose AdamW is the fused kernel (one launch per step, no temporaries); elsewhere the
# single-tensor loop (CPU: the numerics every test and the documented demo output were made with).
FUSED_DEVICES = ("cuda",)


def adamw_impl(params: list) -> dict:
    """AdamW's implementation keywords for ``params``: on CUDA ``fused=True`` (``foreach=True``
    for DTensor parameters, which torch's fused kernel refuses: its step counters are plain
    tensors), ``foreach=False`` elsewhere."""
    from torch.distributed.tensor import DTensor

    if params[0].device.type not in FUSED_DEVICES:
        return {"foreach": False}
    return {"foreach": True} if any(isinstance(p, DTensor) for p in params) else {"fused": True}


def build_optimizer(named_params, cfg: OptimConfig, prefix: str = "", host: bool = False):
    """AdamW + LambdaLR for one module's parameters (None if it has none); per-module lr and
    weight decay from ``cfg.modules`` (`ray_dhp.config.tuning`), names taken as ``prefix + name``;
    ``host``: the host AdamW of `ray_dhp.step.offload.host_adamw`."""
    tuning = tuning_of(cfg)
    groups = param_groups(named_params, cfg.weight_decay, cfg.lr,
                          None if tuning.default else tuning, prefix)
    if not groups:
        return None, None
    if host:
        from ray_dhp.step.offload import host_adamw

        opt = host_adamw(groups, cfg)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                **adamw_impl([p for g in groups for p in g["params"]]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched


def build_optimizer_for(named_params, cfg: OptimConfig, policy, prefix: str = "",
                        offload: bool = False):
    """(optimizer, scheduler, masters) for one module under the `PrecisionPolicy` ``policy``.

    With ``policy.master`` (bf16_mixed) the optimizer steps fp32 copies of the trainable
    parameters (`ray_dhp.step.precision.MasterWeights`, same names), so its moments are fp32 too;
    with ``offload`` it steps host copies (fp32 masters, or copies in the parameters' dtype;
    `ray_dhp.step.offload`); otherwise it steps the parameters themselves (its moments take
    their dtype) and ``masters`` is None.
    """
    from ray_dhp.step.offload import HOST
    from ray_dhp.step.precision import MasterWeights

    named = [(n, p) for n, p in named_params if p.requires_grad]
    masters = None
    if named and (policy.master or offload):
        masters = MasterWeights(named, dtype=torch.float32 if policy.master else None,
                                device=HOST if offload else None)
    opt, sched = build_optimizer(masters.named_parameters() if masters else named, cfg, prefix,
                                 host=offload)
    return opt, sched, masters

