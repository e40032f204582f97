"""Deterministic mixing of the run's datasets with sampling ratios (one dataset: a mixture of one).

The run's n-th draw picks a dataset by a fixed rule of the draw counters alone (no random
numbers): the dataset with the lowest ``(draws + 1/2) / weight`` goes next, ties broken by name
(Sainte-Laguë / Webster apportionment, a smooth weighted round-robin). After ``N`` draws every
dataset has had ``N * weight / sum(weights)`` draws up to a rounding error of about one, over any
prefix of the run, so the ratios hold from the first step, not only on average.

Within a dataset, draws follow that dataset's own epochs: epoch ``e`` of dataset ``d`` visits its
records in ``randperm(n_d)`` order seeded by ``(seed, d, e)``. A small dataset wraps around on its
own (its epoch advances) while a large one is still in its first pass.

A run with one dataset and no weights is the mixture of that dataset alone ("train", weight 1):
the same per-dataset epochs, the same checkpoint state. (Before this was so, such a run had an
order of its own; `OLD_STATE_HELP` says what to do with a checkpoint of that order.)
"""

from __future__ import annotations

import hashlib
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

__all__ = ["DataSource", "Stream", "pick", "mixture_permutation", "permutation_array",
           "OLD_STATE_HELP"]


@dataclass
class DataSource:
    """One named dataset of the run.

    Attributes:
        name: its key in the trainer's ``datasets=``.
        records: its records (`ray_dhp.data.Record`), in file / Ray Dataset order: a sequence
            (`ray_dhp.data.reading.Annotations`, indexed and parsed on demand, or a list).
        root: folder its relative image paths are resolved against.
        weight: sampling weight, > 0 (only the ratios between datasets matter; 1 for the only
            dataset of an unweighted run).
    """

    name: str
    records: list
    root: Union[str, Path]
    weight: float = 1.0


#: What to do with a checkpoint whose sampler state has the pre-mixture single-dataset form.
OLD_STATE_HELP = (
    "this checkpoint's sampler state {state} has the single-dataset form written by ray_dhp "
    "before a single dataset became a mixture of one (commit da3a5fe and earlier); that data "
    "order no longer exists, so the run cannot resume exactly. Either finish that run with the "
    "ray_dhp it was started with, or start a new run from its weights: `ray-dhp export "
    "CHECKPOINT OUT_DIR`, then set `model.path: OUT_DIR` (optimizer state and data position start "
    "afresh)")


def permutation_array(n: int, seed: int, name: str, epoch: int) -> np.ndarray:
    """Order of epoch ``epoch`` of dataset ``name`` as an int32 array (4 bytes a record; int64
    past 2**31 records): seeded by the name (not its position), so adding or removing another
    dataset leaves this one's order unchanged. (``torch.randperm`` draws the same order in
    int32 as in int64.)"""
    digest = hashlib.sha256(f"{seed}/{name}/{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    dtype = torch.int32 if n < 2 ** 31 else torch.int64
    return torch.randperm(n, generator=g, dtype=dtype).numpy()


def mixture_permutation(n: int, seed: int, name: str, epoch: int) -> list:
    """`permutation_array` as a list."""
    return permutation_array(n, seed, name, epoch).tolist()


class Stream:
    """Position of one dataset in the run: its epoch, the position in that epoch's permutation and
    how many draws it has had. Global record index = ``offset`` + index within the dataset."""

    def __init__(self, source: DataSource, offset: int, seed: int):
        if not source.records:
            raise ValueError(f"the training dataset {source.name!r} is empty")
        self.name, self.root, self.weight = source.name, source.root, source.weight
        # exact weight (0.7 is 7/10, not the nearest double): ties in `pick` are exact ties, so
        # weights {a: 7, b: 3} and {a: 0.7, b: 0.3} give the same order
        self.exact_weight = Fraction(repr(float(source.weight)))
        self.offset, self.size = offset, len(source.records)
        self._seed = seed
        self.set_position(epoch=0, pos=0, draws=0)

    def set_position(self, epoch: int, pos: int, draws: int) -> None:
        if not 0 <= pos <= self.size:
            raise ValueError(f"sampler state of dataset {self.name!r}: position {pos} is outside "
                             f"its {self.size} records (was the checkpoint written for other data?)")
        self.epoch, self.pos, self.draws = epoch, pos, draws
        self._order = permutation_array(self.size, self._seed, self.name, epoch)

    def next_global(self) -> int:
        """Global index of this dataset's next record; advances (wrapping into the next epoch)."""
        if self.pos == self.size:
            self.set_position(self.epoch + 1, 0, self.draws)
        local = int(self._order[self.pos])
        self.pos += 1
        self.draws += 1
        return self.offset + local

    def __contains__(self, i: int) -> bool:
        return self.offset <= i < self.offset + self.size


def pick(streams: list) -> Stream:
    """The stream of the next draw: lowest ``(draws + 1/2) / weight``, first in list order on ties
    (the list is sorted by name)."""
    return min(streams, key=lambda s: (2 * s.draws + 1) / s.exact_weight)
