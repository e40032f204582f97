"""Cutting a step's samples into micro-batches: a fixed count, or a token budget.

With ``micro_batch_tokens`` set, the step's samples are cut, in order, into micro-batches whose
text replicas each get at most that many tokens (text tokens, image placeholders included, so
long images count). Each micro-batch is split over the replicas as the engine splits it:
contiguous, sizes differing by at most one, or, given ``assign`` (``balance="cost"``), by the
engine's own balanced assignment (`ray_dhp.parallel.balance.Balancer.text_replicas`). The number of micro-batches then varies per step;
the update does not: the loss is normalised by the step's target count, so the gradients are the
same for any cut (the tests assert it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ray_dhp.parallel.boundary import split_evenly

__all__ = ["cut_micro_batches"]


def _max_share(lengths: Sequence[int], replicas: int, parts=None) -> int:
    """Most tokens one text replica gets, split as the engine splits (see the module doc)."""
    parts = split_evenly(len(lengths), replicas) if parts is None else parts
    return max(sum(lengths[i] for i in part) for part in parts)


def cut_micro_batches(lengths: Sequence[int], *, micro_batches: int = 1,
                      budget: int | None = None, replicas: int = 1, min_size: int = 1,
                      assign: Callable[[range], list] | None = None) -> list:
    """Ranges of sample indices, one per micro-batch.

    Args:
        lengths: tokens per sample, in step order.
        micro_batches: equal-size micro-batches (when ``budget`` is None).
        budget: max tokens per text replica per micro-batch (greedy, in order).
        replicas: text data-parallel replicas a micro-batch is split over.
        min_size: fewest samples a micro-batch may hold (the larger of the vision and text
            data-parallel degrees: every replica needs a sample).
        assign: ``assign(range(a, b))`` -> the engine's text replicas of samples ``a..b-1``
            (lists of indices relative to ``a``) when it balances by cost (None: contiguous).

    Raises:
        ValueError: a micro-batch of ``min_size`` samples already exceeds the budget.
    """
    n = len(lengths)
    if budget is None:
        m = n // micro_batches
        return [range(k, k + m) for k in range(0, n, m)]

    def sub(a, b):
        return None if assign is None else assign(range(a, b))

    cuts, start = [], 0
    while start < n:
        end = min(n, start + min_size)
        if _max_share(lengths[start:end], replicas, sub(start, end)) > budget:
            raise ValueError(
                f"micro_batch_tokens={budget} is too small: the {end - start} samples every "
                f"micro-batch needs (one per data-parallel replica) have "
                f"{_max_share(lengths[start:end], replicas, sub(start, end))} tokens on one text replica")
        while end < n and _max_share(lengths[start:end + 1], replicas, sub(start, end + 1)) <= budget:
            end += 1
        if 0 < n - end < min_size:  # the tail would be too small: leave it min_size samples
            end = n - min_size if n - min_size >= start + min_size else n
            if _max_share(lengths[start:end], replicas, sub(start, end)) > budget:
                raise ValueError(
                    f"micro_batch_tokens={budget}: cannot cut the step's {n} samples into "
                    f"micro-batches of at least {min_size} samples within the budget")
        cuts.append(range(start, end))
        start = end
    return cuts
