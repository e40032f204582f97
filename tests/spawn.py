"""The one spawn helper: run a test body on N gloo ranks (CPU), collecting per-rank results.

Every body runs under the NCCL twin (`tests.nccl_twin`): point-to-point and collectives (ours,
DTensor's and FSDP2's) must follow NCCL's ordering rules, or the test fails naming the
operations. ``RAY_DHP_NCCL_TWIN=0`` turns it off.

Usage::

    def body(rank, world_size, arg):      # module-level (picklable) function
        ...                               # torch.distributed is initialised (gloo)
        return some_picklable_result

    results = run_on_ranks(body, world_size=4, args=(arg,))   # list indexed by rank

An exception on any rank fails the test with that rank's traceback. The process handling lives
in `ray_dhp.train.launch` (shared with the benchmarks).

The ranks are forked from a forkserver (``start_method="forkserver"``, started once per pytest
process) that has imported `PRELOAD`: torch, transformers' model modules, ray_dhp's engine and
the NCCL twin, so a rank starts in a fraction of a second instead of re-importing them (seconds
per rank, the bulk of a distributed test on a 2-core machine). Each rank is still a new process
with the caller's environment. ``RAY_DHP_TEST_START=spawn`` spawns fresh interpreters instead.

Each rank runs ``torch.set_num_threads(rank_threads())``: 1 unless the environment variable
``RAY_DHP_TEST_THREADS`` says otherwise (the suite must pass at 1 and at 2 threads; with it set,
tests/conftest.py also sets the pytest process's own thread count, where the references run).
"""

from __future__ import annotations

import os

from ray_dhp.train.launch import free_port, spawn  # noqa: F401

THREADS_ENV = "RAY_DHP_TEST_THREADS"
TWIN_ENV = "RAY_DHP_NCCL_TWIN"
START_ENV = "RAY_DHP_TEST_START"

# What the forkserver imports before it forks a rank: what (nearly) every rank body imports.
# A module missing here is imported by the rank itself (slower, never wrong); a name that fails
# to import is skipped by multiprocessing. Keep it free of modules that start threads at import.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.utils.serialization",
    "torch.profiler",
    "torch.profiler._cupti_monitor",
    "transformers",
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe",
    "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe",
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "pytest",
    "ray_dhp.config.train_loop",
    "ray_dhp.parallel.topology",
    "ray_dhp.parallel.mesh",
    "ray_dhp.parallel.text_sp",
    "ray_dhp.step.engine",
    "ray_dhp.step.reference",
    "ray_dhp.models",
    "ray_dhp.models.moe",
    "ray_dhp.checkpointing.checkpoint",
    "ray_dhp.data.loader",
    "ray_dhp.data.audio",
    "ray_dhp.data.sampler",
    "ray_dhp.data.reading",
    "ray_dhp.demo",
    "tests.twin_collectives",
    "tests.nccl_twin",
    "tests.distributed.parity",
)


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
    start = os.environ.get(START_ENV, "forkserver")
    preload = PRELOAD if start == "forkserver" else ()
    try:
        return spawn(fn, world_size, args, backend="gloo", threads=rank_threads(), timeout_s=timeout_s,
                     start_method=start, preload=preload)
    except RuntimeError as e:
        raise AssertionError(f"distributed test body failed\n{e}") from None
