"""A smaller copy of a transformers multimodal config, by rules that read nothing written for
the family: the text and vision widths (and every other number equal to them: projector widths,
Gemma's ``query_pre_attn_scalar``) replaced, dropouts 0, derived keys (``layer_types``)
recomputed by the config class itself (every ``*layer_types`` list).

Used where a model must be run for real but its size does not matter: the generic family's probe
of a model whose ``get_image_features`` cannot run on the meta device (data-dependent shapes,
Idefics3's and Mistral 3's), and the demo's tiny configs (`ray_dhp.demo.generic`).
"""

from __future__ import annotations

__all__ = ["shrink_config", "TEXT", "VISION"]

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 16}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8}
# the same quantity under the names some configs use (Qwen-style vision configs)
_ALIASES = {"num_attention_heads": ("num_heads",), "num_hidden_layers": ("depth",)}
_DERIVED = ("layer_types", "model_type", "architectures", "transformers_version", "dtype",
            "torch_dtype")


def _shrunk(values: dict, sizes: dict, widths: dict) -> dict:
    out = {k: v for k, v in values.items()
           if k not in _DERIVED and not k.endswith("layer_types") and not isinstance(v, dict)}
    for k, v in out.items():
        if isinstance(v, int) and not isinstance(v, bool) and v in widths:
            out[k] = widths[v]
        if "dropout" in k and isinstance(v, (int, float)):
            out[k] = 0.0
    for k, v in sizes.items():
        names = [n for n in (k, *_ALIASES.get(k, ())) if n in values]
        for name in names or ([k] if k == "head_dim" else []):
            out[name] = v
    if "head_dim" in values and values["head_dim"] is None:  # the config derives it
        out["head_dim"] = None
    return out


def _scaled_rope(rope, ratio: float):
    """``rope_parameters`` with an M-RoPE ``mrope_section`` scaled to the new head width (the
    sections split the rotary half of a head: they shrink with it, their sum kept exact)."""
    if not isinstance(rope, dict) or not rope.get("mrope_section"):
        return rope
    sections = list(rope["mrope_section"])
    total = round(sum(sections) * ratio)
    scaled = [max(1, round(x * ratio)) for x in sections]
    scaled[-1] += total - sum(scaled)
    return {**rope, "mrope_section": scaled}


def shrink_config(config, *, text: dict = None, vision: dict = None, top: dict = None):
    """A copy of ``config`` with ``text`` / ``vision`` / ``top`` keys set (defaults `TEXT` /
    `VISION`: widths only, depths and image geometry kept) and every other number equal to a
    replaced width replaced alike. The config class recomputes what it derives."""
    from transformers import AutoConfig

    text, vision = {**TEXT, **(text or {})}, {**VISION, **(vision or {})}
    text0, vision0 = config.get_text_config(), config.vision_config
    widths = {text0.hidden_size: text["hidden_size"], vision0.hidden_size: vision["hidden_size"]}
    head_dim = getattr(text0, "head_dim", None) or text0.hidden_size // text0.num_attention_heads
    widths.setdefault(head_dim, text["head_dim"])
    text_d = {**_shrunk(text0.to_dict(), text, widths), "model_type": text0.model_type}
    rope = _scaled_rope(text0.to_dict().get("rope_parameters"), text["head_dim"] / head_dim)
    if rope is not None:
        text_d["rope_parameters"] = rope
    vision_d = {**_shrunk(vision0.to_dict(), vision, widths), "model_type": vision0.model_type}
    top_d = {**_shrunk(config.to_dict(), {}, widths), **(top or {})}
    out = AutoConfig.for_model(config.model_type, **{**top_d, "text_config": text_d,
                                                     "vision_config": vision_d})
    out._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    return out
