"""Run a function on N local ranks without Ray (gloo on CPU, NCCL on GPU).

``spawn(fn, world_size, args)`` runs ``fn(rank, world_size, *args)`` in fresh processes with
torch.distributed initialised and returns the per-rank results (they travel as bytes). An
exception on any rank is re-raised with that rank's traceback. Used by the test suite
(`tests/spawn.py`) and the benchmarks, and handy to debug a layout on one machine.

How the ranks start (``start_method``); each rank is a new process either way:

* ``"spawn"`` (the default): every rank is a fresh interpreter that imports torch, transformers
  and the function's module itself (seconds per rank on a small machine, paid by every call).
* ``"forkserver"``: every rank is forked from one server process, started once per parent
  process, that has imported ``preload`` (module names) already; a rank then imports only what
  the server lacks. The server runs no threads when it forks (it imports with
  ``OMP/OPENBLAS/MKL_NUM_THREADS=1``, see `ray_dhp.train.forkserver_env`); each rank gets the
  caller's current environment (not the server's) and sets its own torch threads, as with
  ``"spawn"``. The server and its preload list are fixed at the first forkserver call of the
  process (Python's multiprocessing keeps one server per process); later ``preload`` lists
  are ignored. The test suite uses it (`tests/spawn.py`); the benchmarks keep ``"spawn"``.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHODS = ("spawn", "forkserver")


def _worker(rank, world_size, port, backend, threads, fn, args, queue, env=None):
    if env is not None:  # forked from the forkserver: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if backend == "nccl":  # CUDA tensors over NCCL, host tensors over gloo (see backend.py);
            backend = "cpu:gloo,cuda:nccl"  # "cuda:nccl" alone: NCCL only (CPU tensors refused)
        _init_group(backend, rank, world_size, port)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, not tensors: shared-memory handles die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_group(backend: str, rank: int, world_size: int, port: int) -> None:
    """The default group, then a wait until every rank has it: gloo's connect handshake of a late
    rank fails ("Connection closed by peer") when a peer that already counts the pair as
    connected returns at once and tears its group down (a body without collectives; ~1 start in
    200 when the ranks start together, as forked from the forkserver). The store is the one
    ``init_method="env://"`` would make (multi-tenant: a body that destroys the group may init
    it again on the same port)."""
    import torch.distributed as dist

    timeout = timedelta(minutes=20)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    store.set(f"launch/up/{rank}", "1")
    store.wait([f"launch/up/{r}" for r in range(world_size)])


def spawn(fn, world_size: int, args: tuple = (), *, backend: str = "gloo", threads: int = 1,
          timeout_s: float = 1800.0, start_method: str = "spawn", preload: tuple = ()) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; results by rank.
    ``start_method``: "spawn" or "forkserver" (with ``preload``), see the module docstring."""
    import torch.multiprocessing as mp

    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: expected one of {START_METHODS}")
    if preload and start_method != "forkserver":
        raise ValueError("preload is for start_method='forkserver'")
    ctx = mp.get_context(start_method)
    env = None
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["ray_dhp.train.forkserver_env", *preload])
        env = dict(os.environ)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, threads, fn, args, queue, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        _collect(procs, queue, results, errors, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout_s)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed\n" + "\n".join(errors))
    return results


def _collect(procs, queue, results, errors, timeout_s: float) -> None:
    """Gather one result per rank; stop at the first error, at a rank that died without
    reporting (killed, segfault, OOM: its exit code is named) or after ``timeout_s``."""
    import queue as queue_mod
    import time

    import torch

    deadline, pending = time.monotonic() + timeout_s, len(procs)
    while pending:
        try:
            rank, status, out = queue.get(timeout=1.0)
        except queue_mod.Empty:
            done = {r for r, v in enumerate(results) if v is not None}
            dead = [(r, p.exitcode) for r, p in enumerate(procs)
                    if r not in done and p.exitcode not in (None, 0)]
            if dead:
                errors.append("; ".join(f"rank {r} died with exit code {c}" for r, c in dead))
                return
            if time.monotonic() > deadline:
                errors.append(f"no result from {pending} rank(s) within {timeout_s:.0f} s")
                return
            continue
        if status != "ok":
            errors.append(f"rank {rank}:\n{out}")
            return
        results[rank] = torch.load(io.BytesIO(out), weights_only=False)
        pending -= 1
