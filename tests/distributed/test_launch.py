"""The local spawner reports results by rank, re-raises a rank's traceback and names a rank that
dies without reporting or does not answer in time, with both start methods ("spawn", the
default, and "forkserver", which the suite's `tests.spawn.run_on_ranks` uses)."""

import os
import time

import pytest

from ray_dhp.train.launch import spawn
from tests.spawn import PRELOAD

FORK = dict(start_method="forkserver", preload=PRELOAD)


def _rank_times_world(rank, world):
    return rank * world


def _second_rank_dies(rank, world):
    if rank == 1:
        os._exit(9)
    return rank


def _second_rank_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one's own error")
    return rank


def _second_rank_hangs(rank, world, pid_file):
    if rank == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return rank


def _env_and_threads(rank, world):
    import torch

    return os.environ.get("RAY_DHP_LAUNCH_PROBE"), torch.get_num_threads(), os.getpid()


def test_results_come_back_by_rank():
    assert spawn(_rank_times_world, 3) == [0, 3, 6]


def test_a_dead_rank_is_named_not_waited_for():
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 9"):
        spawn(_second_rank_dies, 2, timeout_s=120)


def test_forkserver_results_come_back_by_rank_each_rank_a_new_process():
    assert spawn(_rank_times_world, 3, **FORK) == [0, 3, 6]
    first, second = spawn(_env_and_threads, 2, **FORK), spawn(_env_and_threads, 2, **FORK)
    pids = {pid for _, _, pid in first + second}
    assert len(pids) == 4 and os.getpid() not in pids


def test_forkserver_ranks_get_the_callers_environment_and_threads(monkeypatch):
    monkeypatch.setenv("RAY_DHP_LAUNCH_PROBE", "first")
    assert [r[:2] for r in spawn(_env_and_threads, 2, threads=2, **FORK)] == [("first", 2)] * 2
    monkeypatch.setenv("RAY_DHP_LAUNCH_PROBE", "second")  # the server started before this
    assert [r[:2] for r in spawn(_env_and_threads, 2, threads=1, **FORK)] == [("second", 1)] * 2


def test_the_forkserver_runs_no_threads_when_it_forks():
    import multiprocessing.forkserver as forkserver

    spawn(_rank_times_world, 1, **FORK)
    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None
    assert len(os.listdir(f"/proc/{pid}/task")) == 1


def test_forkserver_a_raising_rank_fails_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:\n.*_second_rank_raises.*ValueError: rank one's own error"):
        spawn(_second_rank_raises, 2, timeout_s=120, **FORK)


def test_forkserver_a_dead_rank_is_named_not_waited_for():
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 9"):
        spawn(_second_rank_dies, 2, timeout_s=120, **FORK)


def test_forkserver_a_silent_rank_times_out_and_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no result from 1 rank\(s\) within 3 s"):
        spawn(_second_rank_hangs, 2, (str(pid_file),), timeout_s=3, **FORK)
    assert time.monotonic() - t0 < 60
    pid = int(pid_file.read_text())
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the silent rank {pid} is still running")


def test_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method"):
        spawn(_rank_times_world, 1, start_method="fork")
