"""A packing text replica's rows, as plain data: which of its samples share a row.

With ``data.packing`` a text replica runs its samples packed into rows of at most
``data.max_tokens`` tokens, every row padded to the longest, so the rows should be few and even:

* `rows_in_order` — the order-preserving cut (`ray_dhp.data.collate.pack_rows`): consecutive
  samples share a row, as few rows as a greedy fill makes, at the smallest cap that needs no
  more rows (the rows as even as the order allows).
* `pack_bins` / `pack_order` — the rows in any order: first fit decreasing into as few rows as
  it makes, evened out (MULTIFIT), longest-first into that many rows, or the samples' own order,
  whichever pads least; and the order that lays the samples out row after row, so the
  order-preserving cut makes exactly those rows (`ray_dhp.parallel.balance.Balancer.text_replicas`
  hands each packing replica its samples in it).

Every function is pure and deterministic (ties by index), in the samples' token counts only:
every rank, and a resumed run, builds the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

__all__ = ["pack_bins", "pack_order", "rows_in_order"]


def _first_fit(order: Sequence[int], lengths: Sequence[int], cap: int,
               rows: Optional[int]) -> Optional[list[list[int]]]:
    """First fit of ``order`` (indices of ``lengths``) into rows of at most ``cap`` tokens, at
    most ``rows`` of them (None: as many as needed); None where they do not fit."""
    out: list[list[int]] = []
    load: list[int] = []
    for i in order:
        t = lengths[i]
        r = next((r for r in range(len(out)) if load[r] + t <= cap), None)
        if r is None:
            if rows is not None and len(out) >= rows:
                return None
            out.append([])
            load.append(0)
            r = len(out) - 1
        out[r].append(i)
        load[r] += t
    return out


def _check_rows(lengths: Sequence[int], max_tokens: Optional[int]) -> None:
    for i, t in enumerate(lengths):
        if max_tokens is not None and t > max_tokens:
            raise ValueError(f"sample {i} has {t} tokens > max_tokens={max_tokens}; such samples "
                             f"are bad data and should have been skipped when processing")


def rows_in_order(lengths: Sequence[int], max_tokens: Optional[int]) -> list[range]:
    """Order-preserving rows: consecutive samples share a row of at most ``max_tokens`` tokens
    (None: one row for all), as few rows as a greedy fill makes, and those as even as the order
    allows: the fill's cap is the smallest that still needs no more rows (binary search), which
    minimises the longest row for that row count (every row is padded to the longest). Returns
    the sample-index range of each row."""
    _check_rows(lengths, max_tokens)
    n = len(lengths)
    if max_tokens is None or n == 0:
        return [range(0, n)]

    def greedy(cap: int) -> list[range]:
        rows, start, used = [], 0, 0
        for i, t in enumerate(lengths):
            if i > start and used + t > cap:
                rows.append(range(start, i))
                start, used = i, 0
            used += t
        return rows + [range(start, n)]

    count, lo, hi = len(greedy(max_tokens)), max(lengths), max_tokens
    while lo < hi:  # the smallest cap that needs no more rows than the full greedy fill
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(greedy(mid)) <= count else (mid + 1, hi)
    return greedy(lo)


def _padded(lengths: Sequence[int], rows) -> tuple:
    """``(tokens run, rows)`` of ``rows`` (index lists) padded to the longest."""
    return len(rows) * max(sum(lengths[i] for i in r) for r in rows), len(rows)


def pack_bins(lengths: Sequence[int], max_tokens: Optional[int]) -> list[list[int]]:
    """Samples of ``lengths`` tokens as packed rows of at most ``max_tokens`` tokens, in any
    order (None: one row), every row padded to the longest. Three candidate fills: MULTIFIT (as
    many rows as first fit decreasing needs at ``max_tokens``, at the smallest cap, by binary
    search, at which it still needs no more), longest processing time first into that many rows,
    and the samples as given. Each is laid out (its rows by their first sample, each ascending)
    and cut by the order-preserving `rows_in_order`, as `ray_dhp.data.collate.pack_rows` will
    cut it; the rows of the fewest padded tokens win (ties: fewer rows, then the earlier
    candidate), in the order they are laid out, so `pack_order` is their concatenation and never
    pads more than the order given. Pure and deterministic (ties by index): the same token
    counts give the same rows."""
    _check_rows(lengths, max_tokens)
    n = len(lengths)
    if max_tokens is None or n <= 1:
        return [list(range(n))] if n else []
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    rows = len(_first_fit(order, lengths, max_tokens, None))
    lo, hi = max(max(lengths), -(-sum(lengths) // rows)), max_tokens
    while lo < hi:  # the smallest cap first fit decreasing packs into ``rows`` rows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _first_fit(order, lengths, mid, rows) is not None else (mid + 1, hi)
    load, lpt_rows = [0] * rows, [[] for _ in range(rows)]
    for i in order:  # LPT into the same number of rows: sometimes more even
        r = min(range(rows), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        lpt_rows[r].append(i)
    candidates = [_first_fit(order, lengths, lo, rows)]
    if max(load) <= max_tokens:
        candidates.append(lpt_rows)
    candidates.append([list(range(n))])  # as given: the order-preserving rows
    laid = []
    for c in candidates:  # each laid out (rows by first sample, each ascending) and cut in order
        seq = [i for r in sorted((sorted(r) for r in c if r), key=lambda r: r[0]) for i in r]
        laid.append([[seq[q] for q in r] for r in rows_in_order([lengths[i] for i in seq], max_tokens)])
    return min(laid, key=lambda c: _padded(lengths, c))


def pack_order(lengths: Sequence[int], max_tokens: Optional[int]) -> list[int]:
    """The sample order whose consecutive runs are the rows of `pack_bins`: laid out in this
    order, the order-preserving cut (`rows_in_order`, `ray_dhp.data.collate.pack_rows`) makes
    exactly those rows."""
    return [i for row in pack_bins(lengths, max_tokens) for i in row]
