"""Runs on a Ray of their own, as separate programs, for the tests of runs that share a machine
or a cluster (`test_shared_machine.py`, `test_shared_cluster.py`): the fp64 reference of a run
alone, `PrivateRun` (`private_run.py` in the background), the environment that gives a run its
own temp folder and `kill_started`, which tests/ray/conftest.py's teardown calls (its fixtures
``alone`` and ``no_stray_runs`` use what is here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.ray.machine import kill_processes_with_tmpdir, short_tmp

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ray" / "private_run.py"
FAMILY = "qwen2_5_vl"
LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


_STARTED: list = []


def started() -> set:
    """The temp folders of the runs started so far."""
    return set(_STARTED)


def kill_started(before: set) -> None:
    """Kill everything carrying a temp folder registered since ``before``."""
    for tmpdir in started() - before:
        kill_processes_with_tmpdir(str(tmpdir))


def env_for(tmpdir: Path) -> dict:
    """The environment of a run with its own temp folder (registered: `no_stray_runs` kills
    whatever carries it when the test ends)."""
    _STARTED.append(tmpdir)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT), RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.25")
    return env


class PrivateRun:
    """`private_run.py` in the background, pausing after step 2 when ``pause``."""

    def __init__(self, tmp: Path, data: Path, *, dashboard=False, pause=False, name="private"):
        self.tmp, self.out, self.dashboard = short_tmp(), tmp / f"{name}.json", dashboard
        self.pause = tmp / f"{name}_pause" if pause else None
        cmd = [sys.executable, str(SCRIPT), str(self.out), "--data", str(data),
               "--storage", str(tmp / "runs"), "--name", name]
        cmd += ["--dashboard"] if dashboard else []
        if self.pause:
            self.pause.mkdir()
            cmd += ["--pause-dir", str(self.pause)]
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen(cmd, env=env_for(self.tmp), stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_paused(self, timeout_s=600):
        deadline = time.monotonic() + timeout_s
        while not all((self.pause / f"paused.{r}").exists() for r in (0, 1)):
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, self.tail()
            time.sleep(0.5)

    def go(self):
        (self.pause / "go").touch()

    def finish(self, timeout_s=600) -> dict:
        assert self.proc.wait(timeout=timeout_s) == 0, self.tail()
        self.log.close()
        return json.loads(self.out.read_text())

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]
