"""Deterministic mixing of several datasets with sampling ratios.

The run's n-th draw picks a dataset by a fixed rule of the draw counters alone (no random
numbers): the dataset with the lowest ``(draws + 1/2) / weight`` goes next, ties broken by name
(Sainte-Laguë / Webster apportionment, a smooth weighted round-robin). After ``N`` draws every
dataset has had ``N * weight / sum(weights)`` draws up to a rounding error of about one, over any
prefix of the run, so the ratios hold from the first step, not only on average.

Within a dataset, draws follow that dataset's own epochs: epoch ``e`` of dataset ``d`` visits its
records in ``randperm(n_d)`` order seeded by ``(seed, d, e)``. A small dataset wraps around on its
own (its epoch advances) while a large one is still in its first pass.

The one-dataset run without weights keeps the original order, ``randperm(n, seed * 1_000_003 +
epoch)``, so checkpoints and results of single-dataset runs are unchanged.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

__all__ = ["DataSource", "Stream", "pick", "legacy_permutation", "mixture_permutation"]


@dataclass
class DataSource:
    """One named dataset of the run.

    Attributes:
        name: its key in the trainer's ``datasets=``.
        records: its records (`ray_dhp.data.Record`), in file / Ray Dataset order.
        root: folder its relative image paths are resolved against.
        weight: sampling weight (None: the single dataset of an unweighted run).
    """

    name: str
    records: list
    root: Union[str, Path]
    weight: Optional[float] = None


def legacy_permutation(n: int, seed: int, epoch: int) -> list:
    """Order of epoch ``epoch`` of the single unweighted dataset (unchanged since the first release)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def mixture_permutation(n: int, seed: int, name: str, epoch: int) -> list:
    """Order of epoch ``epoch`` of dataset ``name`` in a weighted mixture: seeded by the name (not
    its position), so adding or removing another dataset leaves this one's order unchanged."""
    digest = hashlib.sha256(f"{seed}/{name}/{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=g).tolist()


class Stream:
    """Position of one dataset in the run: its epoch, the position in that epoch's permutation and
    how many draws it has had. Global record index = ``offset`` + index within the dataset."""

    def __init__(self, source: DataSource, offset: int, seed: int, legacy: bool):
        if not source.records:
            raise ValueError(f"the training dataset {source.name!r} is empty" if not legacy
                             else "the training dataset is empty")
        self.name, self.root, self.weight = source.name, source.root, source.weight
        # exact weight (0.7 is 7/10, not the nearest double): ties in `pick` are exact ties, so
        # weights {a: 7, b: 3} and {a: 0.7, b: 0.3} give the same order
        self.exact_weight = Fraction(repr(float(source.weight))) if source.weight else None
        self.offset, self.size = offset, len(source.records)
        self._seed, self._legacy = seed, legacy
        self.set_position(epoch=0, pos=0, draws=0)

    def _permutation(self, epoch: int) -> list:
        if self._legacy:
            return legacy_permutation(self.size, self._seed, epoch)
        return mixture_permutation(self.size, self._seed, self.name, epoch)

    def set_position(self, epoch: int, pos: int, draws: int) -> None:
        if not 0 <= pos <= self.size:
            raise ValueError(f"sampler state of dataset {self.name!r}: position {pos} is outside "
                             f"its {self.size} records (was the checkpoint written for other data?)")
        self.epoch, self.pos, self.draws = epoch, pos, draws
        self._order = self._permutation(epoch)

    def next_global(self) -> int:
        """Global index of this dataset's next record; advances (wrapping into the next epoch)."""
        if self.pos == self.size:
            self.set_position(self.epoch + 1, 0, self.draws)
        local = self._order[self.pos]
        self.pos += 1
        self.draws += 1
        return self.offset + local

    def __contains__(self, i: int) -> bool:
        return self.offset <= i < self.offset + self.size


def pick(streams: list) -> Stream:
    """The stream of the next draw: lowest ``(draws + 1/2) / weight``, first in list order on ties
    (the list is sorted by name). One stream, or unweighted: that stream."""
    if len(streams) == 1:
        return streams[0]
    return min(streams, key=lambda s: (2 * s.draws + 1) / s.exact_weight)
