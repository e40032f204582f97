"""Packed collation: several samples per row, each keeping its own positions, attention and
targets (`ray_dhp.data.collate.pack_text_batch`)."""

from dataclasses import replace

import pytest
import torch

from ray_dhp.data import IGNORE_INDEX, pack_text_batch, pad_text_batch, read_annotations, resolve_data_root
from ray_dhp.data.collate import pack_rows
from ray_dhp.demo import make_dataset, tiny_model_config, tiny_processor
from ray_dhp.models import build_model
from tests.unit.packed_logits import assert_packed_logits_equal

MAX_TOKENS = 80  # samples here are 30-43 tokens (system turn included): rows of 2 samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Every 4th sample text-only, image sizes cycling through 3 shapes (grids 4x4, 4x6, 6x8)."""
    return make_dataset(tmp_path_factory.mktemp("shapes"), num_samples=6, text_only_every=4,
                        image_sizes=((56, 56), (84, 56), (112, 84)))


def _samples(family, dataset):
    proc = tiny_processor(family)
    return [proc.process(r, resolve_data_root(dataset)) for r in read_annotations(dataset)]


@pytest.fixture(scope="module")
def model64():
    """Tiny fp64 Qwen2.5-VL (random init); its get_rope_index is what the model computes."""
    return build_model(tiny_model_config("qwen2_5_vl"), seed=0, dtype=torch.float64).eval()


def test_pack_rows_is_greedy_in_order():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [range(0, 2), range(2, 4), range(4, 5)]
    assert pack_rows([5, 3, 4], None) == [range(0, 3)]
    assert pack_rows([8, 8], 8) == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="max_tokens=8"):
        pack_rows([3, 9], 8)


def test_pack_text_batch_boundaries_positions_targets(dataset, model64):
    samples = _samples("qwen2_5_vl", dataset)
    lengths = [s.num_tokens for s in samples]
    packed = pack_text_batch(samples, pad_id=0, max_tokens=MAX_TOKENS,
                             rope_index=model64.model.get_rope_index)
    rows = pack_rows(lengths, MAX_TOKENS)
    assert len(rows) > 1 and any(len(r) > 1 for r in rows)
    R, L = packed["input_ids"].shape
    assert (R, L) == (len(rows), max(sum(lengths[i] for i in r) for r in rows)) and L <= MAX_TOKENS
    assert packed["attention_mask"] is None and packed["position_ids"].shape == (4, R, L)

    # Positions as the model computes them in the padded batch (one sample per row).
    padded = pad_text_batch(samples, pad_id=0)
    rope, _ = model64.model.get_rope_index(padded["input_ids"], padded["mm_token_type_ids"],
                                           image_grid_thw=padded["image_grid_thw"],
                                           attention_mask=padded["attention_mask"])
    for row, rng in enumerate(rows):
        off = 0
        for i in rng:
            s, n = samples[i], lengths[i]
            cut = slice(off, off + n)
            assert torch.equal(packed["input_ids"][row, cut], s.input_ids)
            assert torch.equal(packed["labels"][row, cut], s.labels)
            assert torch.equal(packed["mm_token_type_ids"][row, cut], s.mm_token_type_ids)
            assert (packed["sample_ids"][row, cut] == i).all()
            # text positions restart at every sample; M-RoPE rows equal the model's own
            assert torch.equal(packed["position_ids"][0, row, cut], torch.arange(n))
            assert torch.equal(packed["position_ids"][1:, row, cut], rope[:, i, :n])
            # targets stay inside the sample: shifted labels, -100 at its last token
            assert torch.equal(packed["targets"][row, off:off + n - 1], s.labels[1:])
            assert packed["targets"][row, off + n - 1] == IGNORE_INDEX
            off += n
        tail = slice(off, L)
        assert not packed["input_ids"][row, tail].any() and (packed["sample_ids"][row, tail] == -1).all()
        assert (packed["targets"][row, tail] == IGNORE_INDEX).all()
        assert (packed["labels"][row, tail] == IGNORE_INDEX).all()
    assert int((packed["targets"] != IGNORE_INDEX).sum()) == sum(int((s.labels[1:] != IGNORE_INDEX).sum())
                                                                 for s in samples)
    # images in sample order
    assert torch.equal(packed["image_grid_thw"], padded["image_grid_thw"])
    assert torch.equal(packed["pixel_values"], padded["pixel_values"])


def test_packed_positions_give_a_block_diagonal_causal_mask(dataset, model64):
    """transformers builds the mask from the text-position row: no token sees another sample."""
    from transformers.masking_utils import create_causal_mask

    samples = _samples("qwen2_5_vl", dataset)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model64.model.get_rope_index)
    R, L = packed["input_ids"].shape
    config = model64.model.language_model.config
    assert config._attn_implementation == "sdpa"
    mask = create_causal_mask(config=config, inputs_embeds=torch.zeros(R, L, 8, dtype=torch.float64),
                              attention_mask=None, cache=None, position_ids=packed["position_ids"][0])
    ids = packed["sample_ids"]  # the padded tail (-1) is a block of its own
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    expected = (ids[:, :, None] == ids[:, None, :]) & causal
    assert torch.equal(mask[:, 0], expected)


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen2_vl", marks=pytest.mark.slow)])
def test_packed_forward_equals_padded_fp64(family, dataset, model64):
    """Per-token logits of each sample are the same packed or padded (fp64: only the summation
    order of the attention over a longer masked row differs, ~1e-16 measured; 1e-12 bound)."""
    samples = _samples(family, dataset)
    model = model64 if family == "qwen2_5_vl" else build_model(
        tiny_model_config(family), seed=0, dtype=torch.float64).eval()
    padded = pad_text_batch(samples, 0)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model.model.get_rope_index)
    common = dict(pixel_values=padded["pixel_values"].double(), image_grid_thw=padded["image_grid_thw"],
                  use_cache=False)
    assert_packed_logits_equal(model, samples, padded, packed, common)


def test_grids_without_pixels(dataset, model64):
    """Text-only ranks may get samples with grids but no pixels: the grids still come through."""
    samples = _samples("qwen2_5_vl", dataset)
    no_pixels = [replace(s, pixel_values=None) for s in samples]
    for batch in (pad_text_batch(no_pixels, 0),
                  pack_text_batch(no_pixels, 0, rope_index=model64.model.get_rope_index)):
        assert batch["pixel_values"] is None
        assert torch.equal(batch["image_grid_thw"],
                           torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None]))
    mixed = pad_text_batch([samples[0], replace(samples[1], pixel_values=None)], 0)
    assert mixed["pixel_values"] is None and mixed["image_grid_thw"].shape[0] == 2
    with pytest.raises(ValueError, match="rope_index"):
        pack_text_batch(samples, 0)

