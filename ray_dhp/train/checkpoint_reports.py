"""How the built-in loop hands checkpoints to Ray Train, synchronously or from a background write.

``ray.train.report`` is a barrier that every rank calls the same number of times, and the
checkpoint it registers must be complete: Ray copies each rank's directory into the run's
storage during the call, and a restarted run resumes from the newest registered one.

* synchronous (``checkpoint.async_save: false``): a save point writes the checkpoint and reports
  it with that step's metrics (`ray_dhp.train.custom_loop.report_checkpoint`).
* asynchronous (the default): a save point stages a snapshot and starts the background write
  (`ray_dhp.checkpointing.staging.BackgroundWriter`), and its report is *held back*: the step's
  metrics are reported together with its checkpoint, at the end of the first later step at
  which every rank's write is durable (while a write is in flight, one small all-reduce per
  step decides, the same on every rank), or at the next save point / the end of training,
  which wait for it. So the number of reports is the
  synchronous path's, a checkpoint's metrics (e.g. a score attribute) are its own step's, and
  until its report the previous checkpoint stays the newest registered one: a crash during the
  background write resumes from that. Metrics of report points between a save and its report
  reach Ray first (its history is then not sorted by step).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ray_dhp.train.cleanup import staging_dir

logger = logging.getLogger(__name__)


class CheckpointReports:
    """Save points and report points of the built-in loop (collective: same calls on every rank).

    Args:
        async_save: write in the background (see the module doc).
        device: the training device (the all-reduce that asks whether a write is durable).
        hook: ``hook(event, step)``: ``"checkpoint_writing"`` (asynchronous only, on the writer
            thread: this rank's shards are on disk, not committed) and ``"checkpoint_saved"``
            (on the training thread: the checkpoint is complete on every rank, before its report).
    """

    def __init__(self, async_save: bool, device, hook: Callable):
        from ray_dhp.checkpointing.staging import BackgroundWriter

        self.hook = hook
        self.writer = BackgroundWriter(device) if async_save else None
        self._pending = None  # (temporary directory, metrics, step) of the write in flight
        self.last_blocked_s: Optional[float] = None  # seconds the last save point held the step

    def reserve(self, engine) -> None:
        """After the run's first step (the AdamW moments exist): allocate the staging buffers
        now, so that no save point's blocked time includes allocating them (asynchronous
        only; collective)."""
        if self.writer is not None and not self.writer.buffers:
            seconds = self.writer.reserve(engine)
            logger.debug("checkpoint staging buffers allocated in %.2f s", seconds)

    def save(self, metrics: dict, engine, loader, processor=None) -> None:
        """A save point: the checkpoint of ``engine`` now, reported with ``metrics``."""
        import time

        from ray_dhp.train.custom_loop import report_checkpoint

        t0 = time.perf_counter()
        if self.writer is None:
            report_checkpoint(metrics, engine, loader, processor,
                              on_saved=lambda: self.hook("checkpoint_saved", engine.step_count))
            self.last_blocked_s = time.perf_counter() - t0
            return
        self.flush(wait=True)  # at most one write in flight
        step = engine.step_count
        tmp = staging_dir()
        self.writer.start(tmp.name, engine, loader, processor,
                          on_written=lambda: self.hook("checkpoint_writing", step))
        self._pending = (tmp, dict(metrics), step)
        self.last_blocked_s = time.perf_counter() - t0

    def report(self, metrics: dict) -> None:
        """A report point without a checkpoint; a write that is durable everywhere is reported
        first (with its own step's metrics)."""
        import ray.train

        self.flush(wait=False)
        ray.train.report(metrics)

    def flush(self, wait: bool = True) -> None:
        """Report the checkpoint in flight: after waiting for it (``wait``), or only if every
        rank's write is already durable."""
        if self._pending is None:
            return
        if wait:
            self.writer.wait()
        elif not self.writer.all_done():
            return
        import ray.train

        tmp, metrics, step = self._pending
        self._pending = None
        self.hook("checkpoint_saved", step)
        try:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp.name),
                             checkpoint_dir_name=f"checkpoint_{step:06d}")
        finally:
            tmp.cleanup()
