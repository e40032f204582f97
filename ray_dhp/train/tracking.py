"""Experiment tracking: TensorBoard event files (default), MLflow and Weights & Biases.

- **TensorBoard** (`TensorBoardLogger`, a ``ray.train.UserCallback`` run in the Ray Train
  controller): every metric rank 0 reports, as scalars, into ``<storage_path>/<run name>/tensorboard``
  (``tensorboard --logdir <storage_path>``), plus the run's configuration as text. Written with
  ``tensorboardX``, which Ray already installs.
- **MLflow / W&B** (`WorkerTrackers`, on rank 0 of the workers): through Ray's own integrations,
  ``ray.air.integrations.mlflow.setup_mlflow`` and ``ray.air.integrations.wandb.setup_wandb``;
  the run's configuration is logged as parameters, every reported metric at its step.

Nested metrics are flattened with ``/`` (``peak_memory_mb_per_rank/0``, ``dataset_draws/shapes``);
anything that is not a number is left out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Optional

from ray.train.v2.api.callback import UserCallback

logger = logging.getLogger("ray_dhp")

TENSORBOARD_DIR = "tensorboard"

__all__ = ["flatten_metrics", "TensorBoardLogger", "WorkerTrackers", "TENSORBOARD_DIR"]


def flatten_metrics(metrics: dict, prefix: str = "") -> dict:
    """``{name: float}`` of every finite-or-not number in ``metrics`` (nested dicts and lists are
    flattened with ``/``; booleans become 0/1; strings and None are dropped)."""
    out: dict = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(flatten_metrics(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(flatten_metrics(dict(enumerate(value)), name + "/"))
    return out


def _step_of(metrics: dict, fallback: int) -> int:
    step = metrics.get("step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else fallback


class TensorBoardLogger(UserCallback):
    """Writes rank 0's reported metrics as TensorBoard scalars (see module docstring).

    Args:
        config: the run's configuration, written once as a JSON text summary named "config".
        logdir: where the event files go (default ``<storage_path>/<run name>/tensorboard``).
    """

    def __init__(self, config: Optional[dict] = None, logdir: Optional[str] = None):
        self.config = config or {}
        self.logdir = logdir
        self._writer = None
        self._reports = 0

    def _open(self, run_context):
        # tensorboardX's synchronous writer: every report is on disk when after_report returns
        # (SummaryWriter queues events in a thread that is only drained on close, and the
        # controller has no end-of-run hook for user callbacks).
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.summary import text

        if self.logdir is None:
            rc = run_context.run_config
            self.logdir = os.path.join(os.path.expanduser(rc.storage_path), rc.name, TENSORBOARD_DIR)
        os.makedirs(self.logdir, exist_ok=True)
        self._writer = EventsWriter(os.path.join(self.logdir, "events"))
        config = json.dumps(self.config, indent=1, default=str, sort_keys=True)
        self._write(0, text("config", "```\n" + config + "\n```"))

    def _write(self, step: int, summary) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._writer.write_event(Event(wall_time=time.time(), step=step, summary=summary))

    def after_report(self, run_context, metrics, checkpoint):
        if not metrics or not metrics[0]:
            return
        from tensorboardX.summary import scalar

        self._reports += 1
        try:
            if self._writer is None:
                self._open(run_context)
            step = _step_of(metrics[0], self._reports)
            for name, value in flatten_metrics(metrics[0]).items():
                if name != "step" and math.isfinite(value):
                    self._write(step, scalar(name, value))
            self._writer.flush()
        except OSError as e:  # remote storage (s3://...) is not a local folder: keep training
            logger.debug("tensorboard events not written: %s", e)


class WorkerTrackers:
    """MLflow and/or W&B on rank 0 of the workers, through Ray's integrations.

    Args:
        mlflow: keyword arguments of ``setup_mlflow`` (``tracking_uri``, ``experiment_name``,
            ``run_name``, ``tags``, ...), or None for no MLflow.
        wandb: keyword arguments of ``setup_wandb`` (``project``, ``name``, ``mode``, ...), or None.
        config: the run's configuration, logged as parameters / the W&B config.
        rank: this worker's world rank (trackers are opened on rank 0 only).
        run_name: the Ray Train run name: the default MLflow experiment and run name (the
            experiment is created if missing) and W&B run name.
    """

    def __init__(self, *, mlflow: Optional[dict], wandb: Optional[dict], config: dict, rank: int,
                 run_name: Optional[str] = None):
        self._mlflow: Any = None
        self._wandb: Any = None
        if rank != 0:
            return
        params = flatten_config(config)
        if mlflow is not None:
            from ray.air.integrations.mlflow import setup_mlflow

            kwargs = {"experiment_name": run_name, "run_name": run_name,
                      "create_experiment_if_not_exists": True, **mlflow}
            self._mlflow = setup_mlflow(config=params, rank_zero_only=False, **kwargs)
        if wandb is not None:
            from ray.air.integrations.wandb import setup_wandb

            self._wandb = setup_wandb(config=params, rank_zero_only=False,
                                      **{"name": run_name, **wandb})

    def log(self, metrics: dict, step: int) -> None:
        flat = {k: v for k, v in flatten_metrics(metrics).items() if k != "step" and math.isfinite(v)}
        if self._mlflow is not None:
            # MLflow metric names allow letters, digits, _ - . / and spaces
            self._mlflow.log_metrics(flat, step=step)
        if self._wandb is not None:
            self._wandb.log(flat, step=step)

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run()
        if self._wandb is not None:
            self._wandb.finish()


def flatten_config(config: dict, prefix: str = "") -> dict:
    """``{dotted key: str value}`` of a nested config (for MLflow parameters)."""
    out: dict = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = str(value)
    return out


def set_ray_report_logs(enabled: bool) -> None:
    """Show (True) or hide (False) Ray Train's per-rank "Reporting training result ..." and
    "Checkpoint successfully created ..." INFO lines in this worker process."""
    import ray.train.v2._internal.execution.context as ctx_mod
    import ray.train.v2._internal.execution.storage as storage_mod

    level = logging.NOTSET if enabled else logging.WARNING
    # context.py names its logger after its file, storage.py after its module
    for name in (ctx_mod.logger.name, storage_mod.logger.name):
        logging.getLogger(name).setLevel(level)
