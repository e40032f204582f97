"""Driver-visible progress and metric history for Ray Train V2 runs.

Ray Train V2 keeps only the last metrics in ``Result.metrics``; `MetricsHistory` (a
``ray.train.UserCallback``, run in the controller) appends every report of rank 0 to
``<storage_path>/<run name>/ray_dhp_metrics.jsonl`` and logs a one-line progress with ETA.
`read_history(result)` reads it back on the driver.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

from ray.train.v2.api.callback import UserCallback

logger = logging.getLogger("ray_dhp")

HISTORY_FILE = "ray_dhp_metrics.jsonl"


class MetricsHistory(UserCallback):
    def __init__(self, total_steps: Optional[int] = None):
        self.total_steps = total_steps
        self._t0: Optional[float] = None
        self._step0 = 0

    def _path(self, run_context) -> str:
        rc = run_context.run_config
        folder = os.path.join(os.path.expanduser(rc.storage_path), rc.name)
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, HISTORY_FILE)

    def after_report(self, run_context, metrics, checkpoint):
        if not metrics:
            return
        m = dict(metrics[0])
        m["time"] = time.time()
        try:
            with open(self._path(run_context), "a+b") as f:
                line = (json.dumps(m, default=float) + "\n").encode()
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # the last append was torn: keep it on its own line
                        line = b"\n" + line
                f.write(line)
        except OSError as e:  # remote storage (s3://...) is not a local folder: keep training
            logger.debug("metrics history not written: %s", e)
        self._progress(m)

    def _progress(self, m: dict) -> None:
        step = m.get("step")
        if step is None:
            return
        if self._t0 is None:
            self._t0, self._step0 = time.time(), step
            eta = ""
        else:
            rate = (step - self._step0) / max(time.time() - self._t0, 1e-9)
            left = (self.total_steps - step) / rate if self.total_steps and rate > 0 else None
            eta = f" ETA {left:.0f}s" if left is not None else ""
        total = f"/{self.total_steps}" if self.total_steps else ""
        tps = m.get("tokens_per_s")
        speed = f" {tps:,.0f} tokens/s" if isinstance(tps, (int, float)) else ""
        ev = m.get("eval_loss")
        ev = f" eval_loss {ev:.4f}" if isinstance(ev, (int, float)) else ""
        logger.warning("[ray_dhp] step %s%s loss %.4f%s%s%s", step, total, m.get("loss", float("nan")),
                       ev, speed, eta)


def read_history(result) -> list:
    """All metrics rank 0 reported during the run of ``result`` (a ``ray.train.Result``, or the
    run folder as a path).

    A torn line (the driver died mid-append: the last line, or one before the lines of a
    resumed run) is left out with a warning naming it; the other lines are returned.
    """
    folder = result if isinstance(result, (str, os.PathLike)) else result.path
    path = os.path.join(folder, HISTORY_FILE)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            logger.warning("%s:%d: torn metrics line left out (%s)", path, number, e)
    return out
