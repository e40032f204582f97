"""Background checkpoint writes: stage this rank's state in host memory, write it in a thread.

`BackgroundWriter.start` pauses the training step only to copy this rank's checkpoint state
(`ray_dhp.checkpointing.checkpoint.capture`: parameters or fp32 masters, AdamW moments,
schedule positions, RNG states) into host buffers — a consistent snapshot, since the next step
updates the live tensors in place. The buffers are allocated once and reused by every later
checkpoint (pinned host memory on GPU, so the device-to-host copies run at full bandwidth);
`BackgroundWriter.reserve` allocates and touches them before the first save point (the built-in
loop calls it after the run's first step, once the AdamW moments exist), so a save point's
blocked window holds the copies only, not the allocation and first-touch page faults of a
fresh copy of the state (3-10x the copy itself on the 2-core test VM,
`benchmarks/checkpoint_io.py`); a DTensor's local shard is copied and re-wrapped with the same
sharding, so the checkpoint keeps its layout-independent DCP form. The buffers are one copy of the rank's checkpoint state:
``ray-dhp plan`` counts them per rank ("checkpoint staging", host memory).

A thread then writes the snapshot (`ray_dhp.checkpointing.checkpoint.write`: DCP shards with
checksums computed while writing, fsynced, then the commit) over a gloo process group of its
own, so its collectives never interleave with the training step's. At most one write is in
flight: `start` waits for the previous one. Whether a write is durable on every rank is a
collective question (`all_done`), asked at the same points on every rank.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def stage(state, buffers: dict, pin: bool, key: str = ""):
    """A copy of ``state`` (nested dicts of tensors, DTensors and plain values) whose tensors
    live in ``buffers`` (``{key: host tensor}``, filled on first use, reused after)."""
    if isinstance(state, dict):
        return {k: stage(v, buffers, pin, f"{key}/{k}") for k, v in state.items()}
    if not isinstance(state, torch.Tensor):
        return copy.deepcopy(state)
    from torch.distributed.tensor import DTensor

    local = state._local_tensor if isinstance(state, DTensor) else state
    local = local.detach()
    buf = buffers.get(key)
    if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
        buf = buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                         pin_memory=pin)
    buf.copy_(local, non_blocking=pin)
    if isinstance(state, DTensor):  # same sharding, host shard (from_local would move it back)
        return DTensor(buf, state._spec, requires_grad=False)
    return buf


def staged_bytes(buffers: dict) -> int:
    """Host bytes held by the staging buffers."""
    return sum(b.numel() * b.element_size() for b in buffers.values())


class BackgroundWriter:
    """One background checkpoint write at a time (collective: construct on every rank)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.group = dist.new_group(backend="gloo")  # the writes' own collectives
        self.buffers: dict = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def reserve(self, engine) -> float:
        """Allocate the staging buffers for ``engine``'s checkpoint state now, outside a save
        point, and touch every page (by staging the state once); returns the seconds taken. A
        tensor that appears later (or changes shape) is still allocated at the save point.
        Call it at the same point on every rank (the optimizer state dict may be collective)."""
        import time

        from ray_dhp.checkpointing.checkpoint import train_state

        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        stage(train_state(engine), self.buffers, pin)
        if pin:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - t0

    def start(self, directory: str, engine, sampler, processor=None,
              on_written: Optional[Callable[[], None]] = None) -> float:
        """Wait for the previous write, stage a snapshot (the step is blocked only for this) and
        start writing it into ``directory``; returns the seconds spent staging."""
        import time

        from ray_dhp.checkpointing.checkpoint import capture, write

        self.wait()
        t0 = time.perf_counter()
        snap = capture(engine, sampler, processor)
        pin = self.device.type == "cuda"
        snap.state = stage(snap.state, self.buffers, pin)
        if pin:
            torch.cuda.current_stream(self.device).synchronize()  # the copies are in the buffers
        staged = time.perf_counter() - t0

        def run():
            try:
                write(directory, snap, self.group, on_written)
            except BaseException as e:  # noqa: BLE001 - raised on the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="ray_dhp-checkpoint", daemon=True)
        self._thread.start()
        return staged

    def done(self) -> bool:
        """This rank's write has finished (or failed); no collective."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until this rank's write has finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"background checkpoint write failed: {e!r}") from e

    def all_done(self) -> bool:
        """Collective: True if the write has finished on every rank (then `wait` returns at
        once); a failed write on any rank raises on every rank."""
        done = self.done()
        flags = torch.tensor([0.0 if done else 1.0, 1.0 if done and self._error is not None else 0.0],
                             device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1] > 0:
            if self._error is not None:
                self.wait()
            raise RuntimeError("a background checkpoint write failed on another rank")
        if flags[0] > 0:
            return False
        self.wait()
        return True
