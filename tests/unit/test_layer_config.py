"""`ray_dhp.models.layer_config` reads sizes from configs whose layers differ (transformers'
heterogeneous configs), where the global attribute raises."""

from __future__ import annotations

from ray_dhp import demo
from ray_dhp.models.layer_config import layer_max, layer_values


def test_per_layer_sizes_are_read_layer_by_layer():
    text = demo.tiny_model_config("gemma4").get_text_config()  # layer 1: full attention, wider
    assert layer_values(text, "head_dim") == [16, 32] and layer_max(text, "head_dim") == 32
    assert layer_values(text, "num_key_value_heads") == [4]  # not per layer: one value
    plain = demo.tiny_model_config("gemma3").get_text_config()
    assert layer_values(plain, "head_dim") == [16] and layer_max(plain, "no_such_key", 7) == 7
