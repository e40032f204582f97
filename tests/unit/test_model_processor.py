"""The generic families' samples come from the model's own transformers processor
(`ray_dhp.data.model_processor`): token for token what transformers' processor of the model
makes for the same conversation and image, replies (with the template's end-of-turn token)
trained and nothing else, and the driver's checks name a processor that does not fit."""

import numpy as np
import pytest
import torch
from PIL import Image

from ray_dhp.data.compat import check_processor_fits
from ray_dhp.data.model_processor import ModelProcessor, reply_end, run_processor
from ray_dhp.data.processing import VLProcessor
from ray_dhp.data.sample import IGNORE_INDEX
from ray_dhp.data.tiles import tile_rows
from ray_dhp.config.checks import ConfigError
from ray_dhp.demo import tiny_model_config
from ray_dhp.demo.model_dirs import MODEL_DIRS, model_dir

PATCH = 14


def _dir(family, path):
    config = model_dir(family, path)
    from transformers import AutoProcessor

    return config, AutoProcessor.from_pretrained(path, local_files_only=True)


RECORD = {"image": "a.png", "conversations": [
    {"from": "human", "value": "<image>\nWhat is in the picture?"},
    {"from": "gpt", "value": "A red square."},
    {"from": "human", "value": "And its size?"},
    {"from": "gpt", "value": "Small."}]}


@pytest.fixture
def image_root(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (70, 90, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    return tmp_path


@pytest.mark.parametrize("family", sorted(MODEL_DIRS))
def test_samples_are_what_the_models_own_processor_makes(family, tmp_path, image_root):
    config, proc = _dir(family, tmp_path / "model")
    ours = run_processor(str(tmp_path / "model"), config)
    assert isinstance(ours, ModelProcessor)
    check_processor_fits(ours, config, processor_at="p", model_at="m")  # fits: no error
    sample = ours.process(RECORD, image_root)

    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is in the picture?"}]},
            {"role": "assistant", "content": "A red square."},
            {"role": "user", "content": "And its size?"},
            {"role": "assistant", "content": "Small."}]
    text = proc.apply_chat_template(conv, tokenize=False)
    image = Image.open(image_root / "a.png").convert("RGB")
    ref = proc(text=[text], images=[image], return_tensors="pt", add_special_tokens=False,
               return_mm_token_type_ids=True)
    assert torch.equal(sample.input_ids, ref["input_ids"][0])
    types = ref["mm_token_type_ids"] if "mm_token_type_ids" in ref else ref["token_type_ids"]  # Gemma 3's name
    assert torch.equal(sample.mm_token_type_ids, types[0])
    assert torch.equal(sample.pixel_values, tile_rows(ref["pixel_values"].float(), PATCH))
    rows = int(sample.image_grid_thw.prod()) // ours.merge_size ** 2
    assert int((sample.mm_token_type_ids == 1).sum()) == rows
    # trained: each reply and the end-of-turn token the template writes after it, nothing else
    end = reply_end(ours.tokenizer, ours.renderer.chat_template)
    assert end == {"gemma3": "<end_of_turn>", "llava": "</s>"}[family]
    trained = ours.tokenizer.decode(sample.labels[sample.labels != IGNORE_INDEX])
    assert trained == f"A red square.{end}Small.{end}"


def test_a_demo_directory_in_qwen_format_still_loads(tmp_path):
    """A generic model's directory that holds ray_dhp's demo processor (Qwen-VL prompt format,
    no transformers multimodal processor) is read as before."""
    from ray_dhp.demo import tiny_processor

    tiny_processor("llava").save_pretrained(tmp_path)
    out = run_processor(str(tmp_path), tiny_model_config("llava"))
    assert type(out) is VLProcessor


def test_a_processor_of_another_size_is_refused_naming_both(tmp_path):
    config, proc = _dir("gemma3", tmp_path / "model")
    ours = run_processor(str(tmp_path / "model"), config)
    config.vision_config.image_size = 112
    with pytest.raises(ConfigError, match=r"56-px images but m \(config.json\) vision_config.image_size=112"):
        check_processor_fits(ours, config, processor_at="p", model_at="m")
    config.vision_config.image_size = 56
    config.image_token_id = 3
    with pytest.raises(ConfigError, match=r"image tokens have the ids .* image_token_id=3"):
        check_processor_fits(ours, config, processor_at="p", model_at="m")
