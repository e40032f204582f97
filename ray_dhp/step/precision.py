"""Precision policies: which dtype the weights, gradients and optimizer state of a rank have.

One setting (``train_loop_config["precision"]``, run file ``optim.precision``) drives the
engine, the single-process reference, `ray-dhp plan`'s memory estimate and the checkpoint:

==================  =========  ==========  ============  ===========  ====================
policy              weights    gradients   fp32 master   AdamW state  bytes / parameter
==================  =========  ==========  ============  ===========  ====================
``fp32``            fp32       fp32        --            fp32         4 + 4 + 8 = 16
``bf16_autocast``   fp32       fp32        --            fp32         16 (matmuls in bf16)
``bf16_mixed``      bf16       bf16        fp32          fp32         2 + 2 + 4 + 8 = 16
``bf16``            bf16       bf16        --            bf16         2 + 2 + 4 = 8
==================  =========  ==========  ============  ===========  ====================

``bf16_mixed`` keeps an fp32 master copy of every parameter the rank updates; AdamW steps the
masters and the bf16 weights are refreshed from them after every step. Gradients are stored in
bf16 (the weights' dtype); they are summed over replicas in fp32 (each all-reduce bucket is
upcast, summed, and rounded to bf16 once), then upcast into the masters' gradients, where the
clipping factor is applied in fp32. The total is the same 16 bytes per parameter as fp32, but
the weights the forward/backward reads, the activations and the gradients are half the size,
and with vision ZeRO-1 the 12 master + moment bytes of a ViT parameter live on one rank only.
Checkpoints store the masters (``model.<name>`` in fp32), so resuming is exact. ``bf16`` (no
masters) halves the state but loses updates smaller than a bf16 ulp of the weight; it is the
cheapest and the least accurate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

POLICY_NAMES = ("fp32", "bf16_autocast", "bf16_mixed", "bf16")
# fp32 master gradients made and stepped per chunk of about this many bytes (`MasterWeights.step`)
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of one policy and the bytes they cost per parameter (see the module table)."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: Optional[torch.dtype]
    master: bool          # an fp32 master copy that the optimizer steps
    moment_dtype: torch.dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are summed in across replicas (fp32 for bf16 gradients)."""
        return torch.float32 if self.param_dtype == torch.bfloat16 else self.param_dtype

    def weight_bytes(self) -> int:
        return _size(self.param_dtype)

    def grad_bytes(self) -> int:
        return _size(self.grad_dtype)

    def optimizer_bytes(self) -> int:
        """Bytes per parameter held only by the rank that updates it: master + two moments."""
        return (4 if self.master else 0) + 2 * _size(self.moment_dtype)

    def state_bytes(self) -> int:
        """Weights + gradients + master + moments per parameter (no ZeRO)."""
        return self.weight_bytes() + self.grad_bytes() + self.optimizer_bytes()

    def describe(self) -> str:
        parts = [f"{_short(self.param_dtype)} weights", f"{_short(self.grad_dtype)} grads"]
        if self.master:
            parts.append("fp32 masters")
        parts.append(f"{_short(self.moment_dtype)} AdamW moments")
        if self.autocast_dtype is not None:
            parts.append(f"{_short(self.autocast_dtype)} autocast")
        return f"{self.name} ({', '.join(parts)}: {self.state_bytes()} B/param)"


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64",
            torch.float16: "fp16"}.get(dtype, str(dtype))


POLICIES = {
    "fp32": PrecisionPolicy("fp32", torch.float32, None, False, torch.float32),
    "bf16_autocast": PrecisionPolicy("bf16_autocast", torch.float32, torch.bfloat16, False, torch.float32),
    "bf16_mixed": PrecisionPolicy("bf16_mixed", torch.bfloat16, None, True, torch.float32),
    "bf16": PrecisionPolicy("bf16", torch.bfloat16, None, False, torch.bfloat16),
}


def policy_of(cfg) -> PrecisionPolicy:
    """The `PrecisionPolicy` of a `TrainLoopConfig` (or anything with a ``precision`` key; None:
    fp32)."""
    name = getattr(cfg, "precision", None) or "fp32"
    if name not in POLICIES:
        raise ValueError(f"precision must be one of {POLICY_NAMES}, got {name!r}")
    return POLICIES[name]


def weight_dtype(policy: PrecisionPolicy, dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The weights' dtype: the policy's, or an explicit ``dtype`` for the fp32 policies (the
    fp64 equivalence tests run the fp32 policies in fp64)."""
    if dtype is None or dtype == policy.param_dtype:
        return policy.param_dtype
    if policy.param_dtype != torch.float32:
        raise ValueError(f"precision={policy.name!r} holds {policy.param_dtype} weights; "
                         f"dtype={dtype} is only for the fp32 policies")
    return dtype


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (the local shard of a DTensor)."""
    from ray_dhp.parallel.tensor import local

    t = local(t)
    return t.numel() * t.element_size()


# -- fp32 master weights ------------------------------------------------------------------------

def _master_of(p: torch.Tensor, dtype=torch.float32, device=None) -> torch.nn.Parameter:
    """A copy of ``p`` in ``dtype`` (None: its own) on ``device`` (None: its own)."""
    return torch.nn.Parameter(p.detach().to(device=device or p.device, dtype=dtype or p.dtype,
                                            copy=True), requires_grad=True)


class MasterWeights:
    """fp32 masters of some (bf16) parameters, held in a module that mirrors their names.

    The mirror module (`module`) has the model's own parameter names, so the optimizer built on
    it and its state dict (`get_optimizer_state_dict(module, opt)`) are keyed like the model's,
    and DCP checkpoints of masters reshard like the parameters (DTensor masters stay DTensors
    with the same placements).
    """

    def __init__(self, named_params, dtype=torch.float32, device=None):
        """``dtype``/``device`` of the copies (None: the parameter's; host optimizer offload,
        `ray_dhp.step.offload`, gives the host and, without fp32 masters, no dtype)."""
        self.module = torch.nn.Module()
        self.pairs = []  # (model parameter, master)
        for name, p in named_params:
            *path, leaf = name.split(".")
            owner = self.module
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            master = _master_of(p, dtype, device)
            owner.register_parameter(leaf, master)
            self.pairs.append((p, master))

    def named_parameters(self):
        return self.module.named_parameters()

    @torch.no_grad()
    def step(self, opt, coef: float = 1.0, chunk_bytes: Optional[int] = None) -> None:
        """Step ``opt`` (built on the masters) one chunk of parameters at a time: for each chunk
        (about ``chunk_bytes`` of fp32 gradient, at least one tensor; default `CHUNK_BYTES`),
        ``master.grad = coef * float(param.grad)`` with each bf16 gradient freed as soon as it is
        upcast, AdamW steps the chunk (it skips masters without a gradient), the chunk's weights
        are refreshed from its masters and its fp32 gradients dropped. So the fp32 gradients of
        only one chunk exist at a time: the step's peak stays at the table's 16 B/param plus one
        chunk (`ray_dhp.planning.memory.rank_state`'s ``step_peak``), not 20."""
        for chunk in self._chunks(CHUNK_BYTES if chunk_bytes is None else chunk_bytes):
            for p, m in chunk:
                g = p.grad.to(device=m.device, dtype=m.dtype)
                p.grad = None
                if coef != 1.0:
                    g.mul_(coef)
                m.grad = g
            opt.step()
            for p, m in chunk:
                p.copy_(m)
                m.grad = None

    def _chunks(self, chunk_bytes: int):
        chunk, size = [], 0
        for p, m in self.pairs:
            n = local_nbytes(m)
            if chunk and size + n > chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append((p, m))
            size += n
        if chunk:
            yield chunk

    @torch.no_grad()
    def grads_to_masters(self, coef: float = 1.0) -> None:
        """``master.grad = coef * float(param.grad)`` for every pair at once, each bf16 gradient
        freed as soon as it is upcast (the single-process reference's form; the engine uses
        `step`, which also bounds the fp32 gradients to one chunk)."""
        for p, m in self.pairs:
            g = p.grad.to(torch.float32)
            p.grad = None
            if coef != 1.0:
                g.mul_(coef)
            m.grad = g

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Round the masters into the model's (bf16) weights and drop the masters' gradients."""
        for p, m in self.pairs:
            p.copy_(m)
            m.grad = None

    def nbytes(self) -> int:
        return sum(local_nbytes(m) for _, m in self.pairs)
