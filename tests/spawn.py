"""The one spawn helper: run a test body on N gloo ranks (CPU), collecting per-rank results.

Usage::

    def body(rank, world_size, arg):      # module-level (picklable) function
        ...                               # torch.distributed is initialised (gloo)
        return some_picklable_result

    results = run_on_ranks(body, world_size=4, args=(arg,))   # list indexed by rank

An exception on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Serialise to bytes: tensors put on a Queue directly travel as shared-memory handles that
        # die with this process ("connection reset" in the parent).
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        for _ in range(world_size):
            rank, status, out = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout_s)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed test body failed\n" + "\n".join(errors))
    return results
