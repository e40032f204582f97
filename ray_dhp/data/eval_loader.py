"""The validation set, in batches: every sample exactly once, in file order, decoded once.

`EvalLoader` walks the validation records in their order (record 0, 1, ...) in batches of
``eval_batch_size`` records and hands each batch out as one micro-batch (with
``micro_batch_tokens``: cut by that token budget, as training steps are), the same on every rank
except that pixels are only where the engine computes them — the `StepLoader` machinery (decode
owners, text-side exchange, pixel routing), on a process group of its own so an evaluation never
interleaves with the training loader's prefetch thread.

Bad records are skipped (``bad_data="skip"``, remembered so later evaluations do not decode them
again) or fail the run (``"strict"``), as in training; a skipped record is not replaced, so each
evaluation covers exactly the valid records. A batch with fewer valid samples than the layout has
data-parallel replicas (the last, partial batch; a tiny set) is filled with *ghost* samples: one
pad token, no image, no target. A ghost adds nothing to the loss sum nor to the target count, so
the eval loss is exactly the token-weighted mean over the valid samples.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from ray_dhp.data.loader import StepLoader

__all__ = ["EvalLoader", "GHOST_INDEX", "ghost_sample"]

#: ``Sample.index`` of a ghost (no record).
GHOST_INDEX = -1


def ghost_sample(pad_id: int = 0):
    """A one-token, text-only sample without targets (fills a partial batch; loss-neutral)."""
    from ray_dhp.data.sample import Sample

    one = torch.tensor([pad_id], dtype=torch.long)
    return Sample(index=GHOST_INDEX, input_ids=one, labels=torch.full_like(one, -100),
                  mm_token_type_ids=torch.zeros_like(one))


class EvalLoader(StepLoader):
    """The validation set's batches for `ray_dhp.step.evaluation.evaluate`.

    Args:
        sampler: a `ray_dhp.data.sampler.StepSampler` over the validation records (only its
            records, processing and bad-data policy are used; its seeded order is not).
        groups: this rank's `DHPGroups` (None: one process).
        batch_size: records per batch (one micro-batch each, or as many as the sampler's
            ``micro_batch_tokens`` budget needs).
        num_workers, balancer: as for `StepLoader` (the engine's balancer: pixels must go to the
            vision replica that computes them).
        group: the process group of the exchange (default: a new gloo group of all ranks;
            every rank builds the loader at the same point, before the training loader starts).
    """

    def __init__(self, sampler, groups=None, *, batch_size: int, num_workers: int = 0,
                 balancer=None, group=None):
        super().__init__(sampler, groups, prefetch=False, num_workers=num_workers, balancer=balancer)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: need at least 1")
        self.batch_size = batch_size
        if self.world > 1:
            self.group = group if group is not None else dist.new_group(
                list(range(self.world)), backend="gloo")
        topo = getattr(groups, "topology", None)
        # ghosts fill a short batch until it feeds every replica of every module (audio too)
        self.min_samples = 1 if topo is None else max(m.dp for m in topo.modules)

    @property
    def skipped(self) -> int:
        """Distinct bad validation records found so far (left out of every evaluation)."""
        return len(self.sampler.bad)

    def __len__(self) -> int:
        """Batches per evaluation (ghost-only batches excepted: none)."""
        n = len(self.sampler.records)
        return -(-n // self.batch_size)

    def batches(self) -> Iterator[list]:
        """Each batch as a step's micro-batches (one list of `Sample`); a batch whose records are
        all bad yields nothing. Collective: every rank iterates to the end."""
        n = len(self.sampler.records)
        for start in range(0, n, self.batch_size):
            micro_batches = self._batch(list(range(start, min(n, start + self.batch_size))))
            if micro_batches:
                yield micro_batches

    def _batch(self, indices: list) -> list:
        s = self.sampler
        candidates = [i for i in indices if i not in s.bad]
        chosen = self._process_candidates(candidates, what="validation record")
        if not chosen:
            return []
        samples = [it.sample for it in chosen]
        samples += [ghost_sample() for _ in range(self.min_samples - len(samples))]
        # one micro-batch, or with micro_batch_tokens cut by that budget as training steps are
        micro_batches = s.cut(samples) if s.cfg.micro_batch_tokens is not None else [samples]
        self._route_pixels(chosen, micro_batches)  # ghosts have no pixels: nothing to route
        return micro_batches


def validation_records(data):
    """``(records, data_root)`` of the dataset named "validation" (a path given to the trainer or
    a Ray Dataset), or None when the run has none; ``data``: the run's ``data`` section."""
    from ray_dhp.data.sources import load_records

    if "validation" not in (data.dataset_paths or {}):
        import ray.train

        try:
            if ray.train.get_dataset_shard("validation") is None:
                return None
        except (KeyError, RuntimeError, ValueError):  # no such dataset / not in a Ray Train run
            return None
    return load_records(data, "validation")


def make_eval_loader(cfg, processor, groups, balancer):
    """The run's `EvalLoader` over its "validation" dataset (None without one). Collective: every
    rank calls it at the same point (it builds the loader's process group). ``cfg``: what the
    sampler reads (`ray_dhp.config.views.SamplerConfig`: the ``data`` section and the batch)."""
    from ray_dhp.data.sampler import StepSampler

    found = validation_records(cfg.data)
    if found is None:
        return None
    records, root = found
    if not records:
        raise ValueError('the "validation" dataset is empty.')
    return EvalLoader(StepSampler(records, processor, root, cfg), groups,
                      batch_size=cfg.eval_batch(), num_workers=cfg.data.data_workers, balancer=balancer)
