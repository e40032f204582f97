"""Packed text rows in the plan (`ray-dhp plan`, ``--recommend``) when ``data.packing`` is on.

The engine packs a text replica's samples of a micro-batch into rows of at most
``data.max_tokens`` tokens (`ray_dhp.parallel.packed_rows.pack_bins`: first fit decreasing, evened
out, laid out by `pack_order` and cut by `ray_dhp.data.collate.pack_rows`; None: one row) and
pads every row to the longest. The plan's samples all have one length ``s`` (its
``--text-tokens`` plus the image's rows), so a row holds at most ``k = max_tokens // s`` of
them, and the replica's ``n`` samples make ``r = ceil(n / k)`` rows of ``ceil(n / r) · s``
tokens (tests/unit/test_plan_packing.py checks these against the engine's rows). Its
activations are those of these rows (a last, shorter row is padded to the longest), not of
``n`` padded samples; eager attention keeps a row-by-row score matrix per packed row (the
engine masks a whole row). The cost model counts attention FLOPs per segment (each sample's
``s²``, what varlen attention computes) and the linears on the rows' tokens, the padded tail
included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Packing:
    """``data.packing`` on, rows of at most ``max_tokens`` tokens (``data.max_tokens``; None: one
    row per micro-batch and replica)."""

    max_tokens: Optional[int] = None

    def rows(self, samples: int, sample_tokens: int) -> tuple:
        """``(rows, row length)`` of ``samples`` samples of ``sample_tokens`` tokens each."""
        if samples < 1:
            return 0, 0
        per_row = samples if self.max_tokens is None else max(1, self.max_tokens // sample_tokens)
        rows = -(-samples // min(per_row, samples))
        return rows, -(-samples // rows) * sample_tokens  # as even as `pack_bins` makes them

    def text_tokens(self, samples: int, sample_tokens: int) -> tuple:
        """``(tokens, attention row length)`` of a text replica's activations: the packed rows'
        tokens (padding included) and their length."""
        rows, length = self.rows(samples, sample_tokens)
        return rows * length, length

    def describe(self) -> str:
        limit = "one row" if self.max_tokens is None else f"rows of at most {self.max_tokens} tokens"
        return f"packed (data.packing, {limit})"


def text_tokens(packing: Optional[Packing], samples: int, sample_tokens: int) -> tuple:
    """``(tokens, attention row length)`` a text replica holds activations for: padded samples
    (``packing`` None: ``samples · sample_tokens`` and one sample's length) or packed rows."""
    if packing is None:
        return samples * sample_tokens, sample_tokens
    return packing.text_tokens(samples, sample_tokens)


def packing_of(rf) -> Optional[Packing]:
    """The run file's packing (``data.packing``, ``data.max_tokens``), or None."""
    return Packing(rf.data.max_tokens) if rf.data.packing else None
