"""Decoding one image file the way transformers loads images for a VLM.

`load_image` returns what the image processor should see: the decoded image turned upright by
its EXIF orientation tag (``PIL.ImageOps.exif_transpose``, as ``transformers.image_utils.
load_image`` does), left in its own mode, so that the image processor's ``convert_to_rgb``
handles the rest exactly as it does for a user's ``image_processor(images=Image.open(path))``:
alpha (RGBA, LA, a palette or grey image with a transparent colour) composited on white, CMYK,
grey, palette and 16-bit images converted to RGB. (``load_image`` itself converts to RGB by
dropping alpha, which turns transparent pixels black; for images without transparency the two
give the same pixels.)

`upright_size` is the size the model sees, from the header only: a JPEG whose EXIF orientation
is a quarter turn (tags 5-8) is stored sideways, so its width and height swap.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ImageError", "load_image", "upright_size"]

_ORIENTATION = 0x0112  # EXIF tag
_QUARTER_TURNS = (5, 6, 7, 8)  # transpose, rotate 270, transverse, rotate 90: width <-> height


class ImageError(ValueError):
    """An image file that cannot be used (missing, corrupt, too large): the record is bad data."""


def upright_size(img) -> tuple[int, int]:
    """``(width, height)`` of an opened (not necessarily decoded) PIL image once turned upright
    by its EXIF orientation (read from the header)."""
    width, height = img.size
    try:
        orientation = img.getexif().get(_ORIENTATION)
    except Exception:  # noqa: BLE001 - a broken EXIF block: transformers' exif_transpose skips it too
        orientation = None
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def load_image(path: Path, max_pixels: int | None = None):
    """The upright image at ``path`` in its own mode (see the module docstring). Its size is read
    from the header first (PIL's ``open`` is lazy) and an image over ``max_pixels`` is refused
    (`ImageError`) before any pixel is decoded."""
    from PIL import Image, ImageOps

    try:
        exists = path.is_file()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte...
        raise ImageError(f"unusable image path: {str(path)[:200]!r}: {type(exc).__name__}: {exc}") from exc
    if not exists:
        raise ImageError(f"missing image: {path} does not exist")
    try:
        with Image.open(path) as img:  # reads the header only
            width, height = img.size
            if width <= 0 or height <= 0:
                raise ImageError(f"corrupt image: {path} has size {width}x{height}")
            if max_pixels is not None and width * height > max_pixels:
                raise ImageError(f"image too large: {path} is {width}x{height} = {width * height} "
                           f"pixels > max_image_pixels={max_pixels} (not decoded)")
            img.load()
            upright = ImageOps.exif_transpose(img)
            return upright.copy() if upright is img else upright  # detached from the file
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own guard (over ~179M pixels)
        raise ImageError(f"image too large: {path}: {exc}") from exc
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError...
        raise ImageError(f"corrupt image: {path}: {type(exc).__name__}: {exc}") from exc
