"""Model FLOPs of a step (the MFU metric's numerator) from the step's real samples."""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.sample import Sample
from ray_dhp.planning.flops import peak_flops, step_flops
from ray_dhp.models.sizes import count_params
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


def test_moe_text_flops_count_the_active_parameters():
    """A mixture-of-experts LM's FLOPs count a token's top-k experts, not all of them. Tiny
    ``qwen3_vl_moe`` by hand: 180,608 text parameters, minus one vocab x hidden = 376 x 64 =
    24,064 (untied: the input embedding is a lookup, not a matmul), minus the 2 sparse layers x
    (8 - 2) idle experts x 3 x 32 x 64 = 73,728: 82,816 active matmul parameters; for 100 tokens
    6 x 82,816 x 100 + causal attention 6 x 2 layers x 64 x 100² = 49,689,600 + 7,680,000."""
    from transformers import AutoConfig

    from ray_dhp.cli.presets import preset_dims

    config = demo.tiny_model_config("qwen3_vl_moe")
    counts = count_params(config)
    assert counts.text == 180_608
    assert text_flops(config, counts.text, 0, 100) == 6 * 82_816 * 100 + 6 * 2 * 64 * 100 ** 2
    # 30B-A3B: 3.04 B active matmul parameters (48 layers: attention 18.87 M, router 0.26 M,
    # 8 of 128 experts x 4.72 M; lm_head 0.31 B), the model card's "A3B" (3.3 B with the embedding)
    dims = preset_dims("qwen3_vl_moe", "30b-a3b")
    config = AutoConfig.for_model(dims.pop("model_type"), **dims)
    counts = count_params(config)
    active = (text_flops(config, counts.text, 0, 1) - 6 * 48 * 4096) / 6
    assert round(active / 1e9, 2) == 3.04


@pytest.mark.parametrize("family", ["minimax_m3_vl", "llama4"])
def test_inactive_experts_of_a_model_whose_experts_take_intermediate_size(family):
    """MiniMax-M3-VL / Llama 4 name no ``moe_intermediate_size``: their experts are
    ``intermediate_size`` wide (their dense MLPs' width has another key), so a token skips
    ``E - k`` of them in each sparse layer (the built-in loop's FLOPs metric raised on
    MiniMax-M3-VL before: no widths)."""
    from ray_dhp.planning.experts import inactive_expert_params, sparse_layer_count

    config = demo.tiny_model_config(family)
    tc = config.text_config
    experts = getattr(tc, "num_local_experts", None) or tc.num_experts
    assert sparse_layer_count(config) > 0
    assert inactive_expert_params(config) == sparse_layer_count(config) * 3 * tc.hidden_size * (
        experts - tc.num_experts_per_tok) * tc.intermediate_size
