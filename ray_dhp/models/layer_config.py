"""Reading a language model's sizes from a config whose layers may differ (transformers'
heterogeneous configs: Gemma 4's full-attention layers with wider heads, ``per_layer_config``),
where the global attribute raises (``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError).

    head_dim = layer_max(text_config, "head_dim")          # the widest layer's
    kv_heads = layer_values(text_config, "num_key_value_heads")   # every layer's
"""

from __future__ import annotations

__all__ = ["layer_max", "layer_values"]


def layer_values(config, key: str, default=None) -> list:
    """``key`` of every layer of ``config`` (one value for a config whose layers do not differ
    in it; ``[default]`` where it has none)."""
    try:
        return [getattr(config, key, default)]
    except RuntimeError:  # a per-layer attribute of a heterogeneous config
        return [getattr(layer, key, default) for layer in config.per_layer_config]


def layer_max(config, key: str, default=None):
    """The largest ``key`` over ``config``'s layers (`layer_values`; ``default`` where none)."""
    values = [v for v in layer_values(config, key, default) if v is not None]
    return max(values) if values else default
