"""What a run leaves on a machine (`ray_dhp.train.cleanup`, `ray_dhp.train.waiting`), without Ray:
staging folders swept by their owner's liveness, and the line a run waiting for room prints."""

import os
import subprocess
import sys

from ray_dhp.train.cleanup import STAGING_PREFIX, reap_ray_processes, sweep_staging
from ray_dhp.train.waiting import waiting_message


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_dead_workers_folders_and_never_a_live_ones(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    for name in (f"{STAGING_PREFIX}01000000_{dead}_a", f"{STAGING_PREFIX}02000000_{dead}_b",
                 f"{STAGING_PREFIX}01000000_{live}_c", f"{STAGING_PREFIX}02000000_{live}_d",
                 "ray_dhp_ckpt_not_ours", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard").write_text("x")
    removed = sweep_staging("01000000", wait_s=0.5, root=str(tmp_path))
    # this job's dead worker and another job's dead worker go; live processes' folders stay,
    # this job's too (a Tune trial of the same job still writing); names not ours are untouched
    assert sorted(removed) == [f"{STAGING_PREFIX}01000000_{dead}_a",
                               f"{STAGING_PREFIX}02000000_{dead}_b"]
    assert sorted(os.listdir(tmp_path)) == sorted([
        f"{STAGING_PREFIX}01000000_{live}_c", f"{STAGING_PREFIX}02000000_{live}_d",
        "ray_dhp_ckpt_not_ours", "other"])


def test_sweep_waits_only_for_the_runs_own_workers(tmp_path):
    """Tune trials share a job: a finished trial's sweep waits for its own workers' exit, not
    for the workers of a trial still training (it waited ``wait_s`` for them before)."""
    import time

    other_trial = os.getpid()  # a live worker of the same job, not this run's
    (tmp_path / f"{STAGING_PREFIX}01000000_{other_trial}_x").mkdir()
    t0 = time.monotonic()
    assert sweep_staging("01000000", wait_s=5.0, root=str(tmp_path), wait_pids=[1234567]) == []
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert sweep_staging("01000000", wait_s=1.0, root=str(tmp_path)) == []  # unknown: waits
    assert time.monotonic() - t0 >= 1.0
    assert os.listdir(tmp_path) == [f"{STAGING_PREFIX}01000000_{other_trial}_x"]


def test_reaping_kills_only_ray_worker_processes():
    me = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert reap_ray_processes([me.pid], timeout_s=0.2) == []  # not a ray:: process
        assert me.poll() is None
    finally:
        me.kill()
        me.wait()


def test_waiting_message_names_what_is_wanted_and_what_is_free():
    msg = waiting_message([{"CPU": 1}] * 4, 30, {"CPU": 2.0}, {"CPU": 8.0}, 600)
    assert "4 bundles of {'CPU': 1} (CPU 4 in all)" in msg
    assert "CPU 2 free of 8 (other runs hold the rest)" in msg
    assert "gives up after placement_timeout_s=600 s" in msg
    small = waiting_message([{"CPU": 1, "GPU": 1}] * 2, 60, {"CPU": 8.0}, {"CPU": 8.0}, None)
    assert "GPU 0 free of 0 (the cluster is smaller than the layout" in small
    assert "waits until room appears" in small
