"""What one DHP step is made of, as plain data and small helpers (no process groups here).

- next-token targets and their count (`shift_labels`, `count_targets`, `upcast`);
- `MicroBatchLayout` / `layout_micro_batch`: which vision replica and text replica computes which
  samples of a micro-batch and which SP rank computes which feature rows — identical on every
  rank, so the layout needs no communication;
- `_MicroBatch`: what one micro-batch carries between the phases of a schedule;
- `PhaseTimer`: wall time per phase (the ``time_<phase>_s`` metrics).

`ray_dhp.step.engine.DHPEngine` runs the phases; these names are re-exported there.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ray_dhp.parallel import boundary as bnd
from ray_dhp.parallel.balance import COUNT, Balancer

__all__ = ["shift_labels", "upcast", "count_targets", "image_rows", "MicroBatchLayout",
           "layout_micro_batch", "PhaseTimer"]


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: ``targets[:, i] = labels[:, i + 1]``, -100 at the end."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in at least fp32."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def count_targets(samples) -> int:
    return int(sum((s.labels[1:] != -100).sum() for s in samples))


def image_rows(sample, merge: int) -> int:
    if sample.image_grid_thw is None:
        return 0
    return int(sample.image_grid_thw.prod(-1).sum()) // (merge * merge)


@dataclass
class MicroBatchLayout:
    """Who does what for one micro-batch; identical on every rank (plain data)."""

    vision_samples: list        # per vision dp replica: ascending list of sample indices
    text_samples: list          # per text dp replica: ascending list of sample indices
    row_offsets: list           # per sample: first global feature row (len = samples + 1)
    vision_plans: list          # per vision dp replica: VisionShardPlan or None (no images)
    text_groups: Optional[list] = None  # per text replica: its samples as padded groups run in
    #                                     turn (lists of sample indices); None: one group each

    def rows_of(self, indices) -> torch.Tensor:
        """Global feature rows of the samples ``indices`` (ascending), concatenated in order."""
        parts = [torch.arange(self.row_offsets[i], self.row_offsets[i + 1]) for i in indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def group_rows(self, mine, groups) -> list:
        """Per group of ``groups`` (sample indices, a cut of ``mine``): the positions of its
        samples' rows within ``rows_of(mine)`` (a text replica's features), in group order."""
        start, at = {}, 0
        for i in mine:
            start[i] = at
            at += self.row_offsets[i + 1] - self.row_offsets[i]
        return [torch.cat([torch.arange(start[i], start[i] + self.row_offsets[i + 1] - self.row_offsets[i])
                           for i in grp]) if grp else torch.zeros(0, dtype=torch.long) for grp in groups]


def layout_micro_batch(samples, topology, family_name: str, config,
                       balancer: "Balancer" = COUNT) -> MicroBatchLayout:
    """The micro-batch's plan: samples per vision and per text replica (``balancer``: by cost,
    or contiguous equal counts), feature-row offsets, each vision replica's SP shard plan
    (`FamilySpec.plan_vision`) and each text replica's padded groups. ``config``: the model
    config (the Qwen families also take their vision config: the merge size is there)."""
    from ray_dhp.models import FAMILIES

    family = FAMILIES[family_name]

    n = len(samples)
    v, t = topology.vision, topology.text
    if n < v.dp or n < t.dp:
        raise ValueError(
            f"a micro-batch of {n} samples cannot feed {v.dp} vision and {t.dp} text replicas; "
            f"raise global_batch_size or lower micro_batches / data_parallel."
        )
    merge = family.merge_size(config)
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + image_rows(s, merge))
    vs = balancer.vision_replicas(samples, v.dp)
    plans = []
    for idx in vs:
        grids = [samples[i].image_grid_thw for i in idx if samples[i].image_grid_thw is not None]
        plans.append(family.plan_vision(config, torch.cat(grids), v.inner) if grids else None)
    ts = balancer.text_replicas(samples, t.dp)
    return MicroBatchLayout(vs, ts, offsets, plans, [balancer.text_groups(samples, idx) for idx in ts])


@dataclass
class _MicroBatch:
    """Everything one micro-batch carries between the phases of a schedule."""

    samples: list
    lay: Optional[MicroBatchLayout] = None
    feats: Optional[torch.Tensor] = None       # vision rows computed here (with graph)
    plan: Optional[bnd.BoundaryPlan] = None
    text_feats: Optional[torch.Tensor] = None  # rows in this rank's text layout
    grad_feats: Optional[torch.Tensor] = None
    loss_sum: float = 0.0

    @property
    def has_images(self) -> bool:
        return any(s.image_grid_thw is not None for s in self.samples)


class PhaseTimer:
    """Wall time per phase of a step (``time_<phase>_s`` metrics; each phase is also a
    ``ray_dhp.<phase>`` range in profiler traces); on a CUDA ``device`` the
    queued kernels are waited for at both edges of a phase (`ray_dhp.step.gpu.synchronize`), so
    a phase's time is its kernels', not their launch."""

    def __init__(self, device=None):
        self.totals: dict = {}
        self.device = device

    @contextlib.contextmanager
    def __call__(self, phase: str):
        from ray_dhp.step.gpu import synchronize

        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"ray_dhp.{phase}"):  # named in profiler traces
                yield
        finally:
            synchronize(self.device)
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - t0

    def as_metrics(self) -> dict:
        return {f"time_{k}_s": v for k, v in self.totals.items()}
