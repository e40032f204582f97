"""ZeRO stage 3's working set: the bytes FSDP2 holds *unsharded* while a module's forward and
backward run (`ray_dhp.parallel.fsdp`, `ray_dhp.models.fsdp_vision`), on top of the rank's state
and activations. What ``ray-dhp plan`` adds as ``ZeRO-3 working set``.

FSDP2 with the engine's explicit prefetch (each unit's pre-forward all-gathers the next unit,
each pre-backward the previous one; ``reshard_after_forward``; at most one reduce-scatter input
in flight), unit by unit, for a module whose units hold ``P_i`` elements in forward order
(``pb``, ``gb``, ``rb``: bytes per element of the gathered weights, their unsharded gradients
and the reduce dtype):

* forward of unit ``i``: its weights and the next unit's all-gather output, ``(P_i + P_{i+1}) pb``;
  its all-gather copied out into the weights, ``2 P_i pb``;
* backward of unit ``i``: its weights, the previous unit's prefetched weights, its gradients as
  autograd makes them and the reduce-scatter input of the unit that finished before it
  (``P_{i+1} rb``, freed when unit ``i`` reduces): ``(P_i + P_{i-1}) pb + P_i gb + P_{i+1} rb``;
  then its own reduce-scatter input beside its gradients: ``P_{i-1} pb + P_i (gb + rb)``;
* the root's parameters (those no unit holds: the final norm) stay gathered from its forward to
  the end of the backward (FSDP2 does not reshard the root after the forward), with their
  gradients: ``R (pb + gb)``;
* every micro-batch reduce-scatters (`ray_dhp.parallel.fsdp`), so gradient accumulation adds
  no unsharded gradients (under the bf16 policies the shards then accumulate in fp32: the
  state's, `ray_dhp.planning.memory_state.rank_state` with ``micro_batches``).

A rank hosting two ZeRO-3 modules (collocated vision and text) runs them one after the other:
the larger working set counts, plus the other's root weights. Measured on CPU by sampling what
FSDP2 holds at every one of its hooks (`benchmarks.fsdp_sampling`, the plan-accuracy rows
at ZeRO-3): equal to this. The sum with the activations is an upper bound (the backward
frees activations as it makes these gradients). Not modelled: a sub-module kept as a unit of its
own for another dtype (an fp32 router, `ray_dhp.parallel.fsdp._odd_dtype`), gathered by its own
pre-forward: it counts with its parent unit here.
"""

from __future__ import annotations


def unit_peak(units: list, root: int, pb: int, gb: int, rb: int) -> int:
    """Bytes one ZeRO-3 module holds unsharded at its peak (module docstring): ``units``, its
    units' elements in forward order; ``root``, the root's."""
    if not units:
        return root * (pb + gb)
    p = list(units) + [0]  # p[n] = p[-1 of the list] = 0: no unit after the last, before the first
    fwd = max(max((p[i] + p[i + 1]) * pb, 2 * p[i] * pb) for i in range(len(units)))
    bwd = 0
    for i in range(len(units)):
        before, pending = p[i - 1] if i else 0, p[i + 1]
        bwd = max(bwd, 2 * p[i] * pb + pending * rb,
                  (p[i] + before) * pb + p[i] * gb + pending * rb,
                  before * pb + p[i] * (gb + rb))
    return max(fwd + root * pb, bwd + root * (pb + gb))


def module_units(counts, topology, text: bool) -> tuple:
    """``(units, root)`` of the text module (``text``) or the ViT: elements per FSDP2 unit a rank
    gathers (a TP shard's; an experts tensor's 1/ep), and the root's."""
    if text:
        tp, ep = topology.text.inner, topology.text_expert_parallel
        sizes = [q.local(tp) // (ep if q.expert else 1) for q in counts.text_sizes
                 if not q.audio or topology.encoder("audio") is None]
        index = counts.text_units
    else:
        sizes, index = [q.numel for q in counts.vision_params], counts.vision_units
    units = [sum(sizes[j] for j in u if j < len(sizes)) for u in index]
    return units, sum(sizes) - sum(units)


def fsdp_working_bytes(counts, topology, rank: int, policy) -> int:
    """The ZeRO-3 working set of ``rank`` (module docstring): 0 where it hosts no module at
    stage 3."""
    import torch

    pb = gb = policy.weight_bytes()
    rb = torch.empty((), dtype=policy.reduce_dtype).element_size()
    peaks, roots = [], []
    for mod, text in ((topology.vision, False), (topology.text, True)):
        if not mod.hosts(rank) or mod.zero_stage != 3:
            continue
        units, root = module_units(counts, topology, text)
        peaks.append(unit_peak(units, root, pb, gb, rb))
        roots.append(root * pb)
    if not peaks:
        return 0
    top = peaks.index(max(peaks))
    return peaks[top] + sum(roots) - roots[top]
