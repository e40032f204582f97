"""Run a function on N local ranks without Ray (gloo on CPU, NCCL on GPU).

``spawn(fn, world_size, args)`` runs ``fn(rank, world_size, *args)`` in fresh processes with
torch.distributed initialised and returns the per-rank results (they travel as bytes). An
exception on any rank is re-raised with that rank's traceback. Used by the test suite
(`tests/spawn.py`) and the benchmarks, and handy to debug a layout on one machine.
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


def _worker(rank, world_size, port, backend, threads, fn, args, queue):
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
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=20))
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, not tensors: shared-memory handles die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, args: tuple = (), *, backend: str = "gloo", threads: int = 1,
          timeout_s: float = 1800.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; results by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, threads, fn, args, queue))
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
