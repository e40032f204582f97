"""The vision side of a generic family (`ray_dhp.models.generic`): the model's own
``get_image_features`` on whole images, data parallel over images.

A sample's ``pixel_values`` are patch rows ``[n * h * w, C * P * P]`` with one grid row
``(1, h, w)`` per image (`ray_dhp.data.tiles`: the layout every data mechanism handles);
`stock_pixels` turns them back into the ``[n, C, h*P, w*P]`` images the stock model takes, and
`vision_forward` runs ``get_image_features`` on them (a tower on patch rows gets the rows with
their grid; one on padded rows per image, SigLIP 2's NaFlex, `padded_inputs`' padding of the
rank's own images: the padded patches are masked out of every image's attention, so the rows
do not depend on which images share a rank; one on a NaViT strip, MiniCPM-V 4.6's, the rank's
images side by side with their ``target_sizes``: `packed_inputs`) (the vision parts' shell,
`GenericFamily.visual`). Its ``pooler_output`` — ``[n, rows, D]``, ``[n * rows, D]`` or one
block per image — becomes ``[n * rows, D]`` feature rows in image order: exactly the rows the
stock forward scatters into the image tokens.

With ``vision.sequence_parallel > 1`` the same forward runs with the tower's encoder split over
the SP ranks (`ray_dhp.models.vision_generic_sp`; the driver refuses it, with the reason, for a
tower that cannot be split so): the plan cuts the replica's rows over the ranks, each returns
its cut.

An anyres image (`ray_dhp.models.generic_probe.anyres`: LLaVA-NeXT's and -OneVision's tiling)
comes as its tiles (grid ``(tiles, S/P, S/P)``) with its original size: the plan carries each
image's ``image_sizes`` (kept on CPU: the model reads them as integers) and its feature rows from
the processor's count, and ``get_image_features`` gets the tiles with the sizes, so each image
is packed (unpadded, ``image_newline`` rows) by the model's own code, whole, on one replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ray_dhp.models.vision_qwen import VisionShardPlan
from ray_dhp.parallel.comm import CommCounter

__all__ = ["ImagePlan", "plan_for", "vision_forward", "install_for", "stock_pixels"]


@dataclass
class ImagePlan(VisionShardPlan):
    """A one-rank `VisionShardPlan` over whole images, with the geometry `stock_pixels` needs."""

    patch: int = 14
    channels: int = 3
    family: object = None  # the `GenericFamily` (how get_image_features takes the images)
    image_sizes: Optional[torch.Tensor] = None  # [n, 2] each image's original size (anyres)


def plan_for(family: str, config, grid_thw: torch.LongTensor, sp: int, image_sizes=None,
             item_rows=None) -> ImagePlan:
    """One replica's images, their rows cut in ``sp`` contiguous, balanced pieces (the tower's
    tokens are split by `ray_dhp.models.vision_generic_sp`, the rows after the gather);
    ``image_sizes`` / ``item_rows``: each image's original size and feature rows where they
    are not its grid's (an anyres image: `ray_dhp.data.sample.Sample.item_rows`)."""
    from ray_dhp.models import family_of
    from ray_dhp.models.vision_generic_sp import token_split

    grid = torch.as_tensor(grid_thw, dtype=torch.long).cpu()
    family = family_of(config)
    merge = family.merge_size(config)
    rows = int((grid.prod(-1) // (merge * merge)).sum()) if item_rows is None else \
        int(torch.as_tensor(item_rows).sum())
    patches = grid.prod(-1).to(torch.int32)
    vc = config.vision_config
    cuts = [0]
    for n in token_split(rows, sp):
        cuts.append(cuts[-1] + n)
    return ImagePlan(grid_thw=grid, order=torch.arange(rows), cuts=cuts, merge_unit=merge * merge,
                     cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32), patches.cumsum(0, dtype=torch.int32)]),
                     patch=vc.patch_size, channels=getattr(vc, "num_channels", 3), family=family,
                     image_sizes=None if image_sizes is None else
                     torch.as_tensor(image_sizes, dtype=torch.long).cpu())



def install_for(family: str, visual: torch.nn.Module, sp: int = 1) -> None:
    """Nothing at ``sp`` 1 (the tower runs as it is); else `vision_generic_sp.install`."""
    if sp > 1:
        from ray_dhp.models import family_of
        from ray_dhp.models.vision_generic_sp import install

        for tower in _towers(visual, family_of(visual.config)):
            install(tower, tower.config)


def _towers(visual: torch.nn.Module, spec) -> list:
    """The vision parts built from a vision config of the tower's type (VideoLLaVA: two)."""
    kind = type(getattr(visual, spec.tower).config)
    return [m for m in (getattr(visual, p) for p in spec.vision_parts)
            if isinstance(getattr(m, "config", None), kind)]


def _images(pixel_rows: torch.Tensor, grid: torch.LongTensor, patch: int, channels: int) -> torch.Tensor:
    out = []
    for rows, (t, h, w) in zip(pixel_rows.split(grid.prod(-1).tolist()), grid.tolist()):
        x = rows.reshape(t, h, w, channels, patch, patch).permute(0, 3, 1, 4, 2, 5)
        out.append(x.reshape(t, channels, h * patch, w * patch))
    return torch.cat(out)


def stock_pixels(config, pixel_values: torch.Tensor, grid_thw: torch.LongTensor) -> torch.Tensor:
    """Patch rows ``[n*h*w, C*P*P]`` -> the stock model's ``[n, C, h*P, w*P]`` images (a tower
    that takes patch rows gets them unchanged)."""
    from ray_dhp.models import family_of

    family = family_of(config)
    if family.grid_input or family.padded_input or family.packed_input:  # `stock_inputs` lays
        # out the latter two (padded rows per image, one NaViT strip)
        return pixel_values
    vc = config.vision_config
    return _images(pixel_values, grid_thw, vc.patch_size, getattr(vc, "num_channels", 3))


def vision_forward(family: str, visual: torch.nn.Module, pixel_values: torch.Tensor, plan: ImagePlan,
                   sp_rank: int, sp_group, comm: Optional[CommCounter] = None) -> torch.Tensor:
    """SP rank ``sp_rank``'s feature rows (its cut of the replica's rows in image order;
    ``visual``: the parts' shell)."""
    if plan.sp > 1:
        from ray_dhp.models.vision_generic_sp import forward

        return forward(_towers(visual, plan.family), lambda: _whole(visual, pixel_values, plan),
                       (plan.cuts[sp_rank], plan.cuts[sp_rank + 1]), sp_rank, sp_group, plan.sp, comm)
    return _whole(visual, pixel_values, plan)


def _whole(visual: torch.nn.Module, pixel_values: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
    """The replica's feature rows ``[rows, D]`` in image order, through ``get_image_features``."""
    from ray_dhp.models.generic import image_inputs, packed_inputs, padded_inputs

    spec = plan.family
    if spec.grid_input:  # the tower takes the patch rows and their grid as they are
        if spec.pixel_dims == 4:  # as patch images [N, C, P, P] (Kimi-K2.5's tower)
            pixel_values = pixel_values.reshape(-1, plan.channels, plan.patch, plan.patch)
        inputs = {"pixel_values": pixel_values, "image_grid_thw": plan.grid_thw.to(pixel_values.device)}
    elif spec.packed_input:  # this rank's images side by side in one strip, their grids
        inputs = packed_inputs(pixel_values, plan.grid_thw, plan.patch, plan.channels)
    elif spec.padded_input:  # each image's rows, padded to this rank's longest image
        inputs = padded_inputs(spec.image_kwargs, pixel_values, plan.grid_thw, plan.patch, plan.channels)
    else:
        images = _images(pixel_values, plan.grid_thw, plan.patch, plan.channels)
        inputs = image_inputs(spec.image_kwargs, spec.pixel_dims, images,  # anyres: its tiles,
                              plan.image_sizes if spec.tiled_input else None)  # original sizes
    pooled = visual.get_image_features(**inputs, return_dict=True).pooler_output
    if isinstance(pooled, (list, tuple)):
        return torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    return pooled.reshape(-1, pooled.shape[-1])
