"""What FSDP2 holds unsharded on a rank, sampled at every one of its hooks
(`benchmarks.measure.measure_engine_step`'s ``fsdp_work``; planned by
`ray_dhp.planning.fsdp_working`).

At the entry and exit of every ``FSDPParamGroup`` pre-/post-forward, pre-/post-backward, unshard
and wait, and right after each reduce-scatter copy-in, the bytes of: every unit's gathered
weights (the ``all_gather_outputs`` storages, 0 once resharded), an all-gather issued and not yet
copied out (its flat output), every unsharded gradient (autograd's on the gathered weights, or
an accumulated one kept between micro-batches) and the reduce-scatter inputs in flight. Each
storage counts once. The peak over those samples is the figure. Deterministic: it reads FSDP2's
own state, not the allocator, so gloo's worker-thread frees (`benchmarks.alloc_events`) do not
move it. What it cannot see: gloo's own copies of a collective's buffers (CPU only) and a
transient inside one hook between two samples (a copy-out's flat buffer beside its outputs is
sampled at the wait's exit only after the flat buffer is freed).
"""

from __future__ import annotations

import contextlib

HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "unshard",
         "wait_for_unshard")


def _nbytes(t, seen: set) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    t = t._local_tensor if isinstance(t, DTensor) else t
    s = t.untyped_storage()
    if not s.nbytes() or s.data_ptr() in seen:
        return 0
    seen.add(s.data_ptr())
    return s.nbytes()


def resident(groups: list) -> int:
    """Bytes FSDP2 holds unsharded over ``groups`` (``FSDPParamGroup`` objects) now."""
    seen, total, contexts = set(), 0, {}
    for g in groups:
        contexts[id(g.comm_ctx)] = g.comm_ctx
        for fp in g.fsdp_params:
            total += sum(_nbytes(t, seen) for t in fp.all_gather_outputs)
            up = getattr(fp, "_unsharded_param", None)
            total += _nbytes(up.grad if up is not None else None, seen)
            total += _nbytes(getattr(fp, "unsharded_accumulated_grad", None), seen)
        if g._all_gather_result is not None:
            total += _nbytes(g._all_gather_result.all_gather_output, seen)
    for ctx in contexts.values():
        for st in getattr(ctx, "reduce_scatter_states", ()):
            total += _nbytes(st.reduce_scatter_input, seen)
    return total


def fsdp_groups(modules: list) -> list:
    """The ``FSDPParamGroup`` of every FSDP2 module inside ``modules``."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                g = m._get_fsdp_state()._fsdp_param_group
                if g is not None:
                    out.append(g)
    return out


@contextlib.contextmanager
def sampling(groups: list):
    """Within the block, sample `resident` at FSDP2's hooks; yields the list of samples."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as C
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as G

    samples: list = []
    saved = {name: getattr(G.FSDPParamGroup, name) for name in HOOKS}

    def wrap(fn):
        def sampled(*args, **kwargs):
            samples.append(resident(groups))
            out = fn(*args, **kwargs)
            samples.append(resident(groups))
            return out
        return sampled

    copy_in = C.foreach_reduce_scatter_copy_in

    def copied(grads, rs_input, *args, **kwargs):  # the new input beside the gradients, which
        out = copy_in(grads, rs_input, *args, **kwargs)  # FSDP2 has taken off the weights
        seen: set = set()
        samples.append(resident(groups) + _nbytes(rs_input, seen)
                       + sum(_nbytes(g, seen) for g in grads))
        return out

    for name, fn in saved.items():
        setattr(G.FSDPParamGroup, name, wrap(fn))
    C.foreach_reduce_scatter_copy_in = copied
    try:
        yield samples
    finally:
        for name, fn in saved.items():
            setattr(G.FSDPParamGroup, name, fn)
        C.foreach_reduce_scatter_copy_in = copy_in
