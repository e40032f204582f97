"""The one spawn helper: run a test body on N gloo ranks (CPU), collecting per-rank results.

Every body runs under the NCCL twin (`tests.nccl_twin`): point-to-point and collectives must
follow NCCL's ordering rules, or the test fails naming the operations. ``RAY_DHP_NCCL_TWIN=0``
turns it off.

Usage::

    def body(rank, world_size, arg):      # module-level (picklable) function
        ...                               # torch.distributed is initialised (gloo)
        return some_picklable_result

    results = run_on_ranks(body, world_size=4, args=(arg,))   # list indexed by rank

An exception on any rank fails the test with that rank's traceback. The process handling lives
in `ray_dhp.train.launch` (shared with the benchmarks).

Each rank runs ``torch.set_num_threads(rank_threads())``: 1 unless the environment variable
``RAY_DHP_TEST_THREADS`` says otherwise (the suite must pass at 1 and at 2 threads; with it set,
tests/conftest.py also sets the pytest process's own thread count, where the references run).
"""

from __future__ import annotations

import os

from ray_dhp.train.launch import free_port, spawn  # noqa: F401

THREADS_ENV = "RAY_DHP_TEST_THREADS"
TWIN_ENV = "RAY_DHP_NCCL_TWIN"


def rank_threads() -> int:
    """Torch threads per spawned rank: ``$RAY_DHP_TEST_THREADS`` (a positive integer), default 1."""
    value = os.environ.get(THREADS_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: expected a positive integer")
    return int(value)


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 600.0,
                 twin_timeout_s: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.
    ``twin_timeout_s``: how long the NCCL twin waits for a peer's operation (default 300 s)."""
    from tests.nccl_twin import run_under_twin

    if os.environ.get(TWIN_ENV, "1") != "0":
        fn, args = run_under_twin, (fn, args, twin_timeout_s)
    try:
        return spawn(fn, world_size, args, backend="gloo", threads=rank_threads(), timeout_s=timeout_s)
    except RuntimeError as e:
        raise AssertionError(f"distributed test body failed\n{e}") from None
