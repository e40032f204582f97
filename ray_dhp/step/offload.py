"""Host optimizer offload (``<module>.optimizer_offload: true``): the optimizer's copies of the
parameters a rank updates (its ZeRO partition) and their AdamW moments live in host memory, and
the update runs on the CPU; the device keeps only the weights and gradients.

Per step (`ray_dhp.step.precision.MasterWeights.step`, one ~64 MiB chunk at a time): each
gradient is copied to the host (upcast to fp32 under ``bf16_mixed``) and freed on the device,
the host optimizer steps the chunk's masters, and the new values are copied back into the
device weights. Without fp32 masters (``fp32``, ``fp64``, ``bf16`` policies) the host copies
are in the parameters' own dtype, so the update is the same arithmetic as on the device.

The host AdamW (`host_adamw`): DeepSpeed's vectorised ``DeepSpeedCPUAdam`` for fp32 masters —
measured 5.7x faster than torch's AdamW on one CPU thread at 8 M parameters (foreach 0.137 s,
single-tensor 0.143 s, DeepSpeed 0.024 s per step; `benchmarks/zero_stages.py --host-adam`) —
and torch's AdamW otherwise (DeepSpeed's kernel has no fp64). DeepSpeed compiles its CPU op
on first use (minutes, then cached in ``~/.cache/torch_extensions``).

Host buffers (`HostTransfer`): on a CUDA device the masters (copied to the device every step)
and each chunk's gradient staging buffer are pinned, and the copies are ``non_blocking``: the
chunk's gradients are upcast on the device and copied into the pinned staging buffer, the
stream is synchronised once per chunk before the host AdamW reads them, and the new masters go
back as fp32 (``non_blocking`` from pinned memory) and are rounded into the weights on the
device; the copies back are ordered before any later device work by the stream, and the next
host write of those masters comes after the next chunk's synchronisation. The AdamW moments
never leave the host and are not pinned. Without an accelerator (CPU torch cannot pin) the same
path runs unpinned and blocking; a gradient already on the host in the masters' dtype (fp32
accumulations on a CPU device) is the master's gradient, no copy. The CUDA path is not measured
here (no GPU on the development machine).

Offload needs plain (not DTensor) parameters: a host copy of a DTensor would need a host
device mesh beside the device one. So: every vision stage, text only with ``tensor_parallel=1``
and ``zero_stage`` 0-2 (`ray_dhp.parallel.topology.check_offload`, naming the key).
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


def pins(device: torch.device) -> bool:
    """Whether the host buffers of an offloaded update for parameters on ``device`` are pinned:
    only for a CUDA device (pinning needs the accelerator's driver; a CPU device's copies are
    plain memcpys)."""
    return device.type == "cuda" and torch.cuda.is_available()


class HostTransfer:
    """The device <-> host copies of one module's offloaded update (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device, self.pinned = device, pins(device)

    def master(self, p: torch.Tensor, dtype) -> torch.nn.Parameter:
        """The host copy of ``p`` in ``dtype`` (None: its own), pinned if `pins`."""
        out = torch.empty(p.shape, dtype=dtype or p.dtype, device=HOST, pin_memory=self.pinned)
        return torch.nn.Parameter(out.copy_(p.detach()), requires_grad=True)

    def grads_in(self, chunk: list, coef: float) -> None:
        """``m.grad = coef * p.grad`` on the host for every (parameter, master) of ``chunk``,
        each ``p.grad`` freed; the copies land in one staging buffer (pinned if `pins`)."""
        copied = [(p, m) for p, m in chunk if p.grad.device != HOST or p.grad.dtype != m.dtype]
        sizes = [-(-m.numel() * m.element_size() // 64) * 64 for _, m in copied]  # 64 B aligned
        staging = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self.pinned)
        offset = 0
        for (p, m), size in zip(copied, sizes):
            view = staging[offset:offset + m.numel() * m.element_size()].view(m.dtype).view(m.shape)
            offset += size
            # pinned: upcast on the device, then a same-dtype (truly asynchronous) copy
            view.copy_(p.grad.to(m.dtype) if self.pinned else p.grad, non_blocking=self.pinned)
            p.grad, m.grad = None, view
        for p, m in chunk:
            if m.grad is None:  # already on the host in the masters' dtype: no copy
                p.grad, m.grad = None, p.grad
        if self.pinned and copied:
            torch.cuda.current_stream(self.device).synchronize()
        if coef != 1.0:
            for _, m in chunk:
                m.grad.mul_(coef)

    def weights_out(self, chunk: list) -> None:
        """The chunk's weights from its (stepped) masters."""
        for p, m in chunk:
            p.copy_(m.to(p.device, non_blocking=True) if self.pinned else m)


def host_adamw(groups: list, cfg):
    """AdamW over ``groups`` of host parameters: DeepSpeedCPUAdam when they are fp32, torch's
    single-tensor AdamW otherwise (see the module docstring)."""
    params = [p for g in groups for p in g["params"]]
    if all(p.dtype == torch.float32 for p in params):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)


def host_bytes(engine) -> int:
    """Bytes of the offloaded modules' masters and optimizer tensors, measured (all on the host)."""
    out = 0
    for module, (opt, _, masters) in engine.opts.items():
        if masters is None or not engine.groups.topology.module(module).offload:
            continue
        tensors = [m for _, m in masters.pairs] + [v for st in opt.state.values()
                                                   for v in st.values()
                                                   if torch.is_tensor(v) and v.dim() > 0]
        assert all(t.device == HOST for t in tensors), f"{module}: offloaded state off the host"
        out += sum(t.numel() * t.element_size() for t in tensors)
    return out
