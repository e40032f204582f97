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
(one tile per image); a tower on patch rows (GLM-4V's) gets Qwen2-VL's PIL processor at its
patch, merge and temporal sizes (56..112-px images), and a tower on padded rows per image
(SigLIP 2's NaFlex, LFM2-VL's) or on patch rows without Qwen's ``spatial_merge_size``
(Kimi-K2.5's, whose processor patchifies in raster order) the same with one frame per image
and raster-ordered rows. An anyres model (``image_grid_pinpoints``: LLaVA-NeXT's, -OneVision's)
gets its own processor class (`tiled_processor`) behind `ray_dhp.data.model_processor`.
"""

from __future__ import annotations

import torch

from ray_dhp.demo.tokenizer import _token_ids, build_tokenizer
from ray_dhp.models.shrink import IMAGE_SIDE, PATCH

__all__ = ["tiny_generic_config", "tiny_generic_processor", "tiled_processor", "own_processor",
           "IMAGE_SIDE", "PATCH"]


def _raster_processor():
    """Qwen2-VL's PIL processor (one frame per image) with each image's patch rows in raster
    order, the order `ray_dhp.data.tiles` and a tower on padded rows per image take (Qwen2-VL's
    own order groups them by merge square)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class RasterRowsImageProcessor(Qwen2VLImageProcessorPil):
        def preprocess(self, *args, **kwargs):
            out = super().preprocess(*args, **kwargs)
            if out.get("pixel_values") is None:
                return out
            m, blocks = self.merge_size, []
            rows = out["pixel_values"].split(out["image_grid_thw"].prod(-1).tolist())
            for x, (t, h, w) in zip(rows, out["image_grid_thw"].tolist()):
                x = x.reshape(t, h // m, w // m, m, m, -1).permute(0, 1, 3, 2, 4, 5)
                blocks.append(x.reshape(t * h * w, -1))
            out["pixel_values"] = torch.cat(blocks)
            return out

    return RasterRowsImageProcessor

_TOKEN_IDS = {  # config key -> the demo tokenizer's token (`_token_ids`)
    "image_token_id": "image_token_id", "image_token_index": "image_token_id",
    "video_token_id": "video_token_id", "image_start_token_id": "vision_start_token_id",
    "vision_start_token_id": "vision_start_token_id", "image_end_token_id": "vision_end_token_id",
    "vision_end_token_id": "vision_end_token_id"}


def tiny_generic_config(model_type: str):
    """A random-init sized config of ``model_type`` (see the module docstring): `tiny_config`
    with the demo tokenizer's vocabulary and special tokens."""
    from transformers import AutoConfig

    from ray_dhp.models.shrink import tiny_config
    from ray_dhp.models.survey import with_vision

    base = with_vision(AutoConfig.for_model(model_type))
    ids = _token_ids()
    vocab = -(-len(build_tokenizer()) // 8) * 8
    text = {"vocab_size": vocab, "pad_token_id": ids["pad_token_id"],
            "eos_token_id": ids["eos_token_id"], "bos_token_id": ids["pad_token_id"]}
    top = {k: ids[which] for k, which in _TOKEN_IDS.items() if hasattr(base, k)}
    config = tiny_config(base, text=text, top=top)
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    return config


def tiny_generic_processor(model_type: str):
    """The demo processor for ``model_type``'s tiny config: fixed 56-px images as patch rows."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from ray_dhp.data.processing import VLProcessor
    from ray_dhp.data.tiles import TileImageProcessor
    from ray_dhp.models import family_of

    config = tiny_generic_config(model_type)
    family = family_of(config)
    if family.tiled_input:  # anyres tiles: the model's own processor counts each image's rows
        return tiled_processor(config)
    if family.grid_input or family.padded_input or family.packed_input:  # any size: Qwen2-VL's
        vc = config.vision_config
        limits = dict(min_pixels=IMAGE_SIDE ** 2, max_pixels=(2 * IMAGE_SIDE) ** 2,
                      patch_size=vc.patch_size, merge_size=family.merge_size(config))
        from ray_dhp.models.generic import grid_geometry

        if family.grid_input and grid_geometry(vc)[2]:  # Qwen's merge-square order (GLM-4V's)
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            return VLProcessor(build_tokenizer(), Qwen2VLImageProcessorPil(
                temporal_patch_size=grid_geometry(vc)[1], **limits))
        return VLProcessor(build_tokenizer(), _raster_processor()(temporal_patch_size=1, **limits))
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    return VLProcessor(build_tokenizer(),
                       TileImageProcessor(images, patch_size=PATCH, merge_size=family.merge_size(None)))


def tiled_processor(config):
    """The model's own processor class (transformers' processor and PIL image processor of
    ``config.model_type``) at the tiny sizes, as a `ray_dhp.data.model_processor.ModelProcessor`:
    56-px tiles of the config's (tiny) ``image_grid_pinpoints``, the demo tokenizer and chat
    template, the image token ``<|image_pad|>`` (`own_processor`)."""
    from ray_dhp.data.model_processor import ModelProcessor

    return ModelProcessor(own_processor(config), patch_size=PATCH, merge_size=1)


def own_processor(config):
    """``config.model_type``'s transformers processor for the tiny config: the keywords its
    ``__init__`` names set from the config (``num_image_tokens``: a tile's patches;
    ``patch_size``; ``vision_feature_select_strategy``; one additional token, the class token
    the "default" strategy drops); a video processor the class names left out (it needs
    torchvision). Pickled as the call that builds it (its class is made here)."""
    import inspect

    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES, get_image_processor_class_from_name)
    from transformers.models.auto.processing_auto import (PROCESSOR_MAPPING_NAMES,
                                                          processor_class_from_name)

    from ray_dhp.demo.tokenizer import CHAT_TEMPLATE

    cls = processor_class_from_name(PROCESSOR_MAPPING_NAMES[config.model_type])

    class WithoutVideo(cls):  # no video processor: None is not checked, nor saved
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

        def save_pretrained(self, *args, **kwargs):
            self.get_attributes = lambda: [a for a in cls.get_attributes()
                                           if getattr(self, a, None) is not None]
            try:
                return super().save_pretrained(*args, **kwargs)
            finally:
                del self.get_attributes

        def __reduce__(self):
            return own_processor, (config,)

    pil = IMAGE_PROCESSOR_MAPPING_NAMES[config.model_type]["pil"]
    images = get_image_processor_class_from_name(pil)(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
        crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
        image_grid_pinpoints=config.image_grid_pinpoints)
    strategy = config.vision_feature_select_strategy
    known = {"num_image_tokens": (IMAGE_SIDE // PATCH) ** 2, "patch_size": PATCH,
             "vision_feature_select_strategy": strategy, "video_processor": None,
             "num_additional_image_tokens": int(strategy == "default"),
             "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    names = inspect.signature(cls.__init__).parameters
    return WithoutVideo(image_processor=images, tokenizer=build_tokenizer(),
                        chat_template=CHAT_TEMPLATE, **{k: v for k, v in known.items() if k in names})
