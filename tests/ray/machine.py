"""What the shared-machine tests need from the machine: another Ray cluster beside a run (a
``ray start --head`` of its own, with or without a dashboard on :8265), and what a finished run
left behind (processes by their environment, files in their temp folder)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


RAY = os.path.join(os.path.dirname(sys.executable), "ray")
DASHBOARD_PORT = 8265
# What a run may leave in its temp folder by design, not as a leak: Ray's session logs (kept by
# Ray after shutdown for post-mortems) and torch's compile cache (a cache across runs).
BY_DESIGN = ("ray", f"torchinductor_{os.environ.get('USER', 'root')}", "torchinductor_root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_answers(port: int = DASHBOARD_PORT) -> bool:
    """An HTTP server answers on ``port`` (any status: Ray 2.60's token auth answers 401)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except Exception:
        return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def neighbour_cluster(dashboard: bool = True, timeout_s: float = 240.0):
    """Another Ray cluster on this machine for the duration of the block: ``ray start --head``
    in a session of its own, its dashboard asking for :8265 (when ``dashboard``); yields once
    its GCS answers and, with a dashboard, once that answers (on :8265, or, when another Ray's
    dashboard holds :8265 already, on a free port: a state-API client that resolves :8265
    reaches another cluster either way).
    Stopped by its process group, never with ``ray stop`` (that would stop every Ray here)."""
    tmp = tempfile.mkdtemp(prefix="nb", dir="/tmp")  # short: Ray's socket paths have a limit
    port = free_port()
    # :8265 already held (another Ray's dashboard, e.g. this test session's own Ray): that is the
    # neighbour a dashboard-less run's state API reaches; this one's dashboard goes elsewhere
    # (a head asking for a taken dashboard port does not start at all).
    dash_port = free_port() if _port_open(DASHBOARD_PORT) else DASHBOARD_PORT
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
           f"--temp-dir={tmp}", f"--include-dashboard={'true' if dashboard else 'false'}",
           f"--dashboard-port={dash_port}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    with open(os.path.join(tmp, "start.log"), "w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not (_port_open(port) and (not dashboard or dashboard_answers(dash_port))):
            assert head.poll() is None, open(os.path.join(tmp, "start.log")).read()[-3000:]
            assert time.monotonic() < deadline, "the neighbour cluster did not come up"
            time.sleep(1)
        yield port
    finally:
        stop_private_head(head, tmp)


_SHORT_TMPS: list = []


def short_tmp() -> Path:
    """A fresh temp folder for one run under /tmp (short: Ray puts its AF_UNIX sockets, at most
    107 bytes of path, under the temp folder); removed at interpreter exit."""
    d = Path(tempfile.mkdtemp(prefix="dhp", dir="/tmp"))
    if not _SHORT_TMPS:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _SHORT_TMPS])
    _SHORT_TMPS.append(d)
    return d


def processes_with_tmpdir(tmpdir: str) -> list:
    """``(pid, command)`` of live (not zombie) processes whose environment has
    ``TMPDIR=tmpdir``: everything a run started with that environment spawned."""
    marker = f"TMPDIR={tmpdir}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")[:200]))
        except OSError:
            continue
    return out


def wait_no_processes(tmpdir: str, timeout_s: float = 30.0) -> list:
    deadline = time.monotonic() + timeout_s
    while (left := processes_with_tmpdir(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_processes_with_tmpdir(tmpdir: str) -> None:
    """SIGKILL everything carrying ``TMPDIR=tmpdir`` (a failed test's run and its private Ray)."""
    import signal

    for pid, _ in processes_with_tmpdir(tmpdir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def temp_leftovers(tmpdir: str) -> list:
    """Entries of a run's temp folder other than the by-design ones (`BY_DESIGN`)."""
    return sorted(n for n in os.listdir(tmpdir) if n not in BY_DESIGN)


@contextlib.contextmanager
def job_cluster(env: dict, num_cpus: int = 8, timeout_s: float = 240.0):
    """A ``ray start --head`` cluster of the test's own with its dashboard (job submission) on
    free ports (every agent port too: the defaults are taken when another Ray runs here), its
    processes started with ``env`` (a test's ``TMPDIR``, ``PYTHONPATH``, ``RAY_AUTH_MODE``:
    Ray 2.60 CLI clients default to token auth, the test's cluster has it off).
    Yields ``(gcs address, dashboard url)`` once the dashboard answers; stopped by its process
    group (never ``ray stop``), its ``--temp-dir`` removed."""
    tmp = tempfile.mkdtemp(prefix="jc", dir="/tmp")  # short: Ray's socket paths have a limit
    port, dash = free_port(), free_port()
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
           f"--temp-dir={tmp}", "--include-dashboard=true", f"--dashboard-port={dash}",
           "--dashboard-host=127.0.0.1",
           *(f"--{name}={free_port()}" for name in (
               "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
               "runtime-env-agent-port", "ray-client-server-port"))]
    with open(os.path.join(tmp, "start.log"), "w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not (_port_open(port) and dashboard_answers(dash)):
            assert head.poll() is None, open(os.path.join(tmp, "start.log")).read()[-3000:]
            assert time.monotonic() < deadline, "the test's cluster did not come up"
            time.sleep(1)
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}"
    finally:
        stop_private_head(head, tmp)


def submit_job(url: str, entrypoint: list, env: dict, *, runtime_env: dict | None = None,
               agent_wait_s: float = 180.0, timeout_s: float = 1200.0) -> tuple:
    """``ray job submit`` (waits for the job's end); ``(returncode, output without colours)``.
    Retried while the node's job agent has not registered with the dashboard yet ("No
    available agent to submit job": the dashboard answers before it)."""
    import json
    import re

    cmd = [RAY, "job", "submit", "--address", url]
    if runtime_env:
        cmd += ["--runtime-env-json", json.dumps(runtime_env)]
    cmd += ["--", *entrypoint]
    deadline = time.monotonic() + agent_wait_s
    while True:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
        if proc.returncode == 0 or "No available agent" not in out \
                or time.monotonic() > deadline:
            return proc.returncode, out
        time.sleep(2)


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


@contextlib.contextmanager
def private_cluster(prefix: str, add_nodes):
    """A private multi-raylet cluster (`ray.cluster_utils.Cluster`: a head with 1 CPU and no
    dashboard, then the nodes ``add_nodes(cluster)`` adds and returns), joined by this process;
    yields (cluster, nodes). Ray's temp folder is a short one of its own (socket paths must stay
    short; other Ray users of the machine never see this cluster). Restores the session's Ray (8
    CPUs, ``local``: never a stray cluster) afterwards if one was running."""
    import ray
    from ray.cluster_utils import Cluster

    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    short = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    old_tmp = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = short
    c = None
    try:
        c = Cluster(initialize_head=True,  # no dashboard: its port may be taken by others
                    head_node_args={"num_cpus": 1, "include_dashboard": False})
        nodes = add_nodes(c)
        ray.init(address=c.address)
        c.wait_for_nodes()
        yield c, nodes
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        if old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmp
        shutil.rmtree(short, ignore_errors=True)
        if was_running:
            ray.init(address="local", num_cpus=8)
