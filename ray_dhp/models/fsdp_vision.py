"""ZeRO stage 3 for the vision tower: torch FSDP2 (``fully_shard``) over the whole vision group,
composed with Ulysses SP (`ray_dhp.models.vision_qwen`).

Which ranks shard the tower: the whole vision group, every SP rank of every data-parallel
replica, as ZeRO stages 1-2 partition it (`ray_dhp.parallel.zero`): all of them hold the whole
tower, so a rank keeps ``1/(sp * dp)`` of its weights, gradients, fp32 masters and AdamW moments.
Before a unit runs, its weights are all-gathered over the group; after its backward its gradients
are reduce-scattered (SUM) over the group, which sums the SP ranks' partial gradients (each from
its own tokens) and the replicas' in one collective, as the all-reduce of stages 0-1 does.

Units: the patch embedding, the learned position embedding (Qwen3-VL), every block, the merger
and each deepstack merger; the root is `VisionRoot`, a wrapper whose forward is
`vision_forward` (the tower's own forward is not what runs, and FSDP's root hooks must), and
which holds the parameters no unit does.

Collective order (NCCL): every unit's forward all-gathers and its backward all-gathers and
reduce-scatters on the vision group, so every vision rank must run every unit, in the same order,
in every micro-batch in which any vision rank runs the tower. Within a replica that has images,
every SP rank runs every unit already (an SP rank with no rows runs them on padding,
`vision_qwen._nonempty`). A replica whose share of a micro-batch has no image (text-only
samples, fewer images than replicas) runs `VisionStage3.idle` instead: the tower on one
zero-filled merge unit (the smallest image, ``1 x merge x merge`` patches, without SP: no
all-to-all on its SP group, whose ranks are all idle alike) of which it keeps no row, like an SP
rank with no rows; its backward adds exact zeros to every gradient. A micro-batch with no image
anywhere runs the tower on no rank. Every micro-batch with images reduce-scatters its gradients
into the shards (the engine's ``sharding["vision"].sync``, `ray_dhp.parallel.fsdp`). The engine builds it
through the vision side's operations (`ray_dhp.models.vision_encoder.shard`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ray_dhp.models.vision_qwen import plan_vision_shards, vision_forward
from ray_dhp.parallel.fsdp import FSDPShards


class VisionRoot(torch.nn.Module):
    """FSDP's root for the tower: its forward is `vision_forward` on ``visual``."""

    def __init__(self, family: str, visual: torch.nn.Module):
        super().__init__()
        self.family, self.visual = family, visual

    def forward(self, pixel_values, plan, sp_rank: int, sp_group, comm=None):
        return vision_forward(self.family, self.visual, pixel_values, plan, sp_rank, sp_group,
                              comm=comm)


def vision_units(visual: torch.nn.Module) -> list:
    """The tower's FSDP units in forward order: each child holding parameters, the members of
    a child list (blocks, deepstack mergers) one by one."""
    units = []
    for child in visual.children():
        members = list(child) if isinstance(child, torch.nn.ModuleList) else [child]
        units += [m for m in members if any(True for _ in m.parameters())]
    return units


class VisionStage3(FSDPShards):
    """The FSDP2-sharded vision tower of one vision rank (see the module docstring)."""

    def __init__(self, family: str, visual, mesh, reduce_dtype, dtype, device):
        self.wrapper = VisionRoot(family, visual)
        super().__init__(vision_units(visual), self.wrapper, mesh, reduce_dtype, tp_first=True,
                         chain=list(visual.blocks))  # merger / deepstack units run out of list order
        self.family, self.dtype, self.device = family, dtype, device
        self._idle: Optional[tuple] = None

    def forward(self, pixel_values, plan, sp_rank: int, sp_group, comm=None) -> torch.Tensor:
        return self.wrapper(pixel_values, plan, sp_rank, sp_group, comm)

    def idle(self) -> torch.Tensor:
        """The tower's collectives without work: run on one zero merge unit, 0 rows kept."""
        if self._idle is None:
            vc = self.wrapper.visual.config
            m = vc.spatial_merge_size
            plan = plan_vision_shards(self.family, vc, torch.tensor([[1, m, m]]), sp=1)
            width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
            self._idle = torch.zeros(m * m, width, dtype=self.dtype, device=self.device), plan
        pixels, plan = self._idle
        return self.forward(pixels, plan, 0, None)[:0]
