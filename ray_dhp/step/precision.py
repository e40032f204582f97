"""Precision policies: which dtype the weights, gradients and optimizer state of a rank have.

One setting (``train_loop_config["precision"]``, run file ``precision.policy``, or ``precision: <name>``) drives the
engine, the single-process reference, `ray-dhp plan`'s memory estimate and the checkpoint:

==================  =========  ==========  ============  ===========  ====================
policy              weights    gradients   fp32 master   AdamW state  bytes / parameter
==================  =========  ==========  ============  ===========  ====================
``fp32``            fp32       fp32        --            fp32         4 + 4 + 8 = 16
``bf16_autocast``   fp32       fp32        --            fp32         16 (matmuls in bf16)
``bf16_mixed``      bf16       fp32        fp32          fp32         2 + 4 + 4 + 8 = 18
``bf16``            bf16       fp32        --            bf16         2 + 4 + 4 = 10
==================  =========  ==========  ============  ===========  ====================

Under the bf16 policies every micro-batch's backward computes bf16 gradients, but they
*accumulate* across micro-batches in fp32 (`accumulate_in_fp32`: the parameters' ``grad_dtype``
is fp32, so autograd casts each incoming bf16 gradient to fp32 and sums it into an fp32
``.grad``): summing M micro-batches in bf16 would round every partial sum to 8 bits, an error
that grows with M. The fp32 gradients are then summed over replicas in fp32 and become the fp32
masters' gradients as they are (``bf16_mixed``: no copy; the clipping factor is applied there) or,
under ``bf16``, are rounded to bf16 once, parameter by parameter, for the bf16 AdamW update
(`round_grads_for_update`). At ZeRO stage 3, FSDP2 reduce-scatters each micro-batch in fp32
(its ``reduce_dtype``) and hands back a bf16 gradient shard: with one micro-batch it stays so
(2 B per parameter, upcast chunk by chunk into the masters), with several the shards accumulate
in fp32 (`ray_dhp.parallel.fsdp.FSDPShards.sync`).

``bf16_mixed`` keeps an fp32 master copy of every parameter the rank updates; AdamW steps the
masters and the bf16 weights are refreshed from them after every step. Against fp32 it costs 2
more bytes per parameter, but the weights the forward/backward reads and the activations are half
the size, and with vision ZeRO-1 the 12 master + moment bytes of a ViT parameter live on one rank
only. Checkpoints store the masters (``model.<name>`` in fp32), so resuming is exact. ``bf16`` (no
masters) has the smallest state but loses updates smaller than a bf16 ulp of the weight; it is
the cheapest and the least accurate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ray_dhp.config.sections import POLICY_NAMES

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
        """The dtype gradients accumulate in across micro-batches (fp32 for bf16 weights)."""
        return torch.float32 if self.param_dtype in (torch.bfloat16, torch.float16) else self.param_dtype

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
    """The `PrecisionPolicy` of the run's ``precision`` section
    (`ray_dhp.config.sections.PrecisionConfig`, or anything with a ``policy`` attribute; None:
    fp32)."""
    name = (None if cfg is None else cfg.policy) or "fp32"
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


def accumulate_in_fp32(params, policy: PrecisionPolicy) -> None:
    """Make ``params`` (bf16 under the bf16 policies) accumulate their gradients in the policy's
    ``grad_dtype`` (fp32): autograd casts each backward's incoming gradient and sums it into an
    fp32 ``.grad`` (torch's ``Tensor.grad_dtype``, torch >= 2.10). No-op for the fp32 policies
    (also when the tests run them in fp64)."""
    if policy.grad_dtype == policy.param_dtype:
        return
    if not hasattr(torch.Tensor, "grad_dtype"):  # an attribute set anyway would be ignored
        raise RuntimeError(f"precision={policy.name!r} accumulates gradients in fp32 through "
                           f"Tensor.grad_dtype, which torch {torch.__version__} lacks: torch>=2.10")
    for p in params:
        p.grad_dtype = policy.grad_dtype


@torch.no_grad()
def round_grads_for_update(params, coef: float = 1.0) -> None:
    """``bf16`` (no masters): replace each fp32 accumulated gradient by ``coef`` times it rounded
    to the weight's dtype, one parameter at a time (the bf16 AdamW needs gradients of its
    parameters' dtype); `restore_grad_dtype` after the update."""
    for p in params:
        g = p.grad
        if g is None or g.dtype == p.dtype:
            continue
        p.grad = None
        p.grad_dtype = None  # any dtype, for the update only
        if coef != 1.0:
            g.mul_(coef)
        p.grad = g.to(p.dtype)


def restore_grad_dtype(params, policy: PrecisionPolicy) -> None:
    """After `round_grads_for_update` and the step: the gradients it rounded are dropped and
    their parameters accumulate in fp32 again (the others, e.g. FSDP2's, are left alone)."""
    for p in params:
        if p.grad_dtype is None:
            p.grad = None
            p.grad_dtype = policy.grad_dtype


# -- fp32 master weights ------------------------------------------------------------------------

def _master_of(p: torch.Tensor, dtype=torch.float32, device=None) -> torch.nn.Parameter:
    """A copy of ``p`` in ``dtype`` (None: its own) on ``device`` (None: its own)."""
    return torch.nn.Parameter(p.detach().to(device=device or p.device, dtype=dtype or p.dtype,
                                            copy=True), requires_grad=True)


class _OnDevice:
    """The copies of `MasterWeights.step` with the masters beside the weights (the host ones:
    `ray_dhp.step.offload.HostTransfer`)."""

    @staticmethod
    def grads_in(chunk: list, coef: float) -> None:
        for p, m in chunk:
            g = p.grad.to(device=m.device, dtype=m.dtype)
            p.grad = None
            if coef != 1.0:
                g.mul_(coef)
            m.grad = g

    @staticmethod
    def weights_out(chunk: list) -> None:
        for p, m in chunk:
            p.copy_(m)


_ON_DEVICE = _OnDevice()


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
        from ray_dhp.step.offload import HOST, HostTransfer

        self.module = torch.nn.Module()
        self.pairs = []  # (model parameter, master)
        named_params = list(named_params)
        # host masters (optimizer offload): pinned buffers and asynchronous copies on CUDA
        self.transfer = (HostTransfer(named_params[0][1].device)
                         if device == HOST and named_params else None)
        for name, p in named_params:
            *path, leaf = name.split(".")
            owner = self.module
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            master = _master_of(p, dtype, device) if self.transfer is None else \
                self.transfer.master(p, dtype)
            owner.register_parameter(leaf, master)
            self.pairs.append((p, master))

    def named_parameters(self):
        return self.module.named_parameters()

    @torch.no_grad()
    def step(self, opt, coef: float = 1.0, chunk_bytes: Optional[int] = None) -> None:
        """Step ``opt`` (built on the masters) one chunk of parameters at a time: for each chunk
        (about ``chunk_bytes`` of fp32 gradient, at least one tensor; default `CHUNK_BYTES`),
        ``master.grad = coef * float(param.grad)``, AdamW steps the chunk (it skips masters without
        a gradient), the chunk's weights are refreshed from its masters and its fp32 gradients
        dropped. A gradient accumulated in fp32 (`accumulate_in_fp32`) *is* the master's gradient
        (no copy, no transient); a bf16 one (FSDP2's shards at stage 3) is freed as soon as it
        is upcast, so the fp32 gradients of only one chunk exist at a time
        (`ray_dhp.planning.step_peak`)."""
        copies = _ON_DEVICE if self.transfer is None else self.transfer  # host: pinned on CUDA
        for chunk in self._chunks(CHUNK_BYTES if chunk_bytes is None else chunk_bytes):
            copies.grads_in(chunk, coef)
            opt.step()
            copies.weights_out(chunk)
            for _, m in chunk:
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
    def masters_to_params(self) -> None:
        """Round the masters into the model's (bf16) weights and drop the masters' gradients."""
        for p, m in self.pairs:
            p.copy_(m)
            m.grad = None

    def nbytes(self) -> int:
        return sum(local_nbytes(m) for _, m in self.pairs)
