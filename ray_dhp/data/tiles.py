"""Images as fixed tiles: a tiling image processor's tiles as patch rows and a grid.

Every data mechanism (the processor, the loader's pixel routing, collation, the balancer, the
boundary's row counts) handles a sample's pixels as rows of patches with one ``(t, h, w)`` grid
per image. `TileImageProcessor` gives a tiling processor's output that shape: an image cut into
``n`` tiles of ``S x S`` pixels becomes ``n * (S/P)**2`` rows of ``C*P*P`` values (each tile's
patches in raster order) and the grid ``(n, S/P, S/P)`` — tiles in the place of temporal
patches. The family's ``stock_pixels`` (`FamilySpec.stock_inputs`) turns the rows back into the
tiles.

Example::

    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    tiles = TileImageProcessor(GotOcr2ImageProcessorPil(size={"height": 448, "width": 448},
                                                        crop_to_patches=True, max_patches=12),
                               patch_size=14, merge_size=2)
    out = tiles(images=[img], return_tensors="pt")   # pixel_values [n*1024, 588], image_grid_thw
"""

from __future__ import annotations

import torch

__all__ = ["TileImageProcessor", "tile_rows"]


def tile_rows(tiles: torch.Tensor, patch: int) -> torch.Tensor:
    """``[n, C, S, S]`` tiles -> ``[n * (S/P)**2, C*P*P]`` patch rows (raster order per tile)."""
    n, c, hs, ws = tiles.shape
    h, w = hs // patch, ws // patch
    x = tiles.reshape(n, c, h, patch, w, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n * h * w, c * patch * patch)


class TileImageProcessor:
    """Wrap a tiling image processor (e.g. transformers' ``GotOcr2ImageProcessor(Pil)``)
    so that it returns ``pixel_values`` as patch rows and ``image_grid_thw`` as ``(tiles, h, w)``.

    Args:
        tiler: the processor; called with ``images=`` and ``return_tensors="pt"``, it returns
            ``pixel_values [tiles, C, S, S]`` and ``num_patches`` (tiles per image; without it,
            one tile per image: a fixed-size processor).
        patch_size: the ViT's patch size ``P``.
        merge_size: patches per side of one feature row (``1 / downsample_ratio``).
    """

    def __init__(self, tiler, patch_size: int, merge_size: int):
        self.tiler, self.patch_size, self.merge_size = tiler, patch_size, merge_size

    def __call__(self, images, return_tensors="pt", **kwargs):
        out = self.tiler(images=images, return_tensors="pt", **kwargs)
        tiles = out["pixel_values"].to(torch.float32)
        side = tiles.shape[-1] // self.patch_size
        if tiles.shape[-2] != tiles.shape[-1] or side % self.merge_size:
            raise ValueError(f"tiles of {tuple(tiles.shape[-2:])} px do not fit patch "
                             f"{self.patch_size} x merge {self.merge_size}")
        counts = out.get("num_patches")  # a fixed-size processor: one tile per image
        counts = [1] * tiles.shape[0] if counts is None else counts
        grid = torch.tensor([[int(n), side, side] for n in counts], dtype=torch.long)
        return {"pixel_values": tile_rows(tiles, self.patch_size), "image_grid_thw": grid}

    def save_pretrained(self, directory) -> None:
        self.tiler.save_pretrained(directory)
