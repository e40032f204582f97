"""Model FLOPs of a step (the MFU metric's numerator) from the step's real samples."""

import torch

from ray_dhp import demo
from ray_dhp.data.processing import Sample
from ray_dhp.planning.flops import peak_flops, step_flops
from ray_dhp.planning.memory import count_params
from ray_dhp.planning.recommend import text_flops, vision_flops


def _sample(tokens, grids=None):
    ids = torch.zeros(tokens, dtype=torch.long)
    return Sample(0, ids, ids, ids, None, None if grids is None else torch.tensor(grids))


def test_step_flops_add_up_per_sample_and_per_image():
    config = demo.tiny_model_config("qwen2_5_vl")
    counts = count_params(config)
    a, b = _sample(40), _sample(60, [[1, 8, 8], [1, 4, 8]])
    got = step_flops(config, counts, [[a], [b]])
    want = (text_flops(config, counts.text, 0, 40) + text_flops(config, counts.text, 0, 60)
            + vision_flops(config, counts.vision, 64) + vision_flops(config, counts.vision, 32))
    assert got == want
    # dense part dominates: at least 6 x params x tokens for the text model's matmuls
    assert text_flops(config, counts.text, 0, 100) >= 6 * (counts.text - config.text_config.vocab_size
                                                             * config.text_config.hidden_size) * 100


def test_no_mfu_without_a_known_peak():
    assert peak_flops(torch.device("cpu"), "bfloat16") is None
    assert peak_flops(torch.device("cpu"), None) is None
