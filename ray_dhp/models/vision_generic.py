"""The vision side of a generic family (`ray_dhp.models.generic`): the model's own
``get_image_features`` on whole images, data parallel over images.

A sample's ``pixel_values`` are patch rows ``[n * h * w, C * P * P]`` with one grid row
``(1, h, w)`` per image (`ray_dhp.data.tiles`: the layout every data mechanism handles);
`stock_pixels` turns them back into the ``[n, C, h*P, w*P]`` images the stock model takes, and
`vision_forward` runs ``get_image_features`` on them (a tower on patch rows gets the rows with
their grid; one on padded rows per image, SigLIP 2's NaFlex, `padded_inputs`' padding of the
rank's own images: the padded patches are masked out of every image's attention, so the rows
do not depend on which images share a rank) (the vision parts' shell,
`GenericFamily.visual`). Its ``pooler_output`` — ``[n, rows, D]``, ``[n * rows, D]`` or one
block per image — becomes ``[n * rows, D]`` feature rows in image order: exactly the rows the
stock forward scatters into the image tokens.

There is no sequence parallelism here (the plan has one rank); the driver refuses
``vision.sequence_parallel > 1`` for a generic family.
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


def plan_for(family: str, config, grid_thw: torch.LongTensor, sp: int) -> ImagePlan:
    """All of one replica's images on its one rank (``sp`` must be 1)."""
    if sp != 1:
        raise ValueError(f"vision sequence_parallel={sp}: the generic family runs each image "
                         "whole (use vision data_parallel)")
    from ray_dhp.models import family_of

    grid = torch.as_tensor(grid_thw, dtype=torch.long).cpu()
    family = family_of(config)
    merge = family.merge_size(config)
    rows = int((grid.prod(-1) // (merge * merge)).sum())
    patches = grid.prod(-1).to(torch.int32)
    vc = config.vision_config
    return ImagePlan(grid_thw=grid, order=torch.arange(rows), cuts=[0, rows], merge_unit=merge * merge,
                     cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32), patches.cumsum(0, dtype=torch.int32)]),
                     patch=vc.patch_size, channels=getattr(vc, "num_channels", 3), family=family)



def install_for(family: str, visual: torch.nn.Module, sp: int = 1) -> None:
    """Nothing to install: the tower runs as it is (``sp`` must be 1)."""
    if sp != 1:
        raise ValueError(f"vision sequence_parallel={sp} is not covered by the generic family")


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
    if family.grid_input or family.padded_input:  # `GenericFamily.stock_inputs` pads the latter
        return pixel_values
    vc = config.vision_config
    return _images(pixel_values, grid_thw, vc.patch_size, getattr(vc, "num_channels", 3))


def vision_forward(family: str, visual: torch.nn.Module, pixel_values: torch.Tensor, plan: ImagePlan,
                   sp_rank: int, sp_group, comm: Optional[CommCounter] = None) -> torch.Tensor:
    """The replica's feature rows ``[rows, D]`` in image order (``visual``: the parts' shell)."""
    from ray_dhp.models.generic import image_inputs, padded_inputs

    spec = plan.family
    if spec.grid_input:  # the tower takes the patch rows and their grid as they are
        if spec.pixel_dims == 4:  # as patch images [N, C, P, P] (Kimi-K2.5's tower)
            pixel_values = pixel_values.reshape(-1, plan.channels, plan.patch, plan.patch)
        inputs = {"pixel_values": pixel_values, "image_grid_thw": plan.grid_thw.to(pixel_values.device)}
    elif spec.padded_input:  # each image's rows, padded to this rank's longest image
        inputs = padded_inputs(spec.image_kwargs, pixel_values, plan.grid_thw, plan.patch, plan.channels)
    else:
        images = _images(pixel_values, plan.grid_thw, plan.patch, plan.channels)
        inputs = image_inputs(spec.image_kwargs, spec.pixel_dims, images)
    pooled = visual.get_image_features(**inputs, return_dict=True).pooler_output
    if isinstance(pooled, (list, tuple)):
        return torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    return pooled.reshape(-1, pooled.shape[-1])
