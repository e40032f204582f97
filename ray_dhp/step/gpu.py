"""GPU defaults of the step, each a small decision that the CPU tests exercise with a CUDA
``torch.device`` (constructing one needs no GPU):

* `tf32_flags`: TF32 for fp32 matmuls and convolutions on CUDA (run file ``precision.tf32``, on by
  default; ~8x the fp32 matmul rate on Hopper). Only CUDA's flags are touched: on CPU
  ``torch.set_float32_matmul_precision("high")`` may switch oneDNN to reduced precision, which
  would break the fp32/fp64 exactness tests.
* `to_device`: host-to-device copies from pinned memory, non-blocking (the caching host allocator
  keeps the pinned buffer alive until the copy has run).
* `synchronize`: what `ray_dhp.step.microbatch.PhaseTimer` calls at phase edges, so that
  ``time_*_s`` measure kernels, not their queuing.
"""

from __future__ import annotations

from typing import Optional

import torch


def tf32_flags(tf32: bool, device: torch.device) -> Optional[dict]:
    """The CUDA flags for ``tf32`` on ``device`` (None off CUDA: nothing to set)."""
    if device.type != "cuda":
        return None
    return {"matmul.allow_tf32": bool(tf32), "cudnn.allow_tf32": bool(tf32)}


def apply_tf32(tf32: bool, device: torch.device) -> Optional[dict]:
    """Set `tf32_flags` (process-wide: the worker's matmuls); returns what was set."""
    flags = tf32_flags(tf32, device)
    if flags is not None:
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul.allow_tf32"]
        torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]
    return flags


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for CUDA goes through pinned memory, non-blocking."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def synchronize(device: Optional[torch.device]) -> None:
    """Wait for ``device``'s queued kernels (CUDA only; a no-op elsewhere)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
