"""Each step's samples: decoded once across the cluster, and prepared one step ahead.

Every rank runs the same `StepSampler`, so every rank knows which records form a step without
asking anyone. Processing them (image decode, resize, patchify, chat template, tokenisation,
label masking) is the expensive part, and it is split instead of repeated:

1. the step's candidate records are dealt over *all* ranks (vision and text), balanced by their
   image pixels (`decode_costs`, `ray_dhp.parallel.balance.decode_owners`; round-robin with
   ``balance="count"``); each record is processed by its owner only;
2. the owners exchange, on a dedicated gloo group, the small text side of every sample (token
   ids, labels, ``mm_token_type_ids``, the image grid, or the reason it is bad) with every rank
   (``all_gather_object``): every rank then knows the whole step — its layout, its target count,
   and which candidates were bad, for which replacements are drawn in the same order the
   single-process sampler would draw them, so the step's samples do not depend on the layout;
3. each sample's pixels go point-to-point from its owner to the vision ranks of the replica that
   computes it — and nowhere else (text ranks never hold pixels).

`StepLoader.start` runs this in a background thread one step ahead of training (the exchange uses
its own process group, so it never interleaves with the training collectives). `state_dict()` is
the sampler position of the last step *handed out*, which is what a checkpoint must store.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.models import encoder_operations
from ray_dhp.parallel.balance import COUNT, decode_owners, encoder_replicas

logger = logging.getLogger(__name__)

__all__ = ["StepLoader"]


@dataclasses.dataclass
class _Item:
    index: int                 # record index
    sample: object             # Sample without its routed fields (attached after routing)
    owner: int
    routed: dict = dataclasses.field(default_factory=dict)  # field -> (shape, dtype) it has


# Sample fields that go only to the ranks that compute them, by encoder module: the owner keeps
# the tensor, the metadata exchange carries its shape (`StepLoader._route`).
ROUTED = (("pixel_values", "vision"), ("audio_features", "audio"))


class _Fatal:
    """An unexpected error while processing on the owner: every rank raises it."""

    def __init__(self, message: str):
        self.message = message


class StepLoader:
    """Hands out each step's micro-batches (lists of `Sample`), the same on every rank except that
    a sample carries ``pixel_values`` only on the vision ranks that compute it.

    Args:
        sampler: the run's `StepSampler` (same seed and records on every rank).
        groups: this rank's `DHPGroups` (None: a single process, no exchange).
        prefetch: with `start`, prepare the next step in a background thread.
        num_workers: processes (per rank) that decode this rank's share of the samples; 0 decodes
            in the loader's thread, which the GIL serialises with Python-heavy training work.
        balancer: the run's `ray_dhp.parallel.balance.Balancer` (the engine's: pixels go to the
            vision replica it assigns); None: contiguous equal counts and round-robin owners.
    """

    def __init__(self, sampler, groups=None, *, prefetch: bool = True, num_workers: int = 0,
                 balancer=None):
        self.balancer = _default_balancer(sampler, groups) if balancer is None else balancer
        sampler.balancer = self.balancer
        self.sampler, self.groups, self.prefetch = sampler, groups, prefetch
        self.num_workers, self._pool = num_workers, None
        self.group = getattr(groups, "data", None)
        distributed = groups is not None and dist.is_initialized()
        self.world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        if self.world > 1:  # Ray Datasets: every node's spool must hold the same rows
            from ray_dhp.data.spool import check_agreement

            check_agreement(sampler, self.group)
        self._state = sampler.state_dict()
        self._skipped, self._epoch = sampler.skipped, sampler.epoch
        self._next_owner = 0
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self.processed_here = 0  # records this rank processed (decoded) so far
        if groups is not None:  # token-budget micro-batches must feed every replica
            t = groups.topology.text
            sampler.replicas = (t.dp, max(m.dp for m in groups.topology.modules))
            # records with audio train only where the layout has an audio group
            sampler.allow_audio = groups.topology.encoder("audio") is not None

    # -- what a checkpoint stores ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Sampler position after the last step handed out by `next`."""
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict must come before start()")
        self.sampler.load_state_dict(state)
        self._state = self.sampler.state_dict()
        self._skipped, self._epoch = self.sampler.skipped, self.sampler.epoch

    @property
    def skipped(self) -> int:
        """Distinct bad samples skipped up to the last step handed out."""
        return self._skipped

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- handing out steps ----------------------------------------------------------------------

    def start(self, num_steps: int) -> None:
        """Prepare the next ``num_steps`` steps in a background thread, one step ahead."""
        if not self.prefetch or num_steps <= 0:
            return
        self._queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, args=(num_steps,), daemon=True,
                                        name="ray_dhp-data")
        self._thread.start()

    def _run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            try:
                item = self._produce()
            except BaseException as exc:  # handed to the training thread, which raises it
                self._queue.put(exc)
                return
            self._queue.put(item)

    def next(self) -> list:
        """The next step's micro-batches."""
        if self._queue is not None:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
        else:
            item = self._produce()
        micro_batches, self._state, self._skipped, self._epoch = item
        return micro_batches

    def _process_candidates(self, candidates: list, what: str = "record") -> list:
        """Process ``candidates`` (record indices) on their decode owners, share every result's
        metadata, and return the valid ones as `_Item`s (pixels kept by the owner only); bad ones
        are noted on the sampler (strict: raises, on every rank alike). Collective."""
        s = self.sampler
        owners = self._owners(candidates)
        mine = self._process_many({q: i for q, (i, o) in enumerate(zip(candidates, owners))
                                   if o == self.rank})
        kept = {q: {f: getattr(x, f) for f, _ in ROUTED} for q, x in mine.items()
                if not isinstance(x, (Exception, _Fatal))}
        metas = self._gather_meta(mine)
        chosen = []
        for q, i in enumerate(candidates):
            meta = metas[q]
            if isinstance(meta, _Fatal):
                raise RuntimeError(f"processing {what} {i} on rank {owners[q]} failed: {meta.message}")
            if isinstance(meta, str):
                # strict: raises here, on every rank alike; skip: logged by the decoding rank only
                s.note_bad(i, meta, log=owners[q] == self.rank)
                continue
            item = _Item(i, meta["sample"], owners[q], meta["routed"])
            if owners[q] == self.rank:
                for f, value in kept[q].items():
                    setattr(item.sample, f, value)
            chosen.append(item)
        return chosen

    # -- one step -------------------------------------------------------------------------------

    def _produce(self):
        s = self.sampler
        need, draws = s.cfg.global_batch_size, 0
        chosen: list[_Item] = []
        while len(chosen) < need:
            candidates = []
            while len(candidates) < need - len(chosen):
                draws += 1
                if draws > need + 2 * len(s.records):
                    raise s.not_enough_error()
                i = s.next_index()
                if i not in s.bad:  # known bad: already counted, no need to process it again
                    candidates.append(i)
            chosen.extend(self._process_candidates(candidates))
        micro_batches = s.cut([it.sample for it in chosen])  # same cut on every rank
        self._route_pixels(chosen, micro_batches)
        return micro_batches, s.state_dict(), s.skipped, s.epoch

    def _process_many(self, todo: dict) -> dict:
        """``{q: record index}`` -> ``{q: Sample | BadSample | _Fatal}``, in worker processes
        when there are any (the GIL would serialise Python-heavy decoding with the training
        thread), else here."""
        self.processed_here += len(todo)
        if self.num_workers > 0 and todo:
            pool, qs = self._workers(), list(todo)
            chunks = [qs[w::self.num_workers] for w in range(self.num_workers)]
            futures = [(c, pool.submit(_process_in_worker, [todo[q] for q in c])) for c in chunks if c]
            out = {}
            for chunk, f in futures:  # one round trip per worker and step
                try:
                    out.update(zip(chunk, f.result()))
                except Exception as exc:  # the worker itself failed (or died)
                    out.update((q, _Fatal(f"{type(exc).__name__}: {exc}")) for q in chunk)
            return out
        return {q: _process_or_fatal(self.sampler, i) for q, i in todo.items()}

    def _workers(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.sampler,))
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (the prefetch thread ends by itself after its steps)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _gather_meta(self, mine: dict) -> dict:
        """Every rank's processed candidates, text side only: q -> meta dict | reason | _Fatal."""
        local = {}
        for q, x in mine.items():
            if isinstance(x, _Fatal):
                local[q] = x
            elif isinstance(x, Exception):  # BadSample: its reason (the location is known)
                local[q] = getattr(x, "reason", None) or str(x)
            else:
                fields = {f: getattr(x, f) for f, _ in ROUTED}
                local[q] = {"sample": dataclasses.replace(x, **{f: None for f in fields}),
                            "routed": {f: (tuple(v.shape), v.dtype) for f, v in fields.items()
                                       if v is not None}}
        if self.world == 1:
            return local
        parts = [None] * self.world
        dist.all_gather_object(parts, local, group=self.group)
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

    def _owners(self, candidates: list) -> list:
        """Decode owner (rank) per candidate: balanced by image pixels (``balance="cost"``) or
        round-robin; ties rotate from where the previous deal stopped. Same on every rank."""
        start, n = self._next_owner, len(candidates)
        self._next_owner = (start + n) % self.world
        if self.balancer.mode == "count" or self.world == 1:
            return [(start + q) % self.world for q in range(n)]
        return decode_owners(decode_costs(self.sampler, candidates), self.world, start)

    def _consumers_by_sample(self, micro_batches: list, encoder: str) -> dict:
        """``id(sample)`` -> global ranks that need its ``encoder`` input: the ranks of the
        replica the engine's `layout_micro_batch` assigns it (same `Balancer`, same samples)."""
        m = self.groups.topology.encoder(encoder)
        out = {}
        if m is None:
            return out
        ops = encoder_operations(encoder)
        for mb in micro_batches:
            for i, idx in enumerate(encoder_replicas(m.dp, mb, ops, self.balancer)):
                for s in idx:
                    out[id(mb[s])] = [m.rank_at(i, k) for k in range(m.inner)]
        return out

    def _route_pixels(self, chosen: list, micro_batches: list) -> None:
        """Send every routed field (`ROUTED`) from its owner to the ranks that compute it."""
        if self.world == 1:
            return
        requests, keep = [], []  # keep: tensors in flight stay alive until every wait()
        for n_field, (field, encoder) in enumerate(ROUTED):
            if not any(field in it.routed for it in chosen):
                continue
            consumers_of = self._consumers_by_sample(micro_batches, encoder)
            for pos, it in enumerate(chosen):
                if field not in it.routed:
                    continue
                consumers, tag = consumers_of.get(id(it.sample), []), n_field * len(chosen) + pos
                if it.owner == self.rank:
                    value = getattr(it.sample, field)
                    for c in consumers:
                        if c != self.rank:
                            requests.append(dist.isend(value.contiguous(), dst=c, group=self.group,
                                                       tag=tag))
                    if self.rank not in consumers:
                        keep.append(value)
                        setattr(it.sample, field, None)
                elif self.rank in consumers:
                    shape, dtype = it.routed[field]
                    buf = torch.empty(shape, dtype=dtype)
                    requests.append(dist.irecv(buf, src=it.owner, group=self.group, tag=tag))
                    setattr(it.sample, field, buf)
        for r in requests:
            r.wait()


def _default_balancer(sampler, groups):
    """Without an explicit balancer: by count. Refused where it would matter (the run balances by
    cost and an encoder's several replicas need the engine's assignment to route its inputs)."""
    cost = sampler.cfg.balance == "cost"
    wide = [] if groups is None else [m.name for m in groups.topology.encoders if m.dp > 1]
    if cost and wide:
        raise ValueError(f"StepLoader: balance='cost' with {wide[0]} data_parallel > 1 needs the "
                         "engine's balancer (StepLoader(..., balancer=engine.balancer())), so "
                         "its inputs go to the replica that computes them; or set balance='count'")
    return COUNT


def decode_costs(sampler, candidates: list) -> list:
    """Decode cost per candidate record: its images' pixel counts, read from the file headers
    only (decode, resize and patchify work grow with the pixels; file bytes do not track them
    for well-compressed images), plus 1024 for the text. Every rank reads the same files (any
    rank may be asked to decode any record), so every rank computes the same costs; an
    unreadable image counts 0 (its owner reports it as bad data)."""
    from PIL import Image

    from ray_dhp.data.sample import _image_paths

    out = []
    for i in candidates:
        cost = 1024
        try:
            paths = _image_paths(sampler.records[i].data or {}, sampler.root_for(i))
        except Exception:  # malformed record: bad data, found by its owner
            paths = []
        for p in paths:
            try:
                with Image.open(p) as img:  # lazy: reads the header, not the pixels
                    cost += img.width * img.height
            except Exception:
                pass
        out.append(cost)
    return out


_WORKER_SAMPLER = None


def _init_worker(sampler) -> None:
    global _WORKER_SAMPLER
    torch.set_num_threads(1)
    _WORKER_SAMPLER = sampler


def _process_in_worker(indices: list) -> list:
    return [_process_or_fatal(_WORKER_SAMPLER, i) for i in indices]


def _process_or_fatal(sampler, i: int):
    """``sampler.process(i)``; an unexpected error (not bad data: a bug or an environment
    problem) becomes a `_Fatal` that every rank raises."""
    try:
        return sampler.process(i)
    except Exception as exc:
        logger.exception("processing record %d failed", i)
        return _Fatal(f"{type(exc).__name__}: {exc}")
