"""The optimizer step's peak from torch's profiler on CPU (`benchmarks.measure.measure_engine_step`):
the running sum of the allocator's events, with the frees the profiler cannot record on
another thread (gloo's workers) put back (`allocation_deltas`)."""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


STEP_MARK = "ray_dhp.measure.optimizer_step"


def step_peak_bytes(prof, base: int, mark: str = STEP_MARK, alive=None) -> int:
    """``base`` + the highest running sum of the CPU allocator's allocations and frees recorded
    by ``prof`` (``profile(profile_memory=True, record_shapes=True)``) inside the
    ``record_function(mark)`` region, summed from the start of the profile, with the frees the
    profiler cannot record (`allocation_deltas`; ``alive``: data pointers of the storages still
    reachable when the profile ended). Frees of blocks allocated before the profile started are
    not recorded (torch warns): the figure can only be too high by those."""
    deltas, (t0, t1) = allocation_deltas(prof, mark, alive)
    cur, peak = 0, None
    for t, nbytes in deltas:
        cur += nbytes
        if t0 <= t <= t1:
            peak = cur if peak is None else max(peak, cur)
    return base + (peak or 0)


def allocation_deltas(prof, mark: str, alive=None) -> tuple:
    """``([(time_ns, bytes), ...] in time order, (start, end) of the region named mark)``: the
    allocation events of ``prof``'s event tree, plus the frees it cannot record.

    The profiler records an allocator event only on the thread it profiles (in torch 2.13
    ``profile_all_threads`` records no memory events at all), so a block freed on another thread
    stays live in its sum. gloo's worker threads do that: a collective's work holds its tensors
    (the input, the output, gloo's own copy of the input made inside the ``c10d::`` op) and the
    block is freed by whichever thread drops the last reference, the worker or the caller: a
    race, so which rank keeps which blocks in the sum varies between runs (up to ~260 KB in the
    ZeRO-3 row, FSDP2's all-gather outputs and reduce-scatter inputs). So: a block whose address
    is handed out again before its free is recorded was freed, at the latest then; a block a
    ``c10d::`` op made or was handed, with no recorded free, that no Python object references
    when the profile ends (``alive``: storage data pointers; None: take none as freed) was freed
    by a worker when that op's work was done: counted freed at the end of the last such op."""
    from torch._C._profiler import _EventType

    timeline, region = [], None  # (time, order, kind, payload)

    def ptrs(inputs):
        for x in inputs:
            if isinstance(x, list):
                yield from ptrs(x)
            elif getattr(x, "storage_data_ptr", None):
                yield x.storage_data_ptr

    def walk(ev, c10d_end):
        nonlocal region
        if ev.tag == _EventType.Allocation:
            x = ev.extra_fields
            timeline.append((ev.start_time_ns, int(x.alloc_size > 0), x.alloc_size, x.ptr, c10d_end))
            return
        if ev.name == mark:
            region = (ev.start_time_ns, ev.end_time_ns)
        if ev.name.startswith("c10d::") and c10d_end is None:
            c10d_end = ev.end_time_ns
            for p in ptrs(ev.extra_fields.inputs if ev.tag == _EventType.TorchOp else []):
                timeline.append((ev.start_time_ns, 2, 0, p, c10d_end))  # handed to a collective
        for c in ev.children:
            walk(c, c10d_end)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    timeline.sort(key=lambda e: e[:2])  # at one instant: frees, allocations, then uses
    deltas, live = [], {}  # ptr -> [bytes, end of the last collective that made or used it]
    for t, kind, nbytes, ptr, c10d_end in timeline:
        if kind == 2:
            if ptr in live:
                live[ptr][1] = max(live[ptr][1] or 0, c10d_end)
            continue
        if nbytes > 0:
            if ptr in live:  # handed out again: the block there was freed unseen
                old, end = live.pop(ptr)
                deltas.append((t if end is None else min(end, t), -old))
            live[ptr] = [nbytes, c10d_end]
        else:
            live.pop(ptr, None)
        deltas.append((t, nbytes))
    if alive is not None:
        deltas += [(end, -old) for p, (old, end) in live.items() if end is not None and p not in alive]
    return sorted(deltas, key=lambda d: (d[0], d[1] > 0)), region


def python_storages() -> set:
    """Data pointers of the storages of every tensor a Python object references now (DTensors:
    their local tensors'): what `step_peak_bytes` takes as still alive."""
    import gc

    out = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                out.add(_local(o).untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
    return out
