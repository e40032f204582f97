"""Deterministic step sampling: which samples form step k, from the seed alone.

Every rank runs the same sampler over the same records, so all ranks agree on each step's
micro-batches without communicating, and a run resumed from ``state_dict()`` sees exactly the
samples it would have seen. Epoch ``e`` visits the records in ``randperm(n, seed + e)`` order;
the data-parallel split of each micro-batch happens in the engine.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_LOG_FIRST = 5


class StepSampler:
    def __init__(self, records, processor, data_root, cfg):
        if not records:
            raise ValueError("the training dataset is empty")
        self.records, self.processor, self.data_root, self.cfg = records, processor, data_root, cfg
        self.epoch, self.pos = 0, 0
        self.bad: set = set()  # indices of records found bad (each counted once per run)
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    def root_for(self, i: int):
        """Folder that record ``i``'s relative image paths are resolved against."""
        return self.data_root

    def next_index(self) -> int:
        """Index (into ``records``) of the next sample in the seeded order; advances the position."""
        if self.pos == len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.pos]
        self.pos += 1
        return i

    def process(self, i: int):
        """Record ``i`` as a `Sample`, or the `BadSample` exception saying why it cannot be one
        (no policy applied: see `note_bad`)."""
        from ray_dhp.data.processing import BadSample

        try:
            sample = self.processor.process(self.records[i], self.root_for(i),
                                            max_tokens=self.cfg.max_tokens)
        except BadSample as e:
            return e
        sample.index = i
        return sample

    def note_bad(self, i: int, error) -> None:
        """Apply the bad-data policy to record ``i``: raise (strict) or count it once and log the
        first few (skip)."""
        rec = self.records[i]
        where = f"{getattr(rec, 'source', '?')}:{getattr(rec, 'line', i)}"
        if self.cfg.bad_data == "strict":
            raise ValueError(f"bad sample at {where}: {error} (set bad_data='skip' to skip such "
                             f"samples)") from (error if isinstance(error, BaseException) else None)
        if i not in self.bad:
            self.bad.add(i)
            if len(self.bad) <= _LOG_FIRST:
                logger.warning("skipping bad sample at %s: %s", where, error)

    def _load(self, i: int):
        out = self.process(i)
        if isinstance(out, Exception):
            self.note_bad(i, out)
            return None
        return out

    def next_step(self) -> list:
        """The next step's micro-batches: ``micro_batches`` lists of samples."""
        need, samples, tries = self.cfg.global_batch_size, [], 0
        while len(samples) < need:
            tries += 1
            if tries > need + 2 * len(self.records):
                raise ValueError("not enough valid samples in the dataset to fill a batch")
            s = self._load(self.next_index())
            if s is not None:
                samples.append(s)
        m = self.cfg.micro_batch_size()
        return [samples[k:k + m] for k in range(0, need, m)]

    @property
    def skipped(self) -> int:
        """Distinct bad samples skipped so far in the run."""
        return len(self.bad)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "bad": sorted(self.bad)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self.bad = state["epoch"], state["pos"], set(state.get("bad", ()))
        self._order = self._permutation(self.epoch)
