"""What ``ray-dhp train`` finds in the run folder before it starts: a new run, one to resume, or a
finished one (refused, saying what to change), so that re-running a command never silently
trains nothing."""

from __future__ import annotations

import os
from typing import Optional

from ray_dhp.config.checks import ConfigError


def checkpoint_step(folder: str) -> Optional[int]:
    """Step of the newest complete checkpoint in the run folder ``folder`` (None: none)."""
    from ray_dhp.checkpointing import checkpoint

    if not os.path.isdir(folder):
        return None
    try:
        return int(checkpoint.read_meta(checkpoint.resolve(folder))["step"])
    except (FileNotFoundError, OSError, KeyError, ValueError):
        return None


def check_run_folder(rf) -> Optional[int]:
    """The step an existing run of the same name resumes at (None: a new run); ConfigError when
    that run already reached ``optim.num_steps`` (there would be nothing to train)."""
    folder = os.path.join(rf.storage_path(), rf.run_name())
    step = checkpoint_step(folder)
    if step is None:
        return None
    if step >= rf.optim.num_steps:
        raise ConfigError(
            f"run.name: the run {rf.run_name()!r} in {rf.storage_path()} already finished: its "
            f"checkpoint is at step {step} and optim.num_steps={rf.optim.num_steps}, so there is "
            f"nothing to train. To start a new run, give another run.name (e.g. "
            f"run.name={rf.run_name()}_2) or delete {folder}; to continue this one, raise "
            f"optim.num_steps above {step}.")
    return step
