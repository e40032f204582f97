"""Packed segments: the keyword that carries a packed batch's sample boundaries down a model's
forward, and the index that lays packed tokens out one segment per row.

``cu_seqlens`` ``[S + 1]`` (long) over the row-major flattened ``[R * L]`` tokens of packed rows,
the convention of varlen attention (`ray_dhp.data.collate.pack_text_batch` returns it; every
sample and every row's padded tail is a segment, and segments never cross rows), travels as the
forward keyword `SEGMENTS_KWARG`. Its readers: the stateful mixers' per-segment rows
(`ray_dhp.models.segments.SegmentRows`), context-parallel attention and the head-sharded mixers
(`ray_dhp.parallel.context`, `ray_dhp.parallel.context_mixers`).
"""

from __future__ import annotations

import torch

__all__ = ["SEGMENTS_KWARG", "segment_rows_index"]

SEGMENTS_KWARG = "packed_segments"


def segment_rows_index(cu_seqlens: torch.Tensor) -> tuple:
    """``(to_rows, to_packed)`` for ``cu_seqlens`` over ``T`` packed tokens: ``to_rows`` ``[S, M]``
    picks each segment's tokens from the flattened packed tokens, ``T`` (one past the end: a zero
    row appended by the caller) after the segment's end; ``to_packed`` ``[T]``: each packed
    token's place in the flattened ``[S * M]`` segment rows."""
    cu = cu_seqlens.to("cpu", torch.long)
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() == 0 or bool((lengths <= 0).any()):
        raise ValueError(f"{SEGMENTS_KWARG}: cu_seqlens must rise strictly from 0, got {cu.tolist()}")
    total, width = int(cu[-1]), int(lengths.max())
    col = torch.arange(width)
    to_rows = cu[:-1, None] + col[None, :]
    to_rows = torch.where(col[None, :] < lengths[:, None], to_rows, total)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    to_packed = seg * width + (torch.arange(total) - cu[:-1][seg])
    return to_rows, to_packed
