"""Seconds of one collective on the cost model's links (`ray_dhp.planning.cost_types.Hardware`):
ring all-reduce ``2 (n - 1) / n`` of the buffer, all-to-all ``(n - 1) / n``, plus a fixed latency;
NVLink bandwidth when every group lies inside a node, the inter-node bandwidth otherwise.
Shared by the cost model of every module (`ray_dhp.planning.cost_model`,
`ray_dhp.planning.cost_audio`)."""

from __future__ import annotations

__all__ = ["link_bw", "all_reduce_s", "all_to_all_s", "zero_extra_s"]


def link_bw(hw, groups, node_of=None) -> float:
    """NVLink if every group lies inside one node, else the inter-node bandwidth. ``node_of[r]``:
    the node of DHP rank ``r`` (default: consecutive ranks fill nodes of ``gpus_per_node``)."""
    node = node_of.__getitem__ if node_of is not None else (lambda r: r // hw.gpus_per_node)
    one_node = all(len({node(r) for r in g}) <= 1 for g in groups)
    return hw.link_bw if one_node else hw.internode_bw


def all_reduce_s(hw, nbytes, n, bw) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw + hw.latency_s


def zero_extra_s(n, stage, grad_bytes, weight_bytes, bw, micro_batches: int = 1) -> float:
    """Seconds of a stage-2/3 module's synchronisation per step beyond an all-reduce of its
    gradients (may be negative: stage 2 reduces instead of all-reducing; stage 3 gathers and
    reduce-scatters in each of the ``micro_batches``); 0 at stages 0-1."""
    from ray_dhp.parallel.zero import replica_bytes

    if stage < 2 or n <= 1:
        return 0.0
    return (replica_bytes(n, stage, grad_bytes, weight_bytes, micro_batches)
            - replica_bytes(n, 0, grad_bytes, weight_bytes)) / bw


def all_to_all_s(hw, nbytes, n, bw) -> float:
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + hw.latency_s
