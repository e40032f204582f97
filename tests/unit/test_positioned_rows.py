"""The model processor path (`ray_dhp.data.model_processor`) takes an image processor's padded
patch rows with each patch's position (Gemma 4's ``image_position_ids``) as ray_dhp's patch rows
and grids, and checks the processor's own placeholder counts (``num_soft_tokens_per_image``)
against the rows it counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ray_dhp.data.model_processor import _check_counts, positioned_rows
from ray_dhp.models.generic_probe import padded_inputs


def _processed():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
              for h, w in ((300, 200), (90, 400))]
    return Gemma4ImageProcessorPil(max_soft_tokens=70)(images=images, return_tensors="pt")


def test_padded_rows_with_positions_round_trip():
    out = _processed()  # resized to each image's own grid, padded to 70 * 9 patches
    rows, grid = positioned_rows(out["pixel_values"], out["image_position_ids"], 16)
    assert grid[:, 0].tolist() == [1, 1] and rows.shape[0] == int(grid.prod(-1).sum())
    _check_counts(out, grid, 3, "Gemma4ImageProcessorPil")  # the processor's counts: 3x3 rows
    back = padded_inputs(("image_position_ids",), rows, grid, 16, 3)
    n = back["pixel_values"].shape[1]
    assert torch.equal(back["pixel_values"], out["pixel_values"][:, :n].float())
    assert torch.equal(back["image_position_ids"], out["image_position_ids"][:, :n].long())


def test_counts_that_disagree_are_refused_naming_both():
    out = _processed()
    rows, grid = positioned_rows(out["pixel_values"], out["image_position_ids"], 16)
    with pytest.raises(ValueError, match="soft tokens per image"):
        _check_counts(out, grid, 2, "Gemma4ImageProcessorPil")
