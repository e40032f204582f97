"""Balanced work for mixed-resolution data: who computes which sample, as plain data.

A step mixes 300-patch photos, 16k-patch documents and text-only samples. Splitting it into
equal *counts* (`split_evenly`) leaves the replica that drew the document doing most of the
attention work while the others wait at the gradient all-reduce. Here each sample gets a
**cost** (`CostModel`, FLOPs-proportional, exact integers) and the samples are assigned so the
slowest part's cost is as small as a greedy can make it:

* `lpt` — longest processing time first: samples by decreasing cost, each to the part with the
  least load so far. Ties are broken by fewest samples, then part index (so with ``n >= parts``
  every part gets a sample: an empty part has the least load and the fewest samples), and
  samples of equal cost by position. It is within 4/3 of the optimal makespan.
* `padded_groups` — a text replica that pads its samples (no ``packing``) runs them as groups,
  one forward/backward each, padded to the group's own longest: one 290-token document no longer
  pads five 64-token samples to 290. The cut minimises ``sum(size x cost(longest)) + call x
  groups`` exactly (dynamic programming over the samples in length order); `lpt_grouped`
  assigns the text replicas by that cost (`lpt_padded`: one padded batch per replica).
* `Balancer.text_replicas` with ``max_tokens`` — a packing text replica's samples in
  `pack_order` (`ray_dhp.parallel.packed_rows`): the rows of `pack_bins` (every row padded to
  the longest), laid out row after row.
* `balanced_micro_batches` — equal-count micro-batches (as today) whose vision and text costs
  are both even, so neither group of a disjoint pipeline waits on a heavy micro-batch.
* `decode_owners` — the loader's decode owners (image pixels per sample) over all ranks.

Every function is pure and depends only on the step's samples (their image grids and token
counts, known identically on every rank), which the seeded sampler fixes from the seed and the
step: every rank computes the same plan without communicating, and a resumed run the same plan
as the uninterrupted one. The update does not depend on the plan: each sample is computed
exactly once and the loss is normalised by the step's global target count (the parity tests
assert it for the balanced plans). ``balance="count"`` keeps the contiguous equal-count split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ray_dhp.parallel.packed_rows import pack_order

__all__ = ["BALANCE_MODES", "TEXT_CALL_TOKENS", "CostModel", "Balancer", "lpt", "lpt_padded",
           "lpt_grouped", "padded_groups", "contiguous", "imbalance", "balanced_micro_batches",
           "decode_owners"]

BALANCE_MODES = ("cost", "count")

#: The fixed cost of one text forward/backward call, in tokens of linear cost: what splitting a
#: text replica's samples into one more padded group must save. Measured (`benchmarks/balance.py`,
#: ``cost_model_fit``): ~25 tokens for a plain single-process call of the vitheavy LM, 215-280
#: inside the TP=2 engine step (DTensor dispatch and TP collectives per layer); a 7B-class LM on
#: a GPU pays kernel launches and TP latency of the same order (~10-30 ms, a few hundred tokens).
TEXT_CALL_TOKENS = 256


# -- assignments (pure, integer costs) ------------------------------------------------------------

def contiguous(n: int, parts: int) -> list[list[int]]:
    """Today's split: contiguous chunks of ``range(n)``, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def lpt(costs: Sequence[int], parts: int, *, rotate: int = 0) -> list[list[int]]:
    """Indices of ``costs`` per part (each ascending), minimising the largest part's total
    greedily (LPT). ``rotate`` shifts which part wins a tie (``(p - rotate) % parts`` first), so
    repeated calls need not always favour part 0."""
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least one part")
    load, count = [0] * parts, [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        p = min(range(parts), key=lambda p: (load[p], count[p], (p - rotate) % parts))
        load[p] += costs[i]
        count[p] += 1
        out[p].append(i)
    return [sorted(o) for o in out]


def lpt_padded(lengths: Sequence[int], parts: int, cost) -> list[list[int]]:
    """Like `lpt`, for parts whose samples are padded to the part's longest: a part of ``c``
    samples, the longest ``L`` tokens, costs ``c * cost(L)``. Samples by decreasing length, each
    to the part whose cost after adding it is smallest (ties as in `lpt`)."""
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least one part")
    longest, count = [0] * parts, [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        def after(p, i=i):
            c = count[p] + 1
            return (c * cost(max(longest[p], lengths[i])), c, p)
        p = min(range(parts), key=after)
        longest[p] = max(longest[p], lengths[i])
        count[p] += 1
        out[p].append(i)
    return [sorted(o) for o in out]


def _grouped_after(lengths: Sequence[int], best: Sequence[int], cost, call: int) -> int:
    """The cheapest split of ``lengths`` (sorted descending) into padded groups of consecutive
    lengths, given ``best[j]`` = that of the first ``j`` lengths: a group ``j..k-1`` costs
    ``(k - j) * cost(lengths[j]) + call`` (padded to its first, the longest)."""
    k = len(lengths)
    return min(best[j] + (k - j) * cost(lengths[j]) + call for j in range(k))


def padded_groups(lengths: Sequence[int], cost, call: int) -> list[list[int]]:
    """Indices of ``lengths`` cut into groups (each ascending; groups longest first) that are run
    one after the other, each padded to its own longest: the cut minimising
    ``sum(group size * cost(longest)) + call * groups`` (``call``: the fixed cost of one more
    forward/backward call). Exact: an optimal cut groups samples consecutive in length order,
    which dynamic programming over that order finds."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ls = [lengths[i] for i in order]
    best, cut = [0], [0]
    for k in range(1, len(ls) + 1):
        j = min(range(k), key=lambda j: (best[j] + (k - j) * cost(ls[j]) + call, j))
        best.append(best[j] + (k - j) * cost(ls[j]) + call)
        cut.append(j)
    groups, k = [], len(ls)
    while k > 0:
        groups.append(sorted(order[cut[k]:k]))
        k = cut[k]
    return groups[::-1]


def lpt_grouped(lengths: Sequence[int], parts: int, cost, call: int) -> list[list[int]]:
    """Like `lpt_padded`, for parts that run their samples as `padded_groups`: a part costs its
    best cut into padded groups. Samples by decreasing length, each to the part whose cost after
    adding it is smallest (ties as in `lpt`); since each sample is the part's shortest so far,
    the part's best cut grows by one step of the dynamic programme."""
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least one part")
    lens: list[list[int]] = [[] for _ in range(parts)]
    best: list[list[int]] = [[0] for _ in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        after = [_grouped_after(lens[p] + [lengths[i]], best[p], cost, call) for p in range(parts)]
        p = min(range(parts), key=lambda p: (after[p], len(out[p]), p))
        lens[p].append(lengths[i])
        best[p].append(after[p])
        out[p].append(i)
    return [sorted(o) for o in out]


def imbalance(costs: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """Slowest part's cost over the mean part cost (1.0 = perfectly even)."""
    loads = [sum(costs[i] for i in part) for part in assignment]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balanced_micro_batches(vision: Sequence[int], text: Sequence[int], m: int) -> list[list[int]]:
    """``m`` micro-batches of equal count (``len / m`` samples each, ascending indices) whose
    vision and text costs are both even: samples by decreasing combined (normalised) cost, each
    to the micro-batch with room that leaves the smallest sorted vector of all ``2m`` normalised
    loads (the largest load first, then the next largest: a tie on the largest, e.g. one huge
    image, is decided by evening out the rest)."""
    n = len(vision)
    if m < 1 or n % m:
        raise ValueError(f"{n} samples cannot form {m} equal micro-batches")
    cap = n // m
    tv, tt = max(1, sum(vision)), max(1, sum(text))  # normalise: v / tv vs t / tt, in integers
    loads = [[0, 0] for _ in range(m)]  # per micro-batch: (vision * tt, text * tv)
    out: list[list[int]] = [[] for _ in range(m)]
    key = [vision[i] * tt + text[i] * tv for i in range(n)]
    for i in sorted(range(n), key=lambda i: (-key[i], i)):
        add = (vision[i] * tt, text[i] * tv)

        def after(b):
            vec = [x for c, ld in enumerate(loads) for x in
                   ((ld[0] + add[0], ld[1] + add[1]) if c == b else ld)]
            return (sorted(vec, reverse=True), len(out[b]), b)
        b = min((b for b in range(m) if len(out[b]) < cap), key=after)
        loads[b][0] += add[0]
        loads[b][1] += add[1]
        out[b].append(i)
    return [sorted(o) for o in out]


def decode_owners(costs: Sequence[int], world: int, start: int = 0) -> list[int]:
    """Owner rank per candidate (the rank that decodes it): LPT over ``world`` ranks; ties go
    round-robin from ``start`` so equal-cost candidates spread as the round-robin deal did."""
    owners = [0] * len(costs)
    for r, part in enumerate(lpt(costs, world, rotate=start)):
        for q in part:
            owners[q] = r
    return owners


def encoder_replicas(dp: int, samples, ops, balancer) -> list:
    """Sample indices per replica of an encoder (``ops``: its `EncoderSpec` operations): by its
    cost (``ops.cost(sample, balancer.model)``), or contiguous equal counts; ascending within a
    replica. The loader routes the encoder's inputs by the same rule."""
    idx = (contiguous(len(samples), dp) if balancer.mode == "count"
           else lpt([ops.cost(s, balancer.model) for s in samples], dp))
    return [sorted(i) for i in idx]


# -- the cost model ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostModel:
    """Training FLOPs per sample (times a constant, as exact integers), the model of
    `ray_dhp.planning.recommend` per image:

    * vision, per image of ``p`` patches: the linears ``6·(P_v - merger)·p`` and the merger
      ``6·merger·p / merge²``; attention ``12·h·p·p`` per full-attention block and
      ``12·h·p·min(window, p)`` per window block (attention never crosses images, nor the
      frames of a video: a video of ``t`` temporal patches costs ``t`` frames of ``h·w``);
    * text, per sample of ``L`` tokens (image placeholders included): ``6·P_matmul·L`` and causal
      attention ``6·d·L²`` per layer.

    All terms are multiplied by ``merge²`` so they stay integers (only ratios matter).
    ``text_call``, the fixed cost of one more text forward/backward call, is the linear cost of
    `TEXT_CALL_TOKENS` tokens. A model config's widths and parameter counts become these
    integers in `ray_dhp.step.microbatch.cost_model_of`.
    """

    merge: int               # patches per merged row (spatial_merge_size²)
    vision_linear: int       # per patch
    vision_full: int         # per patch² of one image
    vision_window: int       # per patch · min(window, patches) of one image
    window: int              # patches per attention window (0: no window blocks)
    text_linear: int         # per token
    text_quadratic: int      # per token²
    text_call: int = 0       # per text forward/backward call (a padded group, `padded_groups`)

    def vision(self, grid_thw) -> int:
        """Cost of one sample's images and videos (``[n_items, 3]`` grids, or None: 0). A video
        of ``t`` temporal patches is ``t`` frames of ``h·w`` patches: the towers attend within
        each frame (``cu_seqlens`` has one segment per frame), so its attention is ``t`` times a
        frame's, not that of one ``t·h·w`` span."""
        if grid_thw is None:
            return 0
        total = 0
        for t, hh, ww in grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw:
            f = int(hh) * int(ww)  # patches per frame (an attention segment)
            span = min(self.window, f) if self.window else 0
            total += int(t) * (self.vision_linear * f + self.vision_full * f * f
                               + self.vision_window * f * span)
        return total

    def text(self, num_tokens: int) -> int:
        """Cost of one sample of ``num_tokens`` tokens in the language model."""
        return self.text_linear * num_tokens + self.text_quadratic * num_tokens * num_tokens


@dataclass(frozen=True)
class Balancer:
    """The run's balance policy: ``mode`` "cost" (balanced by `CostModel`) or "count" (contiguous
    equal counts, the split before balancing existed). ``padded``: a text replica pads its
    samples to its longest (the engine without ``packing``), so its cost is
    ``samples x cost(longest)``, not the sum. ``max_tokens``: a packing replica's row budget
    (``data.max_tokens``; not ``padded`` only): its samples come in `pack_order`, the rows
    `pack_bins` fills (None: one row, ascending)."""

    mode: str = "count"
    model: Optional[CostModel] = None
    padded: bool = True
    max_tokens: Optional[int] = None

    def __post_init__(self):
        if self.mode not in BALANCE_MODES:
            raise ValueError(f"balance={self.mode!r}: use one of {BALANCE_MODES}")
        if self.mode == "cost" and self.model is None:
            raise ValueError("balance='cost' needs a CostModel")

    def vision_costs(self, samples) -> list[int]:
        return [self.model.vision(s.image_grid_thw) for s in samples]

    def text_costs(self, samples) -> list[int]:
        return [self.model.text(s.num_tokens) for s in samples]

    def vision_replicas(self, samples, parts: int) -> list[list[int]]:
        """Sample indices per vision data-parallel replica."""
        if self.mode == "count":
            return contiguous(len(samples), parts)
        return lpt(self.vision_costs(samples), parts)

    def text_replicas(self, samples, parts: int) -> list[list[int]]:
        """Sample indices per text data-parallel replica, ascending (padded: each costs its best
        cut into `padded_groups`); packed rows of ``max_tokens``: each replica's in `pack_order`
        (the order its rows lay them out: a pure function of the samples' token counts)."""
        if self.mode == "count":
            out = contiguous(len(samples), parts)
        elif self.padded:
            return lpt_grouped([s.num_tokens for s in samples], parts, self.model.text,
                               self.model.text_call)
        else:
            out = lpt(self.text_costs(samples), parts)
        if self.padded or self.max_tokens is None:
            return out
        return [[part[q] for q in pack_order([samples[i].num_tokens for i in part], self.max_tokens)]
                for part in out]

    def text_groups(self, samples, indices: Sequence[int]) -> list[list[int]]:
        """A text replica's samples ``indices`` as the groups it runs one after the other, each
        padded to its own longest (`padded_groups`); one group by count or with packing."""
        if self.mode == "count" or not self.padded or len(indices) < 2:
            return [list(indices)]
        cut = padded_groups([samples[i].num_tokens for i in indices], self.model.text,
                            self.model.text_call)
        return [[indices[q] for q in g] for g in cut]

    def micro_batches(self, samples, m: int) -> list[list[int]]:
        """Sample indices per micro-batch (``len / m`` each)."""
        n = len(samples)
        if self.mode == "count":
            return [list(range(k, k + n // m)) for k in range(0, n, n // m)]
        return balanced_micro_batches(self.vision_costs(samples), self.text_costs(samples), m)


COUNT = Balancer("count")
