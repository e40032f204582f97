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
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ray_dhp.models import FAMILIES, family_of
from ray_dhp.models.layer_config import layer_max
from ray_dhp.models.sizes import count_params, vision_width
from ray_dhp.parallel.balance import COUNT, TEXT_CALL_TOKENS, Balancer, CostModel, encoder_replicas

__all__ = ["shift_labels", "upcast", "count_targets", "EncoderLayout", "MicroBatchLayout",
           "layout_micro_batch", "PhaseTimer"]


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: ``targets[:, i] = labels[:, i + 1]``, -100 at the end."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in at least fp32."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def count_targets(samples) -> int:
    return int(sum((s.labels[1:] != -100).sum() for s in samples))


@dataclass
class EncoderLayout:
    """One encoder's part of a micro-batch: which of its replicas computes which samples, the
    feature-row offsets of the samples (rows into the LM, in sample order) and each replica's
    shard plan (its operations' ``plan``: the vision side's SP split, `FamilySpec.plan_vision`;
    an encoder without sequence parallelism: True), None where a replica has no input."""

    samples: list   # per dp replica: ascending list of sample indices
    offsets: list   # per sample: first feature row (len = samples + 1)
    plans: list     # per dp replica: shard plan, or None (no input)

    def rows_of(self, indices) -> torch.Tensor:
        """Feature rows of the samples ``indices``, concatenated in their order."""
        parts = [torch.arange(self.offsets[i], self.offsets[i + 1]) for i in indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def group_rows(self, mine, groups) -> list:
        """Per group of ``groups`` (sample indices, a cut of ``mine``): the positions of its
        samples' rows within ``rows_of(mine)`` (a text replica's features), in group order."""
        start, at = {}, 0
        for i in mine:
            start[i] = at
            at += self.offsets[i + 1] - self.offsets[i]
        return [torch.cat([torch.arange(start[i], start[i] + self.offsets[i + 1] - self.offsets[i])
                           for i in grp]) if grp else torch.zeros(0, dtype=torch.long) for grp in groups]


@dataclass
class MicroBatchLayout:
    """Who does what for one micro-batch; identical on every rank (plain data)."""

    encoders: dict              # encoder name -> EncoderLayout (module order)
    text_samples: list          # per text dp replica: its sample indices, ascending (packed
    #                             rows: in `pack_order`, the order its rows lay them out)
    text_groups: Optional[list] = None  # per text replica: its samples as padded groups run in
    #                                     turn (lists of sample indices); None: one group each

    @property
    def vision_samples(self) -> list:
        return self.encoders["vision"].samples

    @property
    def row_offsets(self) -> list:
        return self.encoders["vision"].offsets

    @property
    def vision_plans(self) -> list:
        return self.encoders["vision"].plans

    def rows_of(self, indices, encoder: str = "vision") -> torch.Tensor:
        return self.encoders[encoder].rows_of(indices)

    def group_rows(self, mine, groups, encoder: str = "vision") -> list:
        return self.encoders[encoder].group_rows(mine, groups)


def layout_micro_batch(samples, topology, family, config,
                       balancer: "Balancer" = COUNT) -> MicroBatchLayout:
    """The micro-batch's plan: per encoder (`Topology.encoders`) its samples per replica
    (``balancer``: by cost, or contiguous equal counts), feature-row offsets and each replica's
    shard plan; the samples per text replica and their padded groups. ``family``: a
    `FamilySpec` or the name of a hand-written one; ``config``: the model config (families
    whose merge size is in the vision config also take that)."""
    family = FAMILIES[family] if isinstance(family, str) else family
    n, t = len(samples), topology.text
    for m in topology.modules:
        if n < m.dp:
            raise ValueError(
                f"a micro-batch of {n} samples cannot feed {m.dp} {m.name} replicas; raise "
                f"global_batch_size or lower micro_batches / data_parallel.")
    encoders = {m.name: _encoder_layout(m, samples, family, config, balancer)
                for m in topology.encoders}
    ts = balancer.text_replicas(samples, t.dp)
    return MicroBatchLayout(encoders, ts, [balancer.text_groups(samples, idx) for idx in ts])


def _encoder_layout(m, samples, family, config, balancer) -> EncoderLayout:
    """One encoder's `EncoderLayout`, by its `EncoderSpec` operations: its rows per sample, its
    samples per replica (`encoder_replicas`) and each replica's shard plan."""
    ops = family.encoder_spec(m.name).operations()
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + ops.rows(family, config, s))
    idx = encoder_replicas(m.dp, samples, ops, balancer)
    plans = [ops.plan(family, config, [samples[i] for i in part], m.inner, micro_batch=samples)
             for part in idx]
    return EncoderLayout(idx, offsets, plans)


def cost_model_of(config, counts=None) -> CostModel:
    """The `CostModel` of a transformers VLM config (``counts``:
    `ray_dhp.models.sizes.ParamCounts`, else counted on the meta device)."""
    counts = counts or count_params(config)
    vc, tc, family = config.vision_config, config.text_config, family_of(config)
    h, merge = vision_width(vc), family.merge_size(config) ** 2
    mw = merge * h
    merger = min(counts.vision, (mw * mw + mw * family.vision_out_dim(config))
                 * (1 + family.num_deepstack(config)))
    depth = family.vision_depth(vc)
    full = len(getattr(vc, "fullatt_block_indexes", None) or range(depth))
    window = (getattr(vc, "window_size", 0) // vc.patch_size) ** 2 if full < depth else 0
    tied = getattr(config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False)
    matmul = counts.text - (0 if tied else tc.vocab_size * tc.hidden_size)
    d = tc.num_attention_heads * (layer_max(tc, "head_dim") or tc.hidden_size // tc.num_attention_heads)
    return CostModel(merge=merge, vision_linear=6 * (counts.vision - merger) * merge + 6 * merger,
                     vision_full=12 * h * full * merge, vision_window=12 * h * (depth - full) * merge,
                     window=window, text_linear=6 * matmul * merge,
                     text_quadratic=6 * tc.num_hidden_layers * d * merge,
                     text_call=6 * matmul * merge * TEXT_CALL_TOKENS)


def balancer_for(mode: str, config, counts=None, *, packing: bool = False,
                 max_tokens=None) -> Balancer:
    """The `Balancer` of policy ``mode`` for the model ``config`` (no cost model is built for
    "count"); ``packing``: the engine packs text rows (``TrainLoopConfig.packing``) of at most
    ``max_tokens`` tokens instead of padding."""
    return Balancer(mode, cost_model_of(config, counts) if mode == "cost" else None,
                    padded=not packing, max_tokens=max_tokens if packing else None)


@dataclass
class _MicroBatch:
    """Everything one micro-batch carries between the phases of a schedule."""

    samples: list
    lay: Optional[MicroBatchLayout] = None
    # per encoder name (`Topology.encoders`):
    feats: dict = field(default_factory=dict)       # rows computed here (with graph)
    plan: dict = field(default_factory=dict)        # bnd.BoundaryPlan
    text_feats: dict = field(default_factory=dict)  # rows in this rank's text layout
    grad_feats: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)      # encoder name -> does any sample have input
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
