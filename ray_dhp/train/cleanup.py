"""What a run leaves on the machines, and taking it away (workers' staging folders, actors).

Checkpoint shards are written by each worker into a local staging folder and then handed to
``ray.train.report``, which copies them into the run's storage. A worker killed mid-write (a
failure, an abort on Ctrl-C/SIGTERM, a lost node) never removes its folder. Staging folders are
therefore named ``ray_dhp_ckpt_<job>_<pid>_...`` (`staging_dir`), and after ``fit()`` returns or
fails the driver runs `sweep_staging` on every alive node: folders whose worker process is gone
are removed (this run's workers are given a few seconds to exit); a live process's folder is
never touched.

`wait_for_owned_actors` lets the driver wait until the actors it started (the Train controller and
what that started: workers, dataset manager, placement-group cleaner) have exited, after
``fit()`` and before it shuts a private Ray down, so no orphaned process outlives the run; `reap_ray_processes` then makes sure the private Ray's worker processes
are gone after ``ray.shutdown()`` (they can linger for a minute once their raylet is gone).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

__all__ = ["staging_dir", "sweep_staging", "sweep_staging_on_all_nodes", "owned_actors",
           "wait_for_owned_actors", "owned_actor_pids", "reap_ray_processes", "STAGING_PREFIX"]

STAGING_PREFIX = "ray_dhp_ckpt_"


def _job_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_job_id() if ray.is_initialized() else "nojob"
    except Exception:
        return "nojob"


def staging_dir() -> tempfile.TemporaryDirectory:
    """A checkpoint staging folder named after this process's Ray job and pid."""
    return tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{_job_id()}_{os.getpid()}_")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_staging(job_id: str, wait_s: float = 15.0, root: str | None = None,
                  wait_pids=None) -> list:
    """Remove staging folders under ``root`` (the temp dir) of any job whose process is
    gone, waiting up to ``wait_s`` for the processes of ``job_id`` (this run's workers, being
    stopped) to exit — only those in ``wait_pids`` when given: Tune trials share a job, and a
    trial that finished must not wait for the workers of one still training; a live process's
    folder is never touched. Returns the folders removed."""
    root = root or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(STAGING_PREFIX)]
    except OSError:
        return []
    deadline = time.monotonic() + wait_s
    removed = []
    for name in names:
        job, _, rest = name[len(STAGING_PREFIX):].partition("_")
        pid_s = rest.partition("_")[0]
        if not pid_s.isdigit():
            continue
        pid = int(pid_s)
        if job == job_id and (wait_pids is None or pid in wait_pids):  # exiting: a moment
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        if _pid_alive(pid):  # a live process (another run, a Tune trial of the same job)
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed


def sweep_staging_on_all_nodes(job_id: str, timeout_s: float = 30.0, wait_pids=None) -> list:
    """`sweep_staging` on every alive node of the connected cluster (a zero-CPU task pinned to
    each; ``wait_pids``: the run's worker processes, the only ones waited for); returns the
    folders removed on the nodes that answered within ``timeout_s`` (a node lost meanwhile is
    not waited for: its task is cancelled). Never raises: clean-up must not mask the run's own
    result."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        task = ray.remote(num_cpus=0, max_retries=0)(sweep_staging)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(job_id, wait_pids=wait_pids)
            for n in ray.nodes() if n.get("Alive")]
        done, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in late:
            ray.cancel(ref, force=True)
        return ray.get(done)
    except Exception:
        return []


def _my_address() -> tuple:
    """(ip, port) of this process's Ray core worker: the owner address of what it creates."""
    import ray
    from ray.core.generated.common_pb2 import Address

    ref = ray.put(None)
    addr = Address.FromString(ray._private.worker.global_worker.core_worker.get_owner_address(ref))
    return addr.ip_address, addr.port


def owned_actors() -> dict:
    """``{actor id: info}`` of every actor this process started, directly or through its
    actors (the Train controller, its workers, its cleaner, ...), from the GCS actor table.
    Named detached actors (cluster-wide singletons of Ray's, such as Ray Data's
    ``AutoscalingCoordinator``, shared by every run on the cluster) are left out."""
    import ray._private.state as gcs_state

    table = gcs_state.actors()
    owners = {_my_address()}
    out: dict = {}
    grew = True
    while grew:
        grew = False
        for aid, a in table.items():
            owner = (a["OwnerAddress"]["IPAddress"], a["OwnerAddress"]["Port"])
            if aid in out or owner not in owners or (a["IsDetached"] and a["Name"]):
                continue
            out[aid] = a
            owners.add((a["Address"]["IPAddress"], a["Address"]["Port"]))
            grew = True
    return out


def wait_for_owned_actors(ignore=frozenset(), timeout_s: float = 20.0) -> list:
    """Wait until every actor this process started (`owned_actors`, less the ids in
    ``ignore``: the caller's own actors from before) is dead, or ``timeout_s``; returns the
    class names still alive."""
    import ray

    if not ray.is_initialized():
        return []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = sorted(a["ActorClassName"] for aid, a in owned_actors().items()
                          if aid not in ignore and a["State"] != "DEAD")
        except Exception:
            return []
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.25)


def owned_actor_pids() -> list:
    """Process ids of the actors this process started (any state; 0s left out)."""
    return sorted({a["Pid"] for a in owned_actors().values() if a.get("Pid")})


def _ray_process_running(pid: int) -> bool:
    """A live (not zombie) process of Ray's (``ray::...`` command line) with this pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return state != "Z" and cmd.startswith(b"ray::")


def reap_ray_processes(pids: list, timeout_s: float = 10.0) -> list:
    """Wait up to ``timeout_s`` for Ray worker processes ``pids`` to exit, then SIGKILL those
    still running (a private Ray's workers that outlived its shutdown); returns the killed."""
    import signal

    deadline = time.monotonic() + timeout_s
    while any(_ray_process_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = []
    for p in pids:
        if _ray_process_running(p):
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except OSError:
                pass
    return killed
