"""`ray-dhp train`, a Ray Tune sweep and `ray job submit`, end to end on CPU."""

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ray_dhp.cli import main
from tests.ray.machine import stop_private_head

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")


def _history(run_dir: Path) -> list:
    lines = (run_dir / "ray_dhp_metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_cli_train_with_overrides_end_to_end(ray_start, fast_reports, tmp_path, capsys):
    rc = main(["train", TINY, "optim.num_steps=4", "optim.log_every=2", "data.demo_samples=16",
               f"run.storage_path={tmp_path}", "run.name=cli_e2e", "optim.lr=3e-3"])
    assert rc == 0
    assert "[ray_dhp] done: loss" in capsys.readouterr().out
    hist = _history(tmp_path / "cli_e2e")
    assert [m["step"] for m in hist] == [1, 2, 4]
    assert all(math.isfinite(m["loss"]) for m in hist)
    assert (tmp_path / "cli_e2e" / "demo_data" / "data.jsonl").exists()


def test_tune_sweep_returns_the_better_trial(ray_start, fast_reports, tmp_path):
    from ray import tune

    from ray_dhp.tune import sweep

    grid = sweep(TINY, {"optim.lr": tune.grid_search([1e-6, 3e-3])},
                 overrides=["optim.num_steps=3", "optim.log_every=10", "data.demo_samples=16",
                            "vision.sequence_parallel=1", "text.tensor_parallel=1",  # 1 worker each
                            f"run.storage_path={tmp_path}", "run.name=sweep"])
    assert len(grid) == 2 and not grid.errors
    losses = {r.config["optim.lr"]: r.metrics["loss"] for r in grid}
    best = grid.get_best_result()
    assert best.config["optim.lr"] == 3e-3
    assert best.metrics["loss"] == min(losses.values()) < losses[1e-6]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_dashboard(url: str, head: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert head.poll() is None, "ray start --head exited early"
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError("the Ray dashboard did not come up")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ray", path=os.path.dirname(sys.executable)) is None,
                    reason="needs the ray CLI (ray[default]) next to this python")
def test_ray_job_submit_runs_the_cli_to_succeeded(tmp_path):
    """A private head (own port, temp dir, process group) that the test stops itself: it never
    runs `ray stop`, which would stop every Ray on the machine (the session's too)."""
    bindir = os.path.dirname(sys.executable)
    short = tempfile.mkdtemp(prefix="rdhp", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",  # Ray 2.60 CLI clients default to tokens
           "PATH": f"{bindir}:{os.environ['PATH']}", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}
    env.pop("RAY_ADDRESS", None)
    dash = _free_port()
    head = subprocess.Popen(
        [f"{bindir}/ray", "start", "--head", "--block", f"--port={_free_port()}",
         "--num-cpus=8", f"--temp-dir={short}", "--include-dashboard=true",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
         # the agents' fixed default ports are taken when the suite's own Ray runs beside it
         # (the job agent then never registers: "No available agent to submit job")
         *(f"--{name}={_free_port()}" for name in (
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "ray-client-server-port"))],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{dash}"
    try:
        _wait_for_dashboard(url, head)
        cli = "ray-dhp" if shutil.which("ray-dhp", path=bindir) else "python -m ray_dhp"
        submit = [f"{bindir}/ray", "job", "submit", "--address", url, "--working-dir", str(ROOT),
                  "--", *cli.split(), "train", "examples/tiny.yaml", "optim.num_steps=3",
                  "optim.log_every=3", "data.demo_samples=16", f"run.storage_path={tmp_path}",
                  "run.name=job"]
        # The dashboard answers before the node's job agent has registered with it; until then
        # Ray refuses submissions ("No available agent"), so retry for a while (loaded machine).
        deadline = time.time() + 120
        while True:
            proc = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600)
            out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
            if proc.returncode == 0 or "No available agent" not in out or time.time() > deadline:
                break
            time.sleep(2)
        assert proc.returncode == 0, out[-4000:]
        assert "succeeded" in out.lower() and "[ray_dhp] done: loss" in out, out[-4000:]
        assert [m["step"] for m in _history(tmp_path / "job")] == [1, 3]
    finally:
        stop_private_head(head, short)
