"""Vision Ulysses SP on a generic family's tower (`ray_dhp.models.vision_generic_sp`) beyond the
matrix rows (`family_rows.py`: collocated SP2 + TP2 for every family in
`generic_cases.VISION_SP`): with activation checkpointing (each checkpointed layer's recompute in
backward must see its own micro-batch's split: the context rides the layer's keywords), and the
runtime refusal of a tower whose encoder hands its layers no keywords (Idefics3's), where a
recompute could not. fp64 vs the stock single-process model, every rank, as the matrix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.generic_cases import TOLS, TOL, ZERO_GRAD
from tests.distributed.parity import CFG, assert_parity, dense_layout, run_engine, shared_reference

SP2_TP2 = dense_layout("collocated", (2, 1), (2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "gemma3", "mistral3"])
def test_generic_vision_sp_with_activation_checkpointing_is_exact(family, tmp_path_factory):
    """CLIP (its attention passes its keywords on to the interface), SigLIP (it does not: the
    attention module holds the context for its call) and Pixtral (2-D rotary sliced)."""
    ref = shared_reference(tmp_path_factory, family, CFG)
    cfg = dataclasses.replace(CFG, activation_checkpointing=True)
    got = run_engine(family, SP2_TP2, cfg, ref.steps, torch.float64, grads=True)
    assert_parity(got, ref.ref, **dict(TOLS.get(family, TOL), skip=ZERO_GRAD))


@pytest.mark.slow
def test_checkpointing_is_refused_where_the_encoder_hands_no_keywords(tmp_path_factory):
    ref = shared_reference(tmp_path_factory, "idefics3", CFG)
    cfg = dataclasses.replace(CFG, activation_checkpointing=True)
    with pytest.raises(AssertionError, match="hands its layers no keyword arguments"):
        run_engine("idefics3", SP2_TP2, cfg, ref.steps, torch.float64)
