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
        ``mm_token_type_ids`` (0 on padding) — all ``[B, L]`` long — plus ``pixel_values`` and
        ``image_grid_thw``: the samples' images concatenated in batch order, or None if none
        has images.
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
    with_images = [s for s in samples if s.pixel_values is not None]
    batch["pixel_values"] = torch.cat([s.pixel_values for s in with_images]) if with_images else None
    batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images]) if with_images else None
    return batch
