"""Anyres tiling in the generic family (`ray_dhp.models.generic_probe.anyres`: LLaVA-OneVision's
``image_grid_pinpoints``): the samples are what the model's own processor makes (its tiles of
each image, ``image_sizes``, and as many image tokens as it counts per image), those counts are
the stock model's feature rows per image (they differ with the aspect ratio), and the
``image_newline`` parameter ``get_image_features`` appends is held by the vision side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ray_dhp import demo
from ray_dhp.data.tiles import tile_rows
from ray_dhp.models import build_model, family_of

FAMILY = "llava_onevision"
SIZES = ((56, 56), (84, 56), (70, 130))  # (height, width): 1 / 2 / 6 tiles past the base one


@pytest.fixture(scope="module")
def sample_and_ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("anyres")
    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"{k}.png")
    record = {"image": [f"{k}.png" for k in range(len(SIZES))], "conversations": [
        {"from": "human", "value": "<image><image>\nCompare.<image>"},
        {"from": "gpt", "value": "Three squares."}]}
    ours = demo.tiny_processor(FAMILY)
    sample = ours.process(record, root)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                         {"type": "text", "text": "\nCompare."}, {"type": "image"}]},
            {"role": "assistant", "content": "Three squares."}]
    proc = ours.processor
    text = proc.apply_chat_template(conv, tokenize=False)
    images = [Image.open(root / f"{k}.png").convert("RGB") for k in range(len(SIZES))]
    ref = proc(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    return sample, ref


def test_samples_are_what_the_models_own_processor_makes(sample_and_ref):
    sample, ref = sample_and_ref
    assert torch.equal(sample.input_ids, ref["input_ids"][0])
    assert torch.equal(sample.image_sizes, ref["image_sizes"])
    tiles = [int(t) for t in sample.image_grid_thw[:, 0]]
    assert tiles == [2, 3, 7]  # the base tile + the best pinpoint's tiles, per image
    want = torch.cat([tile_rows(ref["pixel_values"][k, :t].float(), 14) for k, t in enumerate(tiles)])
    assert torch.equal(sample.pixel_values, want)  # each image's own tiles, no padding tiles
    assert int(sample.item_rows.sum()) == int((sample.mm_token_type_ids == 1).sum())


def test_the_processors_counts_are_the_stock_models_rows(sample_and_ref):
    """The rows ``get_image_features`` makes of each image (the stock model, from the sample's
    patch rows as the reference hands them) are the processor's counts; they are not the
    grid's patches (a count from the grid would be wrong)."""
    sample, _ = sample_and_ref
    config = demo.tiny_model_config(FAMILY)
    family, model = family_of(config), build_model(config, seed=0)
    kwargs = family.stock_inputs(config, {"pixel_values": sample.pixel_values,
                                          "image_grid_thw": sample.image_grid_thw,
                                          "image_sizes": sample.image_sizes})
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=kwargs["pixel_values"],
                                             image_sizes=kwargs["image_sizes"], return_dict=True)
    rows = [int(p.shape[0]) for p in out.pooler_output]
    assert rows == sample.item_rows.tolist()
    assert rows != (sample.image_grid_thw.prod(-1) // family.merge_size(config) ** 2).tolist()


def test_image_newline_is_held_by_the_vision_side():
    config = demo.tiny_model_config(FAMILY)
    family, model = family_of(config), build_model(config, seed=0)
    assert family.tiled_input and family.merge_size(config) == 1
    assert "image_newline" in family.vision_parts and "model.image_newline" in family.merger_prefixes
    shell = family.visual(model)
    assert shell.image_newline is model.model.image_newline
    assert family.visual(model) is shell  # one shell per model: the parts materialise into it
    assert family.encoder_parts("vision", model) == {"model.": shell}


def test_a_processor_that_does_not_tile_anyres_is_refused_in_the_driver():
    """A processor in the default (Qwen) format counts rows from the patch grid: for an anyres
    model that count is wrong, so the driver refuses it, naming the reason."""
    from ray_dhp.config.checks import ConfigError
    from ray_dhp.data.compat import check_processor_fits

    config = demo.tiny_model_config(FAMILY)
    check_processor_fits(demo.tiny_processor(FAMILY), config, processor_at="p", model_at="m")
    with pytest.raises(ConfigError, match="anyres"):
        check_processor_fits(demo.tiny_processor("qwen2_vl"), config, processor_at="p", model_at="m")
