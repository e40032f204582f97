"""The one spawn helper: run a test body on N gloo ranks (CPU), collecting per-rank results.

Usage::

    def body(rank, world_size, arg):      # module-level (picklable) function
        ...                               # torch.distributed is initialised (gloo)
        return some_picklable_result

    results = run_on_ranks(body, world_size=4, args=(arg,))   # list indexed by rank

An exception on any rank fails the test with that rank's traceback. The process handling lives
in `ray_dhp.launch` (shared with the benchmarks).
"""

from __future__ import annotations

from ray_dhp.launch import free_port, spawn  # noqa: F401


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank."""
    try:
        return spawn(fn, world_size, args, backend="gloo", threads=1, timeout_s=timeout_s)
    except RuntimeError as e:
        raise AssertionError(f"distributed test body failed\n{e}") from None
