"""Which placement and group sizes to use: a documented cost model, ranked candidates as data.

`recommend` enumerates every layout of ``N`` workers — ``collocated`` (vision ``sp x dp`` = text
``tp x dp`` = N) and ``disjoint`` (``Nv + Nt = N``, every ``sp | Nv``, ``tp | Nt``, schedule
``sequential`` or ``pipelined``; a mixture-of-experts model: each text layout also at every
expert-parallel degree) — drops the ones the model or the batch cannot take or that do
not fit in device memory (saying why; a layout that does not fit at its default ZeRO stages is
tried at every other stage pair, `with_zero_stages`, and kept at the fastest that fits),
predicts a step time for the rest and ranks them. Nothing
here touches torch.distributed or Ray; `ray-dhp plan --recommend` prints the result.

The cost model (FLOPs, communication, schedules; its documented formulas) is
`ray_dhp.planning.cost_model`; its public names are re-exported here.

**Memory** is `ray_dhp.planning.memory`'s per-rank estimate (validated in benchmarks/memory_model.py), with
two micro-batches of vision activations alive under the pipelined schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ray_dhp.planning.cost_types import Hardware, Layout, PhaseTimes, Workload
from ray_dhp.planning.cost_model import (phase_times, replica_share, schedule_time, step_time,
                                         text_flops, vision_flops)
from ray_dhp.planning.memory import GIB, estimate_ranks

__all__ = ["Hardware", "Workload", "Layout", "PhaseTimes", "Candidate", "recommend",
           "enumerate_layouts", "schedule_time", "vision_flops", "text_flops", "replica_share",
           "phase_times", "step_time", "evaluate", "memory_gib"]


@dataclass(frozen=True)
class Candidate:
    """A layout with its predicted step time, idle fractions and peak memory per group (GiB);
    ``reason`` says why it was dropped (empty when feasible)."""

    layout: Layout
    step_s: float = math.nan
    phases: Optional[PhaseTimes] = None
    idle_fraction: dict = field(default_factory=dict)
    memory_gib: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def peak_memory_gib(self) -> float:
        return max(self.memory_gib.values(), default=math.nan)


# -- candidates ----------------------------------------------------------------------------------

def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(num_workers: int, micro_batches: int = 1, config=None,
                      audio: bool = False, context_parallel: bool = False) -> list:
    """Every collocated and disjoint layout of ``num_workers`` (pipelined only when M >= 2); with
    text TP > 1 both without and with text sequence parallelism; for a mixture-of-experts
    ``config`` each also at every expert-parallel degree its text replicas and the experts admit
    (`ray_dhp.planning.experts.expert_degrees`). ``audio``: the three-module layouts with an
    audio group (`ray_dhp.planning.cost_audio.audio_layouts`) instead. ``context_parallel``:
    also every text context-parallel degree > 1 the text ranks admit (no audio group)."""
    if audio:
        from ray_dhp.planning.cost_audio import audio_layouts

        out = audio_layouts(num_workers, micro_batches, Layout, _divisors)
    else:
        out = _layouts(num_workers, micro_batches, context_parallel)
    if config is None:
        return out
    from dataclasses import replace

    from ray_dhp.planning.experts import expert_degrees

    return out + [replace(lay, text_ep=e) for lay in out if not lay.text_sp
                  for e in expert_degrees(config, lay.text_dp)]


def _layouts(num_workers: int, micro_batches: int, context_parallel: bool = False) -> list:
    n = num_workers

    def sps(tp):
        return (False, True) if tp > 1 else (False,)

    def tcs(nt):  # (tp, cp) of nt text ranks
        return [(tp, cp) for tp in _divisors(nt)
                for cp in (_divisors(nt // tp) if context_parallel else (1,))]

    out = [Layout("collocated", "sequential", sp, n // sp, tp, n // (tp * cp), tsp, text_cp=cp)
           for sp in _divisors(n) for tp, cp in tcs(n) for tsp in sps(tp)]
    schedules = ("sequential", "pipelined") if micro_batches > 1 else ("sequential",)
    for nv in range(1, n):
        for sp in _divisors(nv):
            for tp, cp in tcs(n - nv):
                out += [Layout("disjoint", sc, sp, nv // sp, tp, (n - nv) // (tp * cp), tsp,
                               text_cp=cp)
                        for sc in schedules for tsp in sps(tp)]
    return out


def memory_gib(config, counts, layout: Layout, w: Workload) -> dict:
    """Largest per-rank estimate (GiB) of each group, from `ray_dhp.planning.memory.estimate_ranks`
    (with an audio group `ray_dhp.planning.memory_audio.estimate_module_ranks`); with a
    precision policy at least the rank's step and start-up peaks (`ray_dhp.planning.step_peak`)."""
    topo = layout.topology()
    kw = dict(vision_tokens=w.vision_tokens, text_tokens=w.text_tokens, settings=w.settings,
              state_bytes=w.state_bytes, policy=w.policy, segment_tokens=w.vision_segment,
              packing=w.packing, micro_batches=w.micro_batches)
    mb = w.micro_batch_size
    if layout.audio_dp:
        from functools import partial

        from ray_dhp.planning.memory_audio import estimate_module_ranks

        estimate = partial(estimate_module_ranks, audio=w.audio_params,
                           audio_seconds=w.audio_seconds, audio_samples=-(-mb // layout.audio_dp),
                           lm_tokens_included=True)
    else:
        estimate = estimate_ranks
    rows = estimate(config, topo, counts, samples=-(-mb // topo.vision.dp),
                    text_samples=-(-mb // topo.text.dp), **kw)  # each module its own share
    alive = 2 if layout.placement == "disjoint" and layout.schedule == "pipelined" \
        and w.micro_batches > 1 else 1  # the pipelined order keeps two encoder graphs
    out: dict = {}
    for a in rows:
        role = "+".join(a.roles)
        total = (a.state_bytes + alive * (a.vision_act + a.audio_act) + a.text_act + a.text_work
                 + a.fsdp_work)
        if w.policy is not None:  # the step and start-up peaks, as `ray-dhp plan` counts them
            from ray_dhp.planning.step_peak import rank_floor

            total = max(total, rank_floor(counts, w.audio_params if layout.audio_dp else None,
                                          topo, a.rank, w.policy, config.text_config,
                                          w.micro_batches))
        out[role] = max(out.get(role, 0.0), total / GIB)
    return out


def evaluate(config, counts, layout: Layout, w: Workload, hw: Hardware = Hardware()) -> Candidate:
    """One candidate: dropped with a reason (model dims, batch, memory) or its predicted time."""
    from ray_dhp.models import family_of

    try:
        family_of(config).validate_layout(config, sp=layout.vision_sp, tp=layout.text_tp,
                                          text_sp=layout.text_sp)
        family_of(config).validate_expert_parallel(config, layout.text_ep)
        if layout.text_cp > 1:
            from ray_dhp.parallel.context import refusal

            why = refusal(family_of(config), config, layout.text_cp, layout.text_tp,
                          text_sp=layout.text_sp)
            if why:  # beyond the heads: ring attention, priced (`ray_dhp.planning.ring_cost`)
                raise ValueError(why)
    except ValueError as e:
        return Candidate(layout, reason=f"model dims: {e}")
    mb, dp = w.micro_batch_size, max(layout.vision_dp, layout.text_dp, layout.audio_dp)
    if mb < dp:
        return Candidate(layout, reason=f"batch: a micro-batch of {mb} sample(s) cannot feed "
                                        f"{dp} data-parallel replicas")
    p = phase_times(config, counts, layout, w, hw)
    step, idle = step_time(layout, p, w.micro_batches)
    mem = memory_gib(config, counts, layout, w)
    limit = w.device_gib - w.margin_gib  # never a layout above the device less its margin
    over = {r: g for r, g in mem.items() if g > limit}
    within = (f" ({w.device_gib:g} GiB less a {w.margin_gib:g} GiB margin)"
              if w.margin_gib else "")
    reason = ("memory: " + ", ".join(f"{r} ranks need {g:.1f} GiB" for r, g in over.items())
              + f" > {limit:.4g} GiB{within}") if over else ""
    return Candidate(layout, step, p, idle, mem, reason)


def zero_options(layout: Layout) -> list:
    """The layout at every (vision, text) ZeRO-stage pair it admits beyond its defaults: vision
    0-3 with more than one vision rank, text 0-3 with text data_parallel > 1 (0-2 with expert
    parallelism); with an audio group also its stages 0-2 (more than one audio replica)."""
    from dataclasses import replace

    topo = layout.topology()
    vs = (0, 1, 2, 3) if topo.vision.size > 1 else (0,)
    ts = ((0, 1, 2) if layout.text_ep > 1 else (0, 1, 2, 3)) if topo.text.dp * topo.text.cp > 1 else (0,)
    if not layout.audio_dp:
        return [replace(layout, vision_zero=a, text_zero=b) for a in vs for b in ts
                if (a, b) != (topo.vision.zero_stage, topo.text.zero_stage)]
    au = topo.encoder("audio")
    aus = (0, 1, 2) if au.size > 1 else (0,)
    return [replace(layout, vision_zero=a, text_zero=b, audio_zero=c)
            for a in vs for b in ts for c in aus
            if (a, b, c) != (topo.vision.zero_stage, topo.text.zero_stage, au.zero_stage)]


def with_zero_stages(config, counts, cand: Candidate, w: Workload, hw: Hardware) -> Candidate:
    """``cand`` if it fits (its default stages: least traffic for what they save) or was
    dropped for anything but memory; else the fastest of its ZeRO-stage variants that fits
    (`zero_options`), or ``cand`` with its reason when none does."""
    if cand.feasible or not cand.reason.startswith("memory:"):
        return cand
    fits = [c for c in (evaluate(config, counts, lay, w, hw) for lay in zero_options(cand.layout))
            if c.feasible]
    return min(fits, key=lambda c: (c.step_s, c.peak_memory_gib), default=cand)


def recommend(config, num_workers: int, workload: Workload, hardware: Hardware = Hardware(),
              counts=None, context_parallel: bool = False) -> list:
    """Every layout of ``num_workers`` as a `Candidate`: feasible ones first, fastest first, then
    the dropped ones (those with a predicted time first, fastest first).

    Args:
        config: the model's transformers config (``DHPConfig.model_config()``).
        num_workers: accelerators (one worker each).
        workload: tokens per sample, batch, micro-batches, activation settings, device memory.
        hardware: the cost model's device and links (`Hardware`).
        counts: `ray_dhp.models.sizes.ParamCounts`; None counts them on the meta device.
        context_parallel: also rank every text context-parallel degree (``text.context_parallel``;
            CP ranks replicate the weights, so they pay off for long sequences).

    Example:
        >>> from ray_dhp import demo
        >>> from ray_dhp.planning.recommend import Workload, recommend
        >>> best = recommend(demo.tiny_model_config(), 2, Workload(1024, 64, 4))[0]
        >>> best.feasible, best.layout.num_workers
        (True, 2)
    """
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers}: need at least one worker.")
    if counts is None:
        from ray_dhp.models.sizes import count_params

        counts = count_params(config)
    audio = workload.audio_seconds is not None  # every candidate has an audio group
    if audio:
        from ray_dhp.planning.memory_audio import without_audio

        counts = without_audio(counts)  # the tower lives on the audio ranks
    cands = [with_zero_stages(config, counts, evaluate(config, counts, lay, workload, hardware),
                              workload, hardware)
             for lay in enumerate_layouts(num_workers, workload.micro_batches, config, audio,
                                          context_parallel and not audio)]
    return sorted(cands, key=lambda c: (not c.feasible, math.isnan(c.step_s),
                                        c.step_s if not math.isnan(c.step_s) else 0.0,
                                        c.peak_memory_gib if c.memory_gib else 0.0))
