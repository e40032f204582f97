"""Collating :class:`~ray_dhp.data.sample.Sample` objects into a batch: right-padded (one
sample per row) or packed (several samples per row, each still seeing only itself)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ray_dhp.data.sample import IGNORE_INDEX, Sample
from ray_dhp.models import encoder_operations
from ray_dhp.models.vision_encoder import item_kinds, row_modalities
from ray_dhp.parallel.packed_rows import rows_in_order

__all__ = ["pad_text_batch", "pack_text_batch", "pack_rows", "row_modalities", "sample_positions"]


def _pad(rows: list[torch.Tensor], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def _split(s: Sample) -> dict:
    """The sample's visual items split by modality: ``{1: (pixels, grids), 2: (pixels, grids)}``
    (pixels None when the sample carries none here)."""
    kinds = item_kinds(s)
    sizes = s.image_grid_thw.prod(-1).tolist()
    parts = [None] * len(kinds) if s.pixel_values is None else s.pixel_values.split(sizes)
    out = {}
    for kind in (1, 2):
        keep = [i for i, k in enumerate(kinds) if k == kind]
        if keep:
            px = None if s.pixel_values is None else torch.cat([parts[i] for i in keep])
            out[kind] = (px, s.image_grid_thw[keep])
    return out


def _images(samples: Sequence[Sample]) -> dict:
    """The model's visual inputs of the samples, in batch order: ``image_grid_thw`` /
    ``pixel_values`` of their images, ``video_grid_thw`` / ``pixel_values_videos`` /
    ``second_per_grid_ts`` of their videos (None where there are none), ``image_sizes`` of
    the images where the samples carry them (anyres; else None); pixels only if every
    sample with such items carries pixels (text-only ranks may get grids without pixels)."""
    split = [_split(s) for s in samples if s.image_grid_thw is not None]
    out = {}
    for kind, px_key, grid_key in ((1, "pixel_values", "image_grid_thw"),
                                   (2, "pixel_values_videos", "video_grid_thw")):
        got = [d[kind] for d in split if kind in d]
        pixels = [p for p, _ in got]
        out[px_key] = None if not got or any(p is None for p in pixels) else torch.cat(pixels)
        out[grid_key] = torch.cat([g for _, g in got]) if got else None
    sizes = [s.image_sizes[torch.tensor([k == 1 for k in item_kinds(s)])] for s in samples
             if s.image_grid_thw is not None and s.image_sizes is not None]
    out["image_sizes"] = torch.cat(sizes) if sizes else None  # anyres images' original sizes
    seconds = [s.second_per_grid_ts for s in samples if s.second_per_grid_ts is not None]
    out["second_per_grid_ts"] = torch.cat(seconds) if seconds else None
    return out


def pad_text_batch(samples: Sequence[Sample], pad_id: int, *, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad samples into one batch.

    Args:
        samples: processed samples (at least one).
        pad_id: token id written at padded positions of ``input_ids``.
        pad_to_multiple_of: round the padded length up to a multiple of this (e.g. the
            sequence-parallel degree).

    Returns:
        ``input_ids``, ``attention_mask`` (1 on real tokens), ``labels`` (-100 on padding),
        ``mm_token_type_ids`` (0 on padding) — all ``[B, L]`` long — plus the visual inputs
        of `_images`: ``image_grid_thw`` / ``pixel_values`` (the images' grids and patches in
        batch order; pixels None if one of them comes without pixels), ``video_grid_thw`` /
        ``pixel_values_videos`` / ``second_per_grid_ts`` for the videos, and the audio inputs
        of the audio encoder's ``collate`` (``input_features`` / ``feature_attention_mask``).
    """
    if not samples:
        raise ValueError("pad_text_batch needs at least one sample")
    length = max(s.num_tokens for s in samples)
    length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    batch = {
        "input_ids": _pad([s.input_ids for s in samples], length, pad_id),
        "attention_mask": _pad([torch.ones_like(s.input_ids) for s in samples], length, 0),
        "labels": _pad([s.labels for s in samples], length, IGNORE_INDEX),
        "mm_token_type_ids": _pad([s.mm_token_type_ids for s in samples], length, 0),
    }
    batch.update(_images(samples))
    batch.update(encoder_operations("audio").collate(samples))
    return batch


def pack_rows(lengths: Sequence[int], max_tokens: Optional[int]) -> list[range]:
    """Order-preserving packing (`ray_dhp.parallel.packed_rows.rows_in_order`): consecutive samples
    share a row of at most ``max_tokens`` tokens (None: one row for all), in as few rows as a
    greedy fill makes, and those rows as even as the order allows (every row is padded to the
    longest). Samples keep their order, so feature rows stay in sample order; the engine hands
    a replica's samples in `ray_dhp.parallel.packed_rows.pack_order` (`Balancer.text_replicas`), so
    these rows are at most as many and as long as the first-fit-decreasing rows of
    `pack_bins`. Returns the sample-index range of each row."""
    return rows_in_order(lengths, max_tokens)


RopeIndex = Callable[..., tuple]


def _positions(sample: Sample, rope_index: Optional[RopeIndex], one_dimensional: bool) -> torch.Tensor:
    """``[3, n]`` M-RoPE positions of ``sample`` alone, as the model computes them (``[0, n]``
    for a 1-D RoPE model: its text positions are all)."""
    n = sample.num_tokens
    if one_dimensional:
        return torch.zeros(0, n, dtype=torch.long)
    if sample.image_grid_thw is None:  # the model's own fallback: 1-D positions on all 3 axes
        return torch.arange(n).expand(3, n)
    if rope_index is None:
        raise ValueError("pack_text_batch needs rope_index (the model's get_rope_index, e.g. "
                         "model.model.get_rope_index) for samples with images")
    vis = _images([sample])
    extra = {} if vis["second_per_grid_ts"] is None else {"second_per_grid_ts": vis["second_per_grid_ts"]}
    if sample.audio_lengths is not None:  # a model with audio: its clips' frames place them
        extra["audio_seqlens"] = sample.audio_lengths
    pos, _ = rope_index(sample.input_ids[None], sample.mm_token_type_ids[None],
                        image_grid_thw=vis["image_grid_thw"], video_grid_thw=vis["video_grid_thw"],
                        **extra)
    pos = pos[:, 0]
    # whole positions as long; a rule that places video frames at fractional times (seconds per
    # temporal patch x positions per second, kept unrounded) keeps its floating positions
    return pos if pos.is_floating_point() and not torch.equal(pos, pos.round()) else pos.to(torch.long)


def positions_dtype(positions: Sequence[torch.Tensor]) -> torch.dtype:
    """One dtype for several samples' positions: long, or floating where a rule gave fractional
    ones (`_positions`)."""
    return functools.reduce(torch.promote_types, [p.dtype for p in positions], torch.long)


def sample_positions(sample: Sample, rope_index: Optional[RopeIndex], one_dimensional: bool) -> torch.Tensor:
    """``[3, n]`` M-RoPE positions of ``sample`` alone, as the model computes them (the LM's
    context parallelism slices them, `ray_dhp.step.text`)."""
    return _positions(sample, rope_index, one_dimensional)


def pack_text_batch(samples: Sequence[Sample], pad_id: int, max_tokens: Optional[int] = None, *,
                    rope_index: Optional[RopeIndex] = None, one_dimensional: bool = False,
                    pad_to_multiple_of: int = 1) -> dict:
    """Pack samples, in order, into rows of at most ``max_tokens`` tokens (`pack_rows`: as few
    rows as a greedy fill, evened out; the engine orders a replica's samples by `pack_order`
    first, so its rows are filled first fit decreasing).

    Every sample keeps its own attention, positions and targets, so the loss and gradients equal
    those of the padded batch: positions restart at each sample, no token attends across a
    sample boundary, and the last token of a sample has no target.

    The block-diagonal causal attention comes from transformers' packed-sequence detection:
    pass ``position_ids`` and **no** 2-D ``attention_mask`` to an M-RoPE model; its first row
    (text positions, 0..n-1 per sample) restarts at each sample, from which
    ``masking_utils.create_causal_mask`` builds the mask for sdpa, eager and flex attention.
    (Flash-attention kernels detect packing from positions only for a single row.)

    Args:
        samples: processed samples (at least one).
        pad_id: token id written at padded positions of ``input_ids`` (the tail of short rows).
        max_tokens: row length budget; a longer sample raises ValueError. None: one row.
        rope_index: the model's ``get_rope_index`` (``model.model.get_rope_index``, or the
            family's adapter to that signature, `FamilySpec.rope_index`); needed for samples
            with images, whose M-RoPE positions depend on the image grids. A sample with audio
            clips also hands it their frames (``audio_seqlens``).
        one_dimensional: the model's positions are 1-D (``FamilySpec.packed_positions``, e.g.
            a plain RoPE language model): ``position_ids`` is the text-position row alone, ``[R, L]``.
        pad_to_multiple_of: round the row length up to a multiple of this (the text
            sequence-parallel degree); the extra tail is padding like a short row's.

    Returns:
        The keys of `pad_text_batch` (``input_ids``, ``labels``, ``mm_token_type_ids`` are
        ``[R, L]``; ``attention_mask`` is None, see above; ``pixel_values``/``image_grid_thw``
        in sample order) plus:
        ``position_ids`` ``[4, R, L]`` long (floating where a sample's rule gives fractional
        positions, as the model computes them): row 0 the text positions, rows 1-3 the M-RoPE
        (temporal, height, width) positions of each sample computed alone (padding: 0, 1, ...,
        a segment of its own; ``one_dimensional``: row 0 alone, ``[R, L]``); ``targets``
        ``[R, L]``: next-token targets within each sample (-100 at its last token and on
        padding); ``sample_ids`` ``[R, L]``: index of the token's sample in ``samples``, -1 on
        padding; ``cu_seqlens`` ``[S + 1]`` long: the
        segment boundaries over the row-major flattened ``[R * L]`` tokens (varlen attention's
        convention), each sample and each row's padded tail a segment of its own (what a
        recurrent mixer resets at, `ray_dhp.models.segments`).
    """
    if not samples:
        raise ValueError("pack_text_batch needs at least one sample")
    rows = pack_rows([s.num_tokens for s in samples], max_tokens)
    length = max(sum(samples[i].num_tokens for i in r) for r in rows)
    length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    cols: dict = {k: [] for k in ("input_ids", "labels", "mm_token_type_ids", "targets",
                                  "sample_ids", "position_ids")}
    lengths = []
    for r in rows:
        parts: dict = {k: [] for k in cols}
        for i in r:
            s = samples[i]
            n = s.num_tokens
            targets = torch.full_like(s.labels, IGNORE_INDEX)
            targets[:-1] = s.labels[1:]
            parts["input_ids"].append(s.input_ids)
            parts["labels"].append(s.labels)
            parts["mm_token_type_ids"].append(s.mm_token_type_ids)
            parts["targets"].append(targets)
            parts["sample_ids"].append(torch.full((n,), i, dtype=torch.long))
            parts["position_ids"].append(torch.cat([torch.arange(n)[None],
                                                    _positions(s, rope_index, one_dimensional)]))
            lengths.append(n)
        used = sum(samples[i].num_tokens for i in r)
        lengths += [length - used] if length > used else []
        parts["position_ids"].append(torch.arange(length - used).expand(1 if one_dimensional else 4, -1))
        for k, v in parts.items():
            cols[k].append(torch.cat(v, dim=-1))
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "mm_token_type_ids": 0,
            "targets": IGNORE_INDEX, "sample_ids": -1}
    batch = {k: _pad(cols[k], length, v) for k, v in fill.items()}
    batch["attention_mask"] = None
    dtype = positions_dtype(cols["position_ids"])
    batch["position_ids"] = torch.stack([p.to(dtype) for p in cols["position_ids"]], dim=1)
    if one_dimensional:
        batch["position_ids"] = batch["position_ids"][0]
    batch["cu_seqlens"] = torch.cumsum(torch.tensor([0] + lengths), 0)
    batch.update(_images(samples))
    return batch
