"""Where each module group goes on a cluster of pools (`ray_dhp.planning.pools`), with which
degrees, ranked by tokens/s and by tokens per price unit.

**Search.** Every placement of the two module groups on the pools: collocated (one group of
vision + text on one pool) and disjoint (the vision group on pool P, the text group on pool Q,
P = Q allowed); every placement group lies on one pool. A group on a pool takes ``n`` of its
devices, ``n`` a power of two below a node or a whole number of nodes (with P = Q the two groups
together fit in the pool, and every split of the whole pool is tried as well); inside a group
every sp / tp / dp degree the size admits whose data-parallel degrees the micro-batch can feed
(a mixture-of-experts LM also at every expert-parallel degree).
Disjoint layouts are tried pipelined (when M >= 2), text without sequence parallelism; only
where memory refuses one are its variants tried, in stages, keeping the fastest that fits of
the first stage that has one: the sequential schedule and text sequence parallelism; the other
ZeRO stages (`ray_dhp.planning.recommend.zero_options`); those of its leanest variant.

**Time** is `ray_dhp.planning.cost_model`'s: a module's phases are priced on its own pool's
`Hardware` (peak x efficiency, links, memory bandwidth, devices per node; each group's ranks
fill the pool's nodes from the first), the boundary between two pools at the lower of their
inter-node bandwidths (inside one pool: as the cost model places it), and the schedule
(`ray_dhp.planning.cost_model.step_time`) puts them together.

**Memory** is `ray_dhp.planning.recommend.memory_gib` per group, checked against the group's pool:
its device memory less its margin (`ray_dhp.planning.pools.Pool.budget`).

**Tokens** per step: ``global_batch_size`` samples of the LLM's sequence (text + merged image
tokens, `ray_dhp.planning.cost_model.text_tokens_per_sample`; a resolution mix: its mean).
**Price** per hour: the devices a layout uses times their pool's price per device-hour (idle
devices of a pool are not charged to the layout); tokens per price unit = tokens/s x 3600 /
price per hour; a layout on a pool without a price has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from ray_dhp.planning.cost_model import phase_times, step_time, text_tokens_per_sample
from ray_dhp.planning.cost_types import Layout, Workload
from ray_dhp.planning.recommend import memory_gib, zero_options

__all__ = ["PoolCandidate", "recommend_pools", "group_sizes", "placements"]


@dataclass(frozen=True)
class PoolCandidate:
    """A layout on pools: ``pools`` maps each group (``vision+text``, or ``vision`` and
    ``text``) to its pool's name; ``memory_gib`` / ``headroom``: per group, the peak of its most
    loaded rank and the fraction of its device left free after the margin."""

    layout: Layout
    pools: dict
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    price_per_hour: Optional[float] = None
    memory_gib: dict = field(default_factory=dict)
    headroom: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def tokens_per_price(self) -> Optional[float]:
        """Tokens per price unit (e.g. per dollar); None without a price."""
        if self.price_per_hour is None or not self.price_per_hour > 0:
            return None
        return self.tokens_per_s * 3600 / self.price_per_hour

    def describe(self) -> str:
        on = ", ".join(f"{g} on {p}" for g, p in self.pools.items())
        return f"{self.layout.describe()} [{on}]"

    def run_file_fragment(self, pools: dict) -> dict:
        """The layout's run-file keys plus ``placement.labels``: each group's pool's labels."""
        frag = self.layout.run_file_fragment()
        labels = {}
        for group, name in self.pools.items():
            if pools[name].labels:
                labels[group.split("+")[-1]] = dict(pools[name].labels)
        if labels:
            frag["placement"]["labels"] = labels
        return frag


def group_sizes(pool, devices: Optional[int] = None) -> list:
    """Device counts a group may take on ``pool`` (module docstring), at most ``devices``."""
    cap = pool.devices if devices is None else devices
    out = {1 << k for k in range(pool.devices_per_node.bit_length()) if 1 << k < pool.devices_per_node}
    out |= {pool.devices_per_node * k for k in range(1, pool.nodes + 1)}
    return sorted(n for n in out if n <= cap)


def placements(pools) -> list:
    """``(placement, {group: pool name}, [(n_vision, n_text), ...])`` for every placement of the
    two groups on ``pools`` (module docstring); collocated sizes are ``(n, n)``."""
    out = []
    for p in pools:
        out.append(("collocated", {"vision+text": p.name}, [(n, n) for n in group_sizes(p)]))
    for p in pools:
        for q in pools:
            if p is q:
                sizes = {(a, b) for a in group_sizes(p) for b in group_sizes(p) if a + b <= p.devices}
                sizes |= {(a, p.devices - a) for a in range(1, p.devices)}
            else:
                sizes = {(a, b) for a in group_sizes(p) for b in group_sizes(q)}
            out.append(("disjoint", {"vision": p.name, "text": q.name}, sorted(sizes)))
    return out


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(placement: str, nv: int, nt: int, micro_batches: int, mb: int, config) -> list:
    """The first-choice layouts of the sizes (pipelined, no text SP; a mixture-of-experts LM also
    at every expert-parallel degree, `ray_dhp.planning.experts.expert_degrees`), without those
    whose micro-batch of ``mb`` samples cannot feed their data-parallel replicas."""
    from ray_dhp.planning.experts import expert_degrees

    sched = "pipelined" if placement == "disjoint" and micro_batches > 1 else "sequential"
    out = [Layout(placement, sched, sp, nv // sp, tp, nt // tp)
           for sp in _divisors(nv) for tp in _divisors(nt) if max(nv // sp, nt // tp) <= mb]
    return out + [replace(x, text_ep=e) for x in out for e in expert_degrees(config, x.text_dp)]


def _fallbacks(layout: Layout) -> list:
    """What to try, stage by stage, when ``layout`` does not fit: the sequential schedule and
    text SP; then the other ZeRO stages of the layout; then those of its leanest variant."""
    variants = [layout]
    if layout.schedule == "pipelined":
        variants.append(replace(layout, schedule="sequential"))
    if layout.text_tp > 1 and layout.text_ep == 1:  # as `recommend`: no text SP beside EP
        variants += [replace(x, text_sp=True) for x in list(variants)]
    stages = [variants[1:], zero_options(layout)]
    if len(variants) > 1:
        stages.append(zero_options(variants[-1]))
    return stages


def _phases(config, counts, layout: Layout, w: Workload, pv, pt, efficiency: float):
    """Phase times with vision on pool ``pv`` and text on pool ``pt`` (module docstring)."""
    from ray_dhp.planning.cost_types import Hardware

    db = w.settings.dtype_bytes
    hv = pv.hardware(efficiency, db)
    if layout.placement == "collocated" or pv is pt:
        return phase_times(config, counts, layout, w, hv)
    ht = pt.hardware(efficiency, db)
    # the text phases: the text group starting on a node of its own (vision padded to full nodes)
    text_first = replace(layout, vision_sp=1, vision_dp=_padded_vision(layout, ht.gpus_per_node),
                         vision_zero=None)
    v = phase_times(config, counts, layout, w, hv)
    t = phase_times(config, counts, text_first, w, ht)
    bw = min(hv.internode_bw, ht.internode_bw)
    c = phase_times(config, counts, layout, w, Hardware(link_bw=bw, internode_bw=bw,
                                                          latency_s=hv.latency_s))
    return replace(v, text=t.text, text_end=t.text_end, text_comm=t.text_comm,
                   boundary=c.boundary)


def _padded_vision(layout: Layout, per_node: int) -> int:
    """A vision data-parallel degree that fills whole nodes, so the text ranks after it start a
    node of their own (only the text phases of that layout are read)."""
    nv = layout.vision_sp * layout.vision_dp
    return -(-nv // per_node) * per_node


def _evaluate(config, counts, layout: Layout, w: Workload, by_group: dict, efficiency: float,
              tokens: float, memo: dict) -> PoolCandidate:
    """One layout on its pools; ``memo`` keeps the per-group memory of every layout seen (it
    does not depend on the pools)."""
    from ray_dhp.models import family_of

    names = {g: p.name for g, p in by_group.items()}
    if layout not in memo:
        try:
            family_of(config).validate_layout(config, sp=layout.vision_sp, tp=layout.text_tp,
                                              text_sp=layout.text_sp)
            family_of(config).validate_expert_parallel(config, layout.text_ep)
            memo[layout] = memory_gib(config, counts, layout, w)
        except ValueError as e:
            memo[layout] = f"model dims: {e}"
    mem = memo[layout]
    if isinstance(mem, str):
        return PoolCandidate(layout, names, reason=mem)
    pv = by_group.get("vision") or by_group["vision+text"]
    pt = by_group.get("text") or pv
    p = _phases(config, counts, layout, w, pv, pt, efficiency)
    step, _ = step_time(layout, p, w.micro_batches)
    head, over = {}, []
    for role, gib in mem.items():
        b = by_group[role].budget()
        head[role] = b.headroom(gib * 2 ** 30)
        if not b.fits(gib * 2 ** 30):
            over.append(f"{role} ranks need {gib:.1f} GiB > {b.usable_gib:.4g} GiB on {b.name}")
    topo = layout.topology()
    sizes = {"vision+text": topo.world_size} if layout.placement == "collocated" else \
        {"vision": topo.vision.size, "text": topo.text.size}
    prices = [by_group[g].price_per_device_hour for g in sizes]
    price = None if None in prices else sum(n * by_group[g].price_per_device_hour
                                            for g, n in sizes.items())
    return PoolCandidate(layout, names, step, tokens / step, price, mem, head,
                         "memory: " + "; ".join(over) if over else "")


def recommend_pools(config, pools, workload: Workload, efficiency: float = 0.4,
                    counts=None) -> list:
    """Every placement of the vision and text groups on ``pools`` (`ray_dhp.planning.pools.Pool`
    s) as `PoolCandidate` s, feasible ones first, most tokens/s first, then the dropped ones.

    Args:
        config: the model's transformers config.
        pools: the pools (`ray_dhp.planning.pools.parse_pools`).
        workload: tokens per sample, batch, micro-batches, activation settings, precision; its
            ``device_gib`` / ``margin_gib`` are not read (each pool has its own).
        efficiency: achieved fraction of the peak where a pool does not set its own.
        counts: `ray_dhp.models.sizes.ParamCounts`; None counts them on the meta device.
    """
    if workload.audio_seconds is not None:
        raise ValueError("the pool planner places vision and text groups; a model with an audio "
                         "group (audio:) is not planned on pools yet: plan it with --recommend "
                         "on one accelerator (--device).")
    if counts is None:
        from ray_dhp.models.sizes import count_params

        counts = count_params(config)
    by_name = {p.name: p for p in pools}
    tokens = workload.global_batch_size * sum(
        f * text_tokens_per_sample(config, v, workload.text_tokens) for v, f in workload.mix())
    out, memo = [], {}
    for placement, groups, sizes in placements(pools):
        by_group = {g: by_name[n] for g, n in groups.items()}
        for nv, nt in sizes:
            for lay in _layouts(placement, nv, nt, workload.micro_batches,
                                workload.micro_batch_size, config):
                out.append(_fitting(config, counts, lay, workload, by_group, efficiency, tokens,
                                    memo))
    return sorted(out, key=lambda c: (not c.feasible, math.isnan(c.step_s),
                                      -(c.tokens_per_s if not math.isnan(c.tokens_per_s) else 0)))


def _fitting(config, counts, lay, w, by_group, efficiency, tokens, memo) -> PoolCandidate:
    """``lay`` if it fits its pools, else the fastest fitting variant of the first stage of
    `_fallbacks` that has one, else ``lay`` with its reason."""
    c = _evaluate(config, counts, lay, w, by_group, efficiency, tokens, memo)
    if not c.reason.startswith("memory:"):
        return c
    for stage in _fallbacks(lay):
        fits = [x for x in (_evaluate(config, counts, f, w, by_group, efficiency, tokens, memo)
                            for f in stage) if x.feasible]
        if fits:
            return max(fits, key=lambda x: x.tokens_per_s)
    return c
