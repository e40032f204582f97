"""Runs that share a cluster, or a machine with a cluster: the rest of the concurrency matrix of
`tests/ray/test_shared_machine.py` (its helpers and its fp64 reference are reused).

- A Ray Tune sweep of two trials at once on one ``ray start --head`` cluster (the test's own):
  trials that differ only in the learning rate, ``max_concurrent_trials=2``, each the fp64 run of
  `tests/ray/private_run.py` through `DisaggregatedTrainer` with Tune's report callback.
- A ``ray job submit`` run on such a cluster (with its dashboard, on a free port) while a private
  local run (``ray.init(address="local")``, no dashboard) trains beside it on the same machine;
  both pause after step 2 until both got there, so they are alive together mid-training.

Every run's losses, step by step, against the same layout trained alone by the engine on
spawned gloo ranks (fp64, relative 1e-10); after the runs: no placement group not REMOVED, no
alive actor of theirs (Ray's named detached singletons apart), no checkpoint staging folder
``ray_dhp_ckpt_*``, no process carrying a run's ``TMPDIR`` and nothing left in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.train.cleanup import STAGING_PREFIX
from tests.distributed.parity import run_engine
from tests.ray.machine import (RAY, job_cluster, processes_with_tmpdir, short_tmp, submit_job,
                               temp_leftovers, wait_no_processes)
from tests.ray.private_run import LOOP
# the background private run (the fp64 reference ``alone`` and the teardown that kills whatever
# a failing test started are tests/ray/conftest.py's)
from tests.ray.shared_runs import FAMILY, LAYOUT, SCRIPT, PrivateRun, env_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(RAY), reason="needs the ray CLI next to python")]

LRS = (LOOP["lr"], 3e-3)  # the trials differ in the learning rate only


def _clusterenv_for(tmpdir: Path) -> dict:
    """The test cluster's processes: a temp folder of their own, this checkout's code, no token
    auth (Ray 2.60 CLI clients default to tokens), fast Train polls."""
    env = env_for(tmpdir)
    env.update(RAY_AUTH_MODE="disabled",
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
    return env


def _staging(tmpdir: Path) -> list:
    return sorted(n for n in os.listdir(tmpdir) if n.startswith(STAGING_PREFIX))


def _assert_losses(history: list, want: list):
    losses = [h["loss"] for h in sorted(history, key=lambda h: h["step"])]
    assert len(losses) == len(want), (losses, want)
    for got, ref in zip(losses, want):
        assert abs(got - ref) <= 1e-10 * abs(ref), (losses, want)


def _wait_for(path: Path, proc, what: str, timeout_s: float = 900):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc is None or proc.poll() is None, f"{what} ended early"
        assert time.monotonic() < deadline, f"{what}: {path} did not appear"
        time.sleep(0.5)


def _wait_no_processes_but(tmpdir: Path, services: list, timeout_s: float = 60.0) -> list:
    """`processes_with_tmpdir` less ``services`` (pids), once that is empty or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [(p, c) for p, c in processes_with_tmpdir(str(tmpdir)) if p not in services]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="module")
def alone_per_lr(alone, tmp_path_factory):
    """Every trial alone: the engine's fp64 losses at each learning rate of `LRS` (the same
    data as `alone`, whose losses are those at ``LOOP["lr"]``)."""
    from tests.distributed.parity import make_steps

    data, base = alone
    out = {LOOP["lr"]: base}
    for lr in LRS:
        if lr not in out:
            cfg = TrainLoopConfig(**{**LOOP, "lr": lr})
            steps = make_steps(tmp_path_factory.mktemp("alone_lr"), FAMILY, cfg)
            out[lr] = [h["loss"] for h in run_engine(FAMILY, LAYOUT, cfg, steps,
                                                     torch.float64)["history"]]
    return data, out


def test_a_tune_sweep_of_two_concurrent_trials_on_one_cluster(tmp_path, alone_per_lr):
    data, want = alone_per_lr
    assert want[LRS[0]] != want[LRS[1]]  # the trials are told apart by their losses
    cluster_tmp, driver_tmp = short_tmp(), short_tmp()
    out_path = tmp_path / "sweep.json"
    t0 = time.monotonic()
    with job_cluster(_clusterenv_for(cluster_tmp)) as (gcs, _):
        with open(tmp_path / "sweep.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(out_path), "--data", str(data),
                 "--storage", str(tmp_path / "runs"), "--name", "sweep", "--address", gcs,
                 "--lrs", ",".join(map(str, LRS))],
                env=env_for(driver_tmp), stdout=log, stderr=subprocess.STDOUT)
            rc = proc.wait(timeout=1800)
        log_tail = (tmp_path / "sweep.log").read_text()[-4000:]
        assert rc == 0, log_tail
        staging = _staging(cluster_tmp)  # while the cluster (and any straggler) is up
    wall = time.monotonic() - t0
    out = json.loads(out_path.read_text())
    assert out["error"] is None, (out["error"], log_tail)
    assert sorted(map(float, out["trials"])) == sorted(LRS), out["trials"]
    for lr in LRS:
        trial = out["trials"][str(lr)]
        _assert_losses(trial["history"], want[lr])
        assert abs(trial["final"] - want[lr][-1]) <= 1e-10 * abs(want[lr][-1])  # Tune's view
    (a0, a1), (b0, b1) = (out["trials"][str(lr)]["span"] for lr in LRS)
    assert max(a0, b0) < min(a1, b1), "the two trials did not train at the same time"
    assert out["left"]["placement_groups"] == 0 and out["left"]["actors"] == [], out["left"]
    assert staging == []
    assert wait_no_processes(str(driver_tmp)) == [] and temp_leftovers(str(driver_tmp)) == []
    assert wait_no_processes(str(cluster_tmp), 60) == []  # the cluster stopped whole
    print(f"sweep of {len(LRS)} concurrent trials: {wall:.0f} s with the cluster")


def test_a_submitted_job_beside_a_private_local_run(tmp_path, alone):
    data, losses = alone
    cluster_tmp, job_tmp = short_tmp(), short_tmp()
    env_for(job_tmp)  # registered: a failing test's job processes are killed too
    job_out, job_pause = tmp_path / "job.json", tmp_path / "job_pause"
    job_pause.mkdir()
    t0 = time.monotonic()
    with job_cluster(_clusterenv_for(cluster_tmp)) as (_, url):
        # the private run first, paused after step 2 (no dashboard of its own)
        local = PrivateRun(tmp_path, data, pause=True, name="local")
        entry = [sys.executable, str(SCRIPT), str(job_out), "--data", str(data),
                 "--storage", str(tmp_path / "runs"), "--name", "job", "--address", "auto",
                 "--pause-dir", str(job_pause)]
        submitted: dict = {}
        submit = threading.Thread(target=lambda: submitted.update(zip(
            ("rc", "out"), submit_job(url, entry, _clusterenv_for(cluster_tmp),
                                      runtime_env={"env_vars": {"TMPDIR": str(job_tmp)}}))))
        submit.start()
        try:
            local.wait_paused(timeout_s=900)
            for r in (0, 1):
                _wait_for(job_pause / f"paused.{r}", None, "the job", 900)
            time.sleep(5)  # both alive mid-run: their cleaners check every second
            (job_pause / "go").touch()
            local.go()
            local_out = local.finish(timeout_s=900)
        finally:
            (job_pause / "go").touch()  # never leave the job waiting
            submit.join(timeout=1200)
        assert submitted.get("rc") == 0, submitted.get("out", "")[-4000:]
        assert "succeeded" in submitted["out"].lower(), submitted["out"][-4000:]
        staging = _staging(cluster_tmp)
        job = json.loads(job_out.read_text())
        # the job's driver and workers are gone; Ray Data's AutoscalingCoordinator, a named
        # detached actor the job's Ray Data started (in the job's environment), serves the
        # cluster after it, by Ray's design
        job_left = _wait_no_processes_but(job_tmp, job["left"].get("ray_service_pids", []))
    wall = time.monotonic() - t0
    for out in (local_out, job):
        assert out["error"] is None, out["error"]
        _assert_losses(out["history"], losses)
        assert out["left"]["placement_groups"] == 0 and out["left"]["actors"] == [], out["left"]
    assert job_left == [] and staging == []
    assert temp_leftovers(str(job_tmp)) == []
    assert wait_no_processes(str(local.tmp)) == [] and temp_leftovers(str(local.tmp)) == []
    assert wait_no_processes(str(cluster_tmp), 60) == []
    print(f"job beside a private run: {wall:.0f} s with the cluster")
