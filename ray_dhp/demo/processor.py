"""The demo's tiny processors: the demo tokenizer with transformers' PIL image processors,
matching the tiny configs' patch geometry."""

from __future__ import annotations

from ray_dhp.demo.configs import _TINY_INTERNVL_TILE, AUDIO_FAMILIES, FAMILIES, _vision_geometry
from ray_dhp.demo.tokenizer import CHAT_TEMPLATE, build_tokenizer

__all__ = ["tiny_processor"]


def tiny_processor(family: str = "qwen2_5_vl", *, min_side: int = 56, max_side: int = 112):
    """A :class:`ray_dhp.data.VLProcessor` matching :func:`tiny_model_config` of ``family``.

    It composes :func:`build_tokenizer` with transformers' PIL ``Qwen2VLImageProcessorPil``
    (no torchvision needed). Its patch, merge and temporal patch sizes equal the config's, and
    images are resized to between ``min_side**2`` and ``max_side**2`` pixels (56..112 px per
    side gives grids of 4x4..8x8 patches at patch size 14).

    Args:
        family: ``"qwen2_5_vl"`` (default), ``"qwen2_vl"``, ``"qwen3_vl"``, ``"qwen3_vl_moe"``,
            ``"qwen3_5"`` or ``"qwen3_5_moe"``.
        min_side: side of the smallest image area, in pixels.
        max_side: side of the largest image area, in pixels.

    ``"qwen2_5_omni"``: with an audio feature extractor (`ray_dhp.demo.audio.omni_processor`);
    ``"qwen3_omni_moe"``: the same with Qwen3-Omni's audio tokens and format, Qwen3-VL's images.
    """
    if family not in FAMILIES + AUDIO_FAMILIES:  # any other seam model: generic rules
        from ray_dhp.demo.generic import tiny_generic_processor

        return tiny_generic_processor(family)
    if family == "qwen3_omni_moe":
        from ray_dhp.demo.audio import QWEN3_OMNI_AUDIO_TOKENS, omni_processor, omni_tokenizer
        from ray_dhp.models.prompt_format import QWEN3_OMNI

        images = tiny_processor("qwen3_vl", min_side=min_side, max_side=max_side).image_processor
        return omni_processor(omni_tokenizer(build_tokenizer(), CHAT_TEMPLATE,
                                             QWEN3_OMNI_AUDIO_TOKENS), images,
                              prompt_format=QWEN3_OMNI)
    if family in AUDIO_FAMILIES:
        from ray_dhp.demo.audio import omni_processor, omni_tokenizer

        images = tiny_processor("qwen2_5_vl", min_side=min_side, max_side=max_side).image_processor
        return omni_processor(omni_tokenizer(build_tokenizer(), CHAT_TEMPLATE), images)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ray_dhp.data.processing import VLProcessor

    if family in ("internvl", "internvl3_5"):  # InternVL3 and 3.5 tile images alike
        return VLProcessor(build_tokenizer(), _tiny_tiler(max_side))

    geo = _vision_geometry(family)
    scale = geo["patch_size"] / 14  # keep the same patch grid for 16-px patches
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=int((min_side * scale) ** 2), max_pixels=int((max_side * scale) ** 2),
        patch_size=geo["patch_size"], merge_size=geo["spatial_merge_size"],
        temporal_patch_size=geo["temporal_patch_size"],
    )
    return VLProcessor(build_tokenizer(), image_processor, video_timestamps=family == "qwen3_vl")


def _tiny_tiler(max_side: int):
    """InternVL's tiling (transformers' PIL ``GotOcr2ImageProcessorPil``: the image cut into 1..N
    tiles of the closest aspect ratio plus a thumbnail) at the tiny tile size, as patch rows
    (`ray_dhp.data.tiles.TileImageProcessor`); at most ``(max_side // tile)**2`` tiles."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from ray_dhp.data.tiles import TileImageProcessor

    tile = _TINY_INTERNVL_TILE
    tiler = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True,
                                     min_patches=1, max_patches=max(1, (max_side // tile) ** 2))
    return TileImageProcessor(tiler, patch_size=14, merge_size=2)
