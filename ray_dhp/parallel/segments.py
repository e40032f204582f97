"""Packed segments: the keyword that carries a packed batch's sample boundaries down a model's
forward, and the aligned layout a stateful mixer runs packed rows in.

``cu_seqlens`` ``[S + 1]`` (long) over the row-major flattened ``[R * L]`` tokens of packed rows,
the convention of varlen attention (`ray_dhp.data.collate.pack_text_batch` returns it; every
sample and every row's padded tail is a segment, and segments never cross rows), travels as the
forward keyword `SEGMENTS_KWARG`. Its readers: the stateful mixers' aligned rows
(`ray_dhp.models.segments.SegmentRows`), context-parallel attention and the head-sharded mixers
(`ray_dhp.parallel.context`, `ray_dhp.parallel.context_mixers`).

`segment_layout` keeps each packed row a row but moves its segments apart: every segment starts
at a multiple of ``align`` (a chunked recurrence's chunk, so its state can be reset between two
chunks) with at least ``gap`` zero tokens before it (a causal convolution's window then reads
zeros at the segment's start, as for the sample alone). A row grows by at most
``align - 1 + gap`` tokens per segment, instead of every segment padded to the longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SEGMENTS_KWARG", "SegmentLayout", "segment_layout", "segment_per_row"]

SEGMENTS_KWARG = "packed_segments"


@dataclass(frozen=True)
class SegmentLayout:
    """Packed ``[R, L]`` tokens laid out as ``[R, W]`` aligned rows. ``to_rows`` ``[R, W]``: each
    place's packed token in the flattened ``[R * L]`` tokens, ``R * L`` (a zero row appended by
    `rows`) in the gaps; ``to_packed`` ``[R * L]``: each packed token's place in the flattened
    ``[R * W]``; ``starts`` ``[R, W]`` (bool): where a segment starts."""

    to_rows: torch.Tensor
    to_packed: torch.Tensor
    starts: torch.Tensor

    def to(self, device) -> "SegmentLayout":
        return SegmentLayout(*(t.to(device) for t in (self.to_rows, self.to_packed, self.starts)))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[R, L, C]`` -> aligned ``[R, W, C]`` (zeros in the gaps)."""
        flat = torch.cat([x.reshape(-1, x.shape[-1]), x.new_zeros(1, x.shape[-1])])
        return flat.index_select(0, self.to_rows.reshape(-1)).view(*self.to_rows.shape, x.shape[-1])

    def packed(self, y: torch.Tensor, rows: int) -> torch.Tensor:
        """Aligned ``[R, W, C]`` -> packed ``[rows, T / rows, C]`` (the gaps dropped)."""
        flat = y.reshape(-1, y.shape[-1]).index_select(0, self.to_packed)
        return flat.view(rows, -1, y.shape[-1])


def segment_layout(cu_seqlens: torch.Tensor, row_length: int, align: int = 1,
                   gap: int = 0) -> SegmentLayout:
    """The aligned layout (module docstring) of packed rows of ``row_length`` tokens whose
    segments are ``cu_seqlens``: each row's first segment at 0, every later one at the first
    multiple of ``align`` at least ``gap`` tokens after the previous one's end."""
    cu = cu_seqlens.to("cpu", torch.long)
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() == 0 or bool((lengths <= 0).any()):
        raise ValueError(f"{SEGMENTS_KWARG}: cu_seqlens must rise strictly from 0, got {cu.tolist()}")
    total = int(cu[-1])
    if total % row_length:
        raise ValueError(f"{SEGMENTS_KWARG} cover {total} tokens, not rows of {row_length}")
    row = cu[:-1] // row_length
    if bool(((cu[1:] - 1) // row_length != row).any()):
        raise ValueError(f"{SEGMENTS_KWARG}: a segment crosses a row end (rows of {row_length})")
    start = _aligned_starts(row.tolist(), lengths.tolist(), align, gap)
    width = int((start + lengths).max())
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    place = row[seg] * width + start[seg] + (torch.arange(total) - cu[:-1][seg])
    rows = total // row_length
    to_rows = torch.full((rows * width,), total, dtype=torch.long)
    to_rows[place] = torch.arange(total)
    starts = torch.zeros(rows * width, dtype=torch.bool)
    starts[row * width + start] = True
    return SegmentLayout(to_rows.view(rows, width), place, starts.view(rows, width))


def segment_per_row(cu_seqlens: torch.Tensor) -> SegmentLayout:
    """One row per segment, ``[S, M]`` (``M`` the longest; zeros after each end): the layout of a
    mixer whose state has no reset to hand (every row starts from its own zero state)."""
    cu = cu_seqlens.to("cpu", torch.long)
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() == 0 or bool((lengths <= 0).any()):
        raise ValueError(f"{SEGMENTS_KWARG}: cu_seqlens must rise strictly from 0, got {cu.tolist()}")
    total, width = int(cu[-1]), int(lengths.max())
    col = torch.arange(width)
    to_rows = torch.where(col[None, :] < lengths[:, None], cu[:-1, None] + col[None, :], total)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    to_packed = seg * width + (torch.arange(total) - cu[:-1][seg])
    return SegmentLayout(to_rows, to_packed, col[None, :].expand(len(lengths), width) == 0)


def _aligned_starts(rows: list, lengths: list, align: int, gap: int) -> torch.Tensor:
    out, previous_row, end = [], None, 0
    for r, n in zip(rows, lengths):
        begin = 0 if r != previous_row else -(-(end + gap) // align) * align
        out.append(begin)
        previous_row, end = r, begin + n
    return torch.tensor(out, dtype=torch.long)
