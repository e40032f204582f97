"""Deterministic step sampling: which samples form step k, from the seed alone.

Every rank runs the same sampler over the same records, so all ranks agree on each step's
micro-batches without communicating, and a run resumed from ``state_dict()`` sees exactly the
samples it would have seen. The run's datasets are a weighted mixture (one dataset: a mixture of
one); see `ray_dhp.data.mixture` for which dataset each draw comes from and each dataset's own
epochs. The data-parallel split of each micro-batch happens in the engine.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Sequence

from ray_dhp.data.bad_data import MIN_JUDGED, BadDataLedger
from ray_dhp.data.mixture import OLD_STATE_HELP, DataSource, Stream, pick

logger = logging.getLogger(__name__)

_LOG_FIRST = 5


class StepSampler:
    """The run's sample order over a weighted mixture of datasets (`StepSampler.from_sources`); one
    dataset, ``StepSampler(records, processor, root, cfg)``, is the mixture of it alone ("train").

    Attributes:
        records: every record of the run (`RunRecords`); with several datasets, the datasets'
            records concatenated in name order (``records[i].index == i``, the global index used
            everywhere below). Indexed datasets are parsed on demand: nothing per record is kept.
        bad: global indices of records found bad (each counted once per run).
        cfg: what the sampler reads of the run's configuration (`ray_dhp.config.views.
            SamplerConfig`): the step's batch and the ``data`` section's sample limits.
    """

    def __init__(self, records, processor, data_root, cfg):
        self._setup([DataSource("train", records, data_root)], processor, cfg)

    @classmethod
    def from_sources(cls, sources: list, processor, cfg) -> "StepSampler":
        """A sampler over ``sources`` (`DataSource` list, each with a weight > 0), mixed."""
        self = cls.__new__(cls)
        self._setup(sources, processor, cfg)
        return self

    #: records with audio are sample-able only when the layout trains an audio encoder module
    #: (the run sets it from its topology); otherwise they are refused, naming the record
    allow_audio = False

    def _setup(self, sources, processor, cfg) -> None:
        if not sources:
            raise ValueError("no training dataset")
        if any(s.weight is None or not s.weight > 0 for s in sources):
            raise ValueError("every dataset of a mixture needs a weight > 0: "
                             + ", ".join(f"{s.name}={s.weight}" for s in sources))
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names must be unique, got {names}")
        self.processor, self.cfg = processor, cfg
        self._streams, parts, offset = [], [], 0
        for src in sorted(sources, key=lambda s: s.name):
            self._streams.append(Stream(src, offset, cfg.seed))
            parts.append(src.records)
            offset += len(src.records)
        self.records = RunRecords(parts)
        self.bad: set = set()
        self.ledger = BadDataLedger()

    # -- the contract used by the train loop and the distributed loader ----------------------

    def _stream_of(self, i: int) -> Stream:
        for s in self._streams:
            if i in s:
                return s
        raise IndexError(f"record index {i} is outside the run's {len(self.records)} records")

    def root_for(self, i: int):
        """Folder that record ``i``'s relative image paths are resolved against (its dataset's)."""
        return self._stream_of(i).root

    def dataset_of(self, i: int) -> str:
        """Name of the dataset record ``i`` belongs to."""
        return self._stream_of(i).name

    def next_index(self) -> int:
        """Index (into ``records``) of the next sample in the seeded order; advances the position."""
        return pick(self._streams).next_global()

    def process(self, i: int):
        """Record ``i`` as a `Sample`, or the `BadSample` exception saying why it cannot be one
        (no policy applied: see `note_bad`)."""
        from ray_dhp.data.sample import BadSample

        try:
            sample = self.processor.process(
                self.records[i], self.root_for(i), max_tokens=self.cfg.data.max_tokens,
                max_chars=self.cfg.data.max_text_chars,
                max_pixels=self.cfg.data.max_image_pixels)
        except BadSample as e:
            return e
        if getattr(sample, "audio_lengths", None) is not None and not self.allow_audio:  # not bad data: no audio group
            from ray_dhp.data.audio import refusal

            raise ValueError(refusal(getattr(self.records[i], "where", f"record {i}")))
        sample.index = i
        return sample

    def note_bad(self, i: int, error, log: bool = True) -> None:
        """Apply the bad-data policy to record ``i``: raise (strict) or count it once and log the
        first few (skip; ``log=False`` counts without logging: every rank notes each bad record,
        only the rank that decoded it logs it). In skip mode too much bad data is an error (see `check_budget`), and in
        a mixture of several so is a dataset whose every record is bad (with one, the budget or
        `not_enough_error` says so)."""
        rec = self.records[i]
        where = getattr(rec, "where", None) or f"{getattr(rec, 'source', '?')}:{getattr(rec, 'line', i)}"
        reason = getattr(error, "reason", None) or str(error)  # BadSample: without its location
        if self.cfg.data.bad_data == "strict":
            raise ValueError(f"bad sample at {where}: {reason} (set bad_data='skip' to skip such "
                             f"samples)") from (error if isinstance(error, BaseException) else None)
        if i not in self.bad:
            self.bad.add(i)
            self.ledger.add(where, reason, self.root_for(i))
            if log and len(self.bad) <= _LOG_FIRST:
                logger.warning("skipping bad sample at %s: %s", where, reason)
            s = self._stream_of(i)
            if len(self._streams) > 1 and sum(1 for b in self.bad if b in s) == s.size:
                raise ValueError(f"every record of dataset {s.name!r} is bad (last: {where}: "
                                 f"{reason}); fix it or drop it from dataset_weights. "
                                 + self._summary())
            self.check_budget()

    def _drawn(self) -> int:
        """Distinct records drawn so far (each dataset's draws, at most its size)."""
        return sum(min(s.draws, s.size) for s in self._streams)

    def _summary(self) -> str:
        return self.ledger.summary(len(self.bad), self._drawn(),
                                   self.cfg.data.max_bad_fraction)

    def check_budget(self) -> None:
        """Raise once more than ``max_bad_fraction`` of the records drawn so far are bad (judged
        after ``min(MIN_JUDGED, number of records)`` draws), with the `BadDataLedger` summary."""
        limit, drawn = self.cfg.data.max_bad_fraction, self._drawn()
        if drawn >= min(MIN_JUDGED, len(self.records)) and len(self.bad) > limit * drawn:
            raise ValueError("too much bad data: " + self._summary())

    def not_enough_error(self) -> ValueError:
        """The error when no batch can be filled: why the records were bad."""
        return ValueError("not enough valid samples in the dataset to fill a batch: "
                          + self._summary())

    def _load(self, i: int):
        out = self.process(i)
        if isinstance(out, Exception):
            self.note_bad(i, out)
            return None
        return out

    def next_step(self) -> list:
        """The next step's micro-batches (lists of samples, see `cut`)."""
        need, samples, tries = self.cfg.global_batch_size, [], 0
        while len(samples) < need:
            tries += 1
            if tries > need + 2 * len(self.records):
                raise self.not_enough_error()
            s = self._load(self.next_index())
            if s is not None:
                samples.append(s)
        return self.cut(samples)

    #: ``(text replicas, fewest samples per micro-batch)`` for token-budget micro-batches; the
    #: `StepLoader` sets it from the topology (the default suits a single process).
    replicas = (1, 1)
    #: How micro-batches (and, for the budget, text replicas) are balanced: a
    #: `ray_dhp.parallel.balance.Balancer`; the `StepLoader` sets the run's (None: by count).
    balancer = None

    def cut(self, samples: list) -> list:
        """The step's samples as micro-batches: a fixed count (equal counts; with a cost
        balancer, each of even vision and text cost) or by ``micro_batch_tokens`` (in order)."""
        from ray_dhp.data.budget import cut_micro_batches

        replicas, min_size = self.replicas
        budget, bal = self.cfg.micro_batch_tokens, self.balancer
        cost = bal is not None and bal.mode == "cost"
        if budget is None:
            if cost and self.cfg.micro_batches > 1:
                return [[samples[i] for i in idx]
                        for idx in bal.micro_batches(samples, self.cfg.micro_batches)]
            cuts = cut_micro_batches([0] * len(samples), micro_batches=self.cfg.micro_batches)
        else:
            # the replicas' samples, unordered (no packed order: only their tokens count here)
            sets = dataclasses.replace(bal, max_tokens=None) if cost else None

            def assign(rng):  # the engine's text replicas of those samples
                return sets.text_replicas(samples[rng.start:rng.stop], replicas)
            cuts = cut_micro_batches([s.num_tokens for s in samples], budget=budget,
                                     replicas=replicas, min_size=min_size,
                                     assign=assign if cost else None)
        return [samples[r.start:r.stop] for r in cuts]

    # -- progress -------------------------------------------------------------------------------

    @property
    def skipped(self) -> int:
        """Distinct bad samples skipped so far in the run (all datasets)."""
        return len(self.bad)

    @property
    def epoch(self) -> int:
        """Completed passes over the data. With several datasets each wraps around on its own, and
        this is the fewest passes any of them has completed (so every record of every dataset has
        been drawn at least ``epoch`` times); per dataset: `epochs`."""
        return min(s.epoch for s in self._streams)

    @property
    def epochs(self) -> dict:
        """``{dataset name: its epoch}``."""
        return {s.name: s.epoch for s in self._streams}

    @property
    def draws(self) -> dict:
        """``{dataset name: records drawn from it so far}`` (bad ones included)."""
        return {s.name: s.draws for s in self._streams}

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"datasets": {name: {"epoch", "pos", "draws", "bad"}}}`` with bad indices local to
        each dataset, so a resumed run may list its datasets differently (added, removed, renamed
        ones start afresh)."""
        return {"datasets": {s.name: {"epoch": s.epoch, "pos": s.pos, "draws": s.draws,
                                      "bad": sorted(b - s.offset for b in self.bad if b in s)}
                             for s in self._streams}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict` output; datasets the state does not name start at the
        beginning. The pre-mixture single-dataset form (``{"epoch", "pos", "bad"}``) raises
        `OldSamplerState`: its order cannot be continued (`OLD_STATE_HELP` says what to do)."""
        check_state(state)
        per = state["datasets"]
        unknown = set(per) - {s.name for s in self._streams}
        if unknown:
            logger.warning("sampler state names datasets not in this run (ignored): %s",
                           sorted(unknown))
        self.bad = set()
        for s in self._streams:
            st = per.get(s.name)
            if st is None:
                logger.warning("dataset %r has no sampler state: starting it afresh", s.name)
                s.set_position(0, 0, 0)
                continue
            s.set_position(st["epoch"], st["pos"], st["draws"])
            self.bad |= {s.offset + b for b in st.get("bad", ())}


class OldSamplerState(ValueError):
    """A checkpoint's sampler state in the pre-mixture single-dataset form (see `check_state`)."""


def check_state(state) -> None:
    """Raise `OldSamplerState` (naming what to do) unless ``state`` is a `StepSampler.state_dict`
    of this version: the driver calls it on ``resume_from`` before workers start."""
    if not isinstance(state, dict) or not isinstance(state.get("datasets"), dict):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise OldSamplerState(OLD_STATE_HELP.format(state=f"(keys {keys})"))


class RunRecords(Sequence):
    """The datasets' records concatenated in name order, without copying them: ``[i]`` is the
    record of global index ``i`` (its ``index`` is ``i``), parsed on demand when the dataset is
    indexed (`ray_dhp.data.reading.Annotations`)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.offsets = list(itertools.accumulate((len(p) for p in parts), initial=0))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record index {i} is outside the run's {len(self)} records")
        k = bisect.bisect_right(self.offsets, i) - 1
        r = self.parts[k][i - self.offsets[k]]
        if dataclasses.is_dataclass(r) and getattr(r, "index", i) != i:
            r = dataclasses.replace(r, index=i)
        return r

    def __eq__(self, other):
        return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None
