"""Shared fixtures of the Ray Train end-to-end tests."""

import pytest
import ray


@pytest.fixture(scope="session")
def ray_start():
    """One local Ray for the session (8 logical CPUs so 2 cores can host several workers);
    reuses an already initialised Ray and shuts down only what it started."""
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8)
    yield
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def fast_reports(monkeypatch):
    """Poll worker reports every 0.25 s instead of 2 s (RAY_TRAIN_* vars reach the controller)."""
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")


def stop_private_head(head, temp_dir: str) -> None:
    """Stop a test's own `ray start --head --block` (started with ``start_new_session=True``) by
    its process group, and remove its temp dir. Never `ray stop`: that stops every Ray on the
    machine, the session's too."""
    import os
    import shutil
    import signal
    import subprocess

    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
