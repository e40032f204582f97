"""Tiny configs and processors for any generic family (`ray_dhp.models.generic`), by rules that
read nothing written for the family: transformers' default config of the model type, shrunk.

* Text: hidden 64, 4 query / 4 KV heads of width 16, intermediate 128, 2 layers, the demo
  tokenizer's vocabulary (rounded up to a multiple of 8) and special tokens.
* Vision: hidden 32, 4 heads, intermediate 64, 2 layers, 56-px images of 14-px patches.
* Every other number of the default config that equals the default text (vision) width or head
  width becomes the tiny one (e.g. PaliGemma's ``projection_dim``, Gemma's
  ``query_pre_attn_scalar``: the attention scale stays ``1/sqrt(head_dim)``); a tower's optional pooling
  head (``*use_head``, SigLIP's), which ``get_image_features`` never reads, is off (released
  Gemma 3 and PaliGemma configs have it off too); per-image token counts
  (``mm_tokens_per_image``, ``image_seq_length``, ``num_image_tokens``) become 4 (2x2 squares of
  the 4x4 patch grid); image token ids point at the demo tokenizer's ``<|image_pad|>``; every
  dropout is 0; fp32; ``sdpa`` attention.

`tiny_generic_processor` is the demo tokenizer with transformers' PIL SigLIP image processor
(fixed 56-px images, normalised as SigLIP does) behind `ray_dhp.data.tiles.TileImageProcessor`
(one tile per image).
"""

from __future__ import annotations

from ray_dhp.demo.tokenizer import _token_ids, build_tokenizer

__all__ = ["tiny_generic_config", "tiny_generic_processor", "IMAGE_SIDE", "PATCH"]

IMAGE_SIDE, PATCH = 56, 14
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
         "max_position_embeddings": 4096}
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "image_size": IMAGE_SIDE, "patch_size": PATCH}
_IMAGE_TOKEN_COUNTS = ("mm_tokens_per_image", "image_seq_length", "num_image_tokens")
_IMAGE_TOKEN_IDS = ("image_token_id", "image_token_index")
_DERIVED = ("layer_types", "model_type", "architectures", "transformers_version", "dtype",
            "torch_dtype")


def _shrunk(defaults: dict, sizes: dict, widths: dict) -> dict:
    out = {k: v for k, v in defaults.items() if k not in _DERIVED and not isinstance(v, dict)}
    for k, v in out.items():
        if isinstance(v, int) and not isinstance(v, bool) and v in widths:
            out[k] = widths[v]
        if "dropout" in k and isinstance(v, (int, float)):
            out[k] = 0.0
    out.update({k: v for k, v in sizes.items() if k in defaults or k == "head_dim"})
    return out


def tiny_generic_config(model_type: str):
    """A random-init sized config of ``model_type`` (see the module docstring)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    text0, vision0 = base.get_text_config(), base.vision_config
    ids = _token_ids()
    vocab = -(-len(build_tokenizer()) // 8) * 8
    widths = {text0.hidden_size: _TEXT["hidden_size"], vision0.hidden_size: _VISION["hidden_size"]}
    head_dim = getattr(text0, "head_dim", None) or text0.hidden_size // text0.num_attention_heads
    widths.setdefault(head_dim, _TEXT["head_dim"])  # e.g. Gemma's query_pre_attn_scalar
    text = _shrunk(text0.to_dict(), {**_TEXT, "vocab_size": vocab}, widths)
    text.update(pad_token_id=ids["pad_token_id"], eos_token_id=ids["eos_token_id"],
                bos_token_id=ids["pad_token_id"], tie_word_embeddings=False)
    vision = _shrunk(vision0.to_dict(), _VISION, widths)
    for key in [k for k in vision if k.endswith("use_head")]:
        vision[key] = False  # a pooling head the feature seam never reads (SigLIP's)
    top = _shrunk(base.to_dict(), {}, widths)
    for key in _IMAGE_TOKEN_COUNTS:
        if key in top:
            top[key] = (IMAGE_SIDE // PATCH // 2) ** 2
    for key in _IMAGE_TOKEN_IDS:
        if key in top:
            top[key] = ids["image_token_id"]
    top["tie_word_embeddings"] = False
    text["model_type"], vision["model_type"] = text0.model_type, vision0.model_type
    config = AutoConfig.for_model(model_type, **{**top, "text_config": text, "vision_config": vision})
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    for sub in (config, config.get_text_config(), config.vision_config):
        sub.dtype = "float32"
    config._attn_implementation = "sdpa"
    return config


def tiny_generic_processor(model_type: str):
    """The demo processor for ``model_type``'s tiny config: fixed 56-px images as patch rows."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from ray_dhp.data.processing import VLProcessor
    from ray_dhp.data.tiles import TileImageProcessor
    from ray_dhp.models import family_of

    merge = family_of(tiny_generic_config(model_type)).merge_size(None)
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    return VLProcessor(build_tokenizer(), TileImageProcessor(images, patch_size=PATCH, merge_size=merge))
