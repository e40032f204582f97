"""Collating :class:`~ray_dhp.data.processing.Sample` objects into a right-padded batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ray_dhp.data.processing import IGNORE_INDEX, Sample

__all__ = ["pad_text_batch"]


def _pad(rows: list[torch.Tensor], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
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
        ``mm_token_type_ids`` (0 on padding) — all ``[B, L]`` long — plus ``image_grid_thw``
        and ``pixel_values``: the samples' images concatenated in batch order, or None if none
        has images (``pixel_values`` is also None when the samples came without pixels).
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
    # Text ranks get the grids without the pixels (only vision ranks hold pixels).
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    pixels = [s.pixel_values for s in samples if s.image_grid_thw is not None]
    batch["image_grid_thw"] = torch.cat(grids) if grids else None
    batch["pixel_values"] = torch.cat(pixels) if grids and all(p is not None for p in pixels) else None
    return batch
