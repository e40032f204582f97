"""Communication accounting: every collective the project issues is counted here.

The counter is passed explicitly to the code that communicates (no module-level global), so a
test or a benchmark can read exactly what one step sent.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class CommStats:
    calls: int = 0
    bytes: int = 0  # bytes this rank sent (input buffer size of the collective)


@dataclass
class CommCounter:
    """Counts calls and bytes per ``(op, tag)`` key, e.g. ``("all_to_all", "vision.sp")``."""

    stats: dict = field(default_factory=lambda: defaultdict(CommStats))
    enabled: bool = True

    def record(self, op: str, tag: str, nbytes: int) -> None:
        if not self.enabled:
            return
        s = self.stats[(op, tag)]
        s.calls += 1
        s.bytes += int(nbytes)

    def reset(self) -> None:
        self.stats.clear()

    def total(self, op: Optional[str] = None, tag: Optional[str] = None) -> CommStats:
        out = CommStats()
        for (o, t), s in self.stats.items():
            if (op is None or o == op) and (tag is None or t == tag):
                out.calls += s.calls
                out.bytes += s.bytes
        return out

    def as_dict(self) -> dict:
        return {f"{o}/{t}": {"calls": s.calls, "bytes": s.bytes} for (o, t), s in sorted(self.stats.items())}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def record(counter: Optional[CommCounter], op: str, tag: str, tensor_or_bytes) -> None:
    """Record one collective on ``counter`` if one is given."""
    if counter is None:
        return
    n = tensor_or_bytes if isinstance(tensor_or_bytes, int) else nbytes(tensor_or_bytes)
    counter.record(op, tag, n)


def exchange_order(rank: int, sends: dict, recv_rows: dict) -> list:
    """The point-to-point rule that keeps a pair's operations deadlock-free under NCCL
    (`ray_dhp.parallel.boundary`'s module docstring; the ring attention's exchanges too):
    ``[(kind, peer)]`` in posting order, peers ascending; with a lower peer I receive first,
    with a higher peer I send first."""
    order = []
    for peer in sorted((set(sends) | set(recv_rows)) - {rank}):
        pair = [("send", peer)] if peer in sends else []
        if peer in recv_rows:
            pair = pair + [("recv", peer)] if peer > rank else [("recv", peer)] + pair
        order += pair
    return order
