"""Packed rows against padded rows: the assertion `test_packing.py` and `test_video.py` share."""

import torch


def assert_packed_logits_equal(model, samples, padded, packed, common: dict, packed_only=None) -> None:
    """Each sample's per-token logits from the packed rows equal its padded row's within 1e-12
    of the row's largest logit (fp64; ``common``: the vision inputs, passed to both forwards;
    ``packed_only``: further arguments of the packed forward)."""
    with torch.no_grad():
        ref = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                    mm_token_type_ids=padded["mm_token_type_ids"], **common).logits
        got = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                    mm_token_type_ids=packed["mm_token_type_ids"], **common, **(packed_only or {})).logits
    ids = packed["sample_ids"]
    for i, s in enumerate(samples):
        diff = (got[ids == i] - ref[i, :s.num_tokens]).abs().max()
        assert diff <= 1e-12 * ref[i].abs().max(), (i, float(diff))
