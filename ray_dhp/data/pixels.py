"""``min_pixels`` / ``max_pixels``: the area a resizing image processor resizes each image into.

The processor (its resize rule, `PromptFormat.resize`) rounds each side to a multiple of
``patch_size * merge_size`` (e.g. 28 or 32 px) and scales the image so
its area lies within ``[min_pixels, max_pixels]`` (``size = {"shortest_edge": min_pixels,
"longest_edge": max_pixels}``). The values need not be multiples of anything, but an image never
gets smaller than one merged patch unit, so ``max_pixels`` below ``(patch * merge)**2`` cannot be
honoured and is refused.
"""

from __future__ import annotations

from typing import Callable, Optional

from ray_dhp.config.checks import ConfigError

__all__ = ["check_pixel_limits", "check_run_pixels", "with_pixel_limits", "pixel_unit"]


def pixel_unit(model_config) -> Optional[int]:
    """``patch_size * spatial_merge_size`` of the model's vision tower (None if it has none)."""
    vision = getattr(model_config, "vision_config", None)
    patch, merge = getattr(vision, "patch_size", None), getattr(vision, "spatial_merge_size", None)
    return patch * merge if isinstance(patch, int) and isinstance(merge, int) else None


def _limits(image_processor) -> tuple:
    size = getattr(image_processor, "size", None) or {}
    return size.get("shortest_edge"), size.get("longest_edge")


def check_pixel_limits(min_pixels, max_pixels, *, unit: Optional[int] = None,
                       image_processor=None, name: Callable[[str], str] = str) -> None:
    """ConfigError naming ``name("min_pixels")`` / ``name("max_pixels")`` unless the limits are
    usable: each None or an int >= 1, ``min_pixels <= max_pixels`` (a single one checked against
    the image processor's other limit when given), ``max_pixels >= unit**2`` (``unit``: see
    `pixel_unit`)."""
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name(key)}: must be an integer >= 1 (pixels: width x height), "
                              f"got {value!r}.")
    if unit and max_pixels is not None and max_pixels < unit * unit:
        raise ConfigError(f"{name('max_pixels')}={max_pixels}: below one merged patch unit "
                          f"({unit}x{unit} = {unit * unit} pixels for this model's patch_size x "
                          f"spatial_merge_size); the image processor cannot make images that "
                          f"small. Use at least {unit * unit}.")
    low, high = _limits(image_processor)
    lo, hi = (min_pixels if min_pixels is not None else low), (max_pixels if max_pixels is not None else high)
    if lo is not None and hi is not None and lo > hi:
        which = (f"{name('min_pixels')}={lo} > {name('max_pixels')}={hi}"
                 if min_pixels is not None and max_pixels is not None else
                 f"{name('min_pixels')}={lo} > the image processor's max_pixels={hi}"
                 if min_pixels is not None else
                 f"{name('max_pixels')}={hi} < the image processor's min_pixels={lo}")
        raise ConfigError(f"{which}: min_pixels must not exceed max_pixels.")


def with_pixel_limits(image_processor, min_pixels=None, max_pixels=None):
    """A copy of the resizing ``image_processor`` that resizes into ``[min_pixels, max_pixels]``
    (None keeps the processor's own limit); the processor itself when both are None."""
    if min_pixels is None and max_pixels is None:
        return image_processor
    if image_processor is None:
        raise ValueError("min_pixels/max_pixels are set but the processor has no image processor")
    check_pixel_limits(min_pixels, max_pixels, image_processor=image_processor)
    low, high = _limits(image_processor)
    settings = image_processor.to_dict()
    settings["size"] = {"shortest_edge": min_pixels if min_pixels is not None else low,
                        "longest_edge": max_pixels if max_pixels is not None else high}
    return type(image_processor).from_dict(settings)


def check_run_pixels(min_pixels, max_pixels, dhp_config, name: Callable[[str], str] = str) -> None:
    """`check_pixel_limits` in the driver: against the model's patch unit and, when the
    `DHPConfig` holds a processor object, its image processor's limits. Nothing is loaded when
    both limits are None."""
    if min_pixels is None and max_pixels is None:
        return
    processor = dhp_config.processor
    image_processor = getattr(processor, "image_processor", None) if processor is not None else None
    check_pixel_limits(min_pixels, max_pixels, unit=pixel_unit(dhp_config.model_config()),
                       image_processor=image_processor, name=name)
