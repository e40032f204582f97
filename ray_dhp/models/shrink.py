"""A smaller copy of a transformers multimodal config, by rules that read nothing written for
the family: the text and vision widths (and every other number equal to them: projector widths,
Gemma's ``query_pre_attn_scalar``) replaced, dropouts 0, derived keys (``layer_types``)
recomputed by the config class itself (every ``*layer_types`` list), other per-layer lists cut
to the new depth, a mixture-of-experts LM's experts shrunk (`EXPERTS`).

Used where a model must be run for real but its size does not matter: the generic family's probe
of a model whose ``get_image_features`` cannot run on the meta device (data-dependent shapes,
Idefics3's and Mistral 3's), and the demo's tiny configs (`ray_dhp.demo.generic`).
"""

from __future__ import annotations

import functools

__all__ = ["shrink_config", "tiny_config", "TEXT", "VISION", "IMAGE_SIDE", "PATCH"]

IMAGE_SIDE, PATCH = 56, 14  # tiny images: 4x4 patches
_IMAGE_TOKEN_COUNTS = ("mm_tokens_per_image", "image_seq_length", "num_image_tokens")

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 16}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8}
# the same quantity under the names some configs use (Qwen-style vision configs)
_ALIASES = {"num_attention_heads": ("num_heads",), "num_hidden_layers": ("depth",)}
_DERIVED = ("layer_types", "model_type", "architectures", "transformers_version", "dtype",
            "torch_dtype")


#: a mixture-of-experts LM's keys (transformers' names, read where a config has them): 4 experts,
#: top-2 (one group, so group-limited routing keeps all), experts of width 32, the first layer
#: dense where the config makes leading layers dense (so a 2-layer copy keeps a sparse one),
#: a separate dense-MLP width (Llama 4's ``intermediate_size_mlp``) at the tiny MLP width
EXPERTS = {"num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
           "num_experts_per_tok": 2, "moe_k": 2, "moe_intermediate_size": 32, "n_group": 1,
           "topk_group": 1, "first_k_dense_replace": 1, "intermediate_size_mlp": 128}


def _shrunk(values: dict, sizes: dict, widths: dict) -> dict:
    out = {k: v for k, v in values.items()
           if k not in _DERIVED and not k.endswith("layer_types") and not isinstance(v, dict)}
    depth0, depth = values.get("num_hidden_layers"), sizes.get("num_hidden_layers")
    for k, v in out.items():  # per-layer lists (Llama 4's ``no_rope_layers``, ``moe_layers``)
        if isinstance(v, list) and depth and isinstance(depth0, int) and len(v) == depth0 > depth:
            out[k] = v[:depth]
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
    replaced width replaced alike; a tower's ``out_hidden_size`` and a top-level ``hidden_size``
    (what feeds the language model) become the text width. The config class recomputes what it
    derives; M-RoPE sections the modeling code defaults scaled to the new head
    (`_mrope_sections`)."""
    from transformers import AutoConfig

    text0, vision0 = config.get_text_config(), config.vision_config
    experts = {k: _fit(text0, k, v) for k, v in EXPERTS.items() if getattr(text0, k, None) is not None}
    text, vision = {**TEXT, **experts, **(text or {})}, {**VISION, **(vision or {})}
    heads0, kv0 = getattr(vision0, "num_attention_heads", 0), getattr(vision0, "num_key_value_heads", None)
    if isinstance(kv0, int) and isinstance(heads0, int) and heads0 % kv0 == 0:
        # the tower's query heads per key/value head kept (no GQA: Gemma 4's; GQA: LFM3-VL's)
        vision.setdefault("num_key_value_heads", max(1, vision["num_attention_heads"] * kv0 // heads0))
    widths = {text0.hidden_size: text["hidden_size"], vision0.hidden_size: vision["hidden_size"]}
    head_dim = text0.to_dict().get("head_dim") or text0.hidden_size // text0.num_attention_heads
    widths.setdefault(head_dim, text["head_dim"])
    if "vocab_size" in text:  # a second table of the vocabulary's size (Gemma 4's per-layer one)
        widths.setdefault(text0.vocab_size, text["vocab_size"])
    text_d = {**_shrunk(text0.to_dict(), text, widths), "model_type": text0.model_type}
    rope = _scaled_rope(text0.to_dict().get("rope_parameters"), text["head_dim"] / head_dim)
    if rope is not None:
        text_d["rope_parameters"] = rope
    vision_d = {**_shrunk(vision0.to_dict(), vision, widths), "model_type": vision0.model_type}
    top_d = {**_shrunk(config.to_dict(), {}, widths), **(top or {})}
    # the widths that feed the language model are its width, whatever the (inconsistent)
    # defaults of the sub-configs say: a tower's ``out_hidden_size``, a top-level ``hidden_size``
    for d, key in ((vision_d, "out_hidden_size"), (top_d, "hidden_size")):
        if isinstance(d.get(key), int):
            d[key] = text_d["hidden_size"]
    _pixel_shuffle_widths(vision_d, text_d["hidden_size"])
    depth = vision_d.get("num_hidden_layers")
    for d in (vision_d, top_d):  # a tower layer's index past the new depth (MiniCPM-V 4.6's
        for k, v in d.items():   # ``insert_layer_id``, its merger): after the first half
            if k.endswith("layer_id") and isinstance(v, int) and isinstance(depth, int) and v >= depth:
                d[k] = max(depth // 2 - 1, 0)
    out = AutoConfig.for_model(config.model_type, **{**top_d, "text_config": text_d,
                                                     "vision_config": vision_d})
    overrides = _per_layer(text0, out.get_text_config(), widths, text["head_dim"] / head_dim)
    if overrides is not None:  # a heterogeneous LM (per-layer head widths): rebuilt with them
        text_d.update(per_layer_config=overrides, layer_types=out.get_text_config().layer_types)
        out = AutoConfig.for_model(config.model_type, **{**top_d, "text_config": text_d,
                                                         "vision_config": vision_d})
    out._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    _mrope_sections(config, out.get_text_config())
    return out


def _per_layer(text0, text, widths: dict, ratio: float):
    """The per-layer overrides of a heterogeneous language model (``per_layer_config``: Gemma
    4's wider heads on its full-attention layers) for the copy ``text``: each new layer takes
    the overrides of the first original layer of its type (``layer_types``; else of its
    index), widths replaced as elsewhere and head widths scaled with the head; None where the
    config has none."""
    given = text0.to_dict().get("per_layer_config")
    if not isinstance(given, dict) or not given:
        return None
    given = {int(k): v for k, v in given.items()}
    types0, types = getattr(text0, "layer_types", None), getattr(text, "layer_types", None)
    out = {}
    for i in range(text.num_hidden_layers):
        src = types0.index(types[i]) if types0 and types and types[i] in types0 else i
        layer = {}
        for k, v in given.get(src, {}).items():
            if isinstance(v, int) and not isinstance(v, bool):
                v = widths.get(v, max(1, round(v * ratio)) if k.endswith("head_dim") else v)
            layer[k] = v
        if layer:
            out[i] = layer
    return out


def _pixel_shuffle_widths(vision_d: dict, width: int) -> None:
    """A tower whose projector MLP follows a pixel shuffle (Llama 4's ``pixel_shuffle_ratio``,
    ``projector_input_dim`` / ``projector_output_dim``, ``vision_output_dim``) takes the
    shuffled width ``hidden / ratio²`` under the name ``intermediate_size`` and hands
    ``vision_output_dim`` on: made consistent (transformers' default config is not: 768 / 0.25 is
    not its 5632), the projector widths the language model's."""
    ratio = vision_d.get("pixel_shuffle_ratio")
    if not isinstance(ratio, float) or not isinstance(vision_d.get("projector_input_dim"), int):
        return
    vision_d["intermediate_size"] = round(vision_d["hidden_size"] / ratio ** 2)
    for key in ("projector_input_dim", "projector_output_dim", "vision_output_dim"):
        if key in vision_d:
            vision_d[key] = width


def _fit(text0, key: str, value):
    """`EXPERTS`'s ``value`` for ``key`` in the shape ``text0`` has it (a list of widths: one per
    kind of expert, ERNIE-4.5-VL's), never above a count the config already has."""
    old = getattr(text0, key)
    if isinstance(old, (list, tuple)):
        return [value] * len(old)
    return min(old, value) if key in ("num_experts_per_tok", "moe_k", "first_k_dense_replace") \
        else value


def tiny_config(base, *, text: dict = None, top: dict = None):
    """A random-init sized copy of ``base`` (transformers' default config of a model type): widths
    as `shrink_config`, 2 text and 2 vision layers, 56-px images of 14-px patches, per-image token
    counts 4 (2x2 squares of the 4x4 patch grid), anyres tilings of 56-px tiles (`_tiles`), a
    tower's optional pooling head off (SigLIP's
    ``vision_use_head``: ``get_image_features`` never reads it), M-RoPE sections for the tiny
    head where the config leaves them to the modeling code (its default, scaled), no tied embeddings, fp32, ``sdpa``
    (``eager`` for a class that has no ``sdpa`` path).
    ``text`` / ``top``: further keys (the demo's vocabulary and special tokens)."""
    vision = {"num_hidden_layers": 2, "image_size": IMAGE_SIDE, "patch_size": PATCH,
              **{k: False for k in base.vision_config.to_dict() if k.endswith("use_head")}}
    text = {"num_hidden_layers": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            **(text or {})}
    top = {**{k: (IMAGE_SIDE // PATCH // 2) ** 2 for k in _IMAGE_TOKEN_COUNTS if hasattr(base, k)},
           "tie_word_embeddings": False, **_tiles(base), **(top or {})}
    config = shrink_config(base, text=text, vision=vision, top=top)
    for sub in (config, config.get_text_config(), config.vision_config):
        sub.dtype = "float32"
    config._attn_implementation = "sdpa" if _supports_sdpa(config) else "eager"
    if any(getattr(config.get_text_config(), k, None) for k in EXPERTS if "experts" in k):
        config._experts_implementation = "eager"  # the per-expert loop: grouped_mm has no fp64
    return config


def _tiles(base) -> dict:
    """``image_grid_pinpoints`` (anyres tilings: each a whole number of the tower's tiles a side)
    at the tiny tile: the same tilings of `IMAGE_SIDE`-px tiles."""
    pins, size = getattr(base, "image_grid_pinpoints", None), getattr(base.vision_config, "image_size", None)
    if not pins or not isinstance(size, int):
        return {}
    return {"image_grid_pinpoints": [[h * IMAGE_SIDE // size, w * IMAGE_SIDE // size] for h, w in pins]}


def _supports_sdpa(config) -> bool:
    """Whether the config's image-text-to-text class runs with ``sdpa`` (GOT-OCR2's does not)."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    return cls is None or getattr(cls, "_supports_sdpa", True) is not False


def _mrope_sections(base, text) -> None:
    """An M-RoPE language model whose config leaves ``mrope_section`` to the modeling code's
    default (GLM-4V's, ERNIE-4.5-VL's, PaddleOCR-VL's): that default, read from the rotary
    module the model's own class builds from ``base`` (on the meta device), scaled to the tiny
    head's rotary half as `_scaled_rope` scales a config's own sections. The default's
    proportions are the family's (ERNIE's interleaved h / w sections must stay equal)."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if "mrope_section" in rope:
        return
    default = _modeling_mrope_section(base.to_json_string(use_diff=False), type(base))
    if not default:
        return
    factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0
    half = int(text.head_dim * factor) // 2
    text.rope_parameters = _scaled_rope({**rope, "mrope_section": default}, half / sum(default))


@functools.lru_cache(maxsize=None)
def _modeling_mrope_section(config_json: str, config_cls):
    """The ``mrope_section`` a module of the model's own class keeps when the config gives none
    (the modeling code's default), or None (no M-RoPE, or the class cannot be built here)."""
    import json

    import torch
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(config_cls, None)
    if cls is None:
        return None
    try:
        with torch.device("meta"):
            model = cls._from_config(config_cls.from_dict(json.loads(config_json)))
    except Exception:  # noqa: BLE001 - a class that cannot be built: the probe says why
        return None
    return next((list(m.mrope_section) for m in model.modules()
                 if isinstance(getattr(m, "mrope_section", None), (list, tuple))), None)
