"""Shared fixtures of the Ray Train end-to-end tests."""

import pytest
import ray
import torch

from tests.ray import shared_runs


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


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The data and the run alone: the same layout by the engine on spawned ranks (fp64)."""
    from ray_dhp.config.train_loop import TrainLoopConfig
    from tests.distributed.parity import make_steps, run_engine
    from tests.ray.private_run import LOOP  # private_run.py's own hyper-parameters
    from tests.ray.shared_runs import FAMILY, LAYOUT

    cfg = TrainLoopConfig(**LOOP)
    tmp = tmp_path_factory.mktemp("alone")
    steps = make_steps(tmp, FAMILY, cfg)
    ref = run_engine(FAMILY, LAYOUT, cfg, steps, torch.float64)
    return tmp / f"data_{FAMILY}" / "data.jsonl", [h["loss"] for h in ref["history"]]


@pytest.fixture(autouse=True)
def no_stray_runs():
    """A failing test must not leave its runs (paused forever, or their private Rays) behind:
    everything started with a temp folder of this test's (`tests.ray.shared_runs.env_for`) is
    killed at teardown."""
    before = shared_runs.started()
    yield
    shared_runs.kill_started(before)
