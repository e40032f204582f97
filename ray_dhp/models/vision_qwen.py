"""Ulysses sequence parallelism for the Qwen vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The transformers towers are used as they are (no copied model files): their sub-modules
(``patch_embed``, ``rotary_pos_emb``, ``pos_embed``, ``blocks``, ``merger``, deepstack mergers)
are driven here on the local tokens of one sequence-parallel (SP) rank, and the attention module
of every block gets the Ulysses forward of :mod:`ray_dhp.parallel.ulysses`.

Order of work inside one vision data-parallel replica:

1. ``plan_vision_shards`` (same result on every rank) puts the merge units ("rows", one row per
   merged output token) in processing order — the window order for Qwen2.5-VL, the natural order
   otherwise — and cuts that order into ``sp`` contiguous, token-balanced pieces: on window
   boundaries for Qwen2.5-VL (window-attention blocks then need no communication), on merge-unit
   boundaries otherwise.
2. ``vision_forward`` embeds the local patches, adds the local interpolated position embedding
   (Qwen3-VL), computes rotary cos/sin for the local tokens, runs the blocks (full-attention
   blocks do two all-to-alls; window blocks are local), and runs the merger (and the deepstack
   mergers) on the local tokens.

Example::

    plan = plan_vision_shards("qwen2_5_vl", visual.config, grid_thw, sp=2)
    feats = vision_forward("qwen2_5_vl", visual, pixel_values, plan, sp_rank, sp_group)
    rows = plan.order[plan.cuts[sp_rank]:plan.cuts[sp_rank + 1]]   # feats[i] is pooler row rows[i]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from ray_dhp.parallel.comm import CommCounter
from ray_dhp.parallel.ulysses import UlyssesContext, install_ulysses_attention

__all__ = ["VisionShardPlan", "plan_vision_shards", "vision_forward", "install_ulysses"]


@dataclass(frozen=True)
class _FamilySpec:
    windowed: bool = False  # Qwen2.5-VL: window attention except in config.fullatt_block_indexes
    learned_pos_embed: bool = False  # Qwen3-VL: interpolated learned pos_embed
    deepstack: bool = False  # Qwen3-VL: deepstack mergers after config.deepstack_visual_indexes


_VISION_FAMILIES = {
    "qwen2_vl": _FamilySpec(),
    "qwen2_5_vl": _FamilySpec(windowed=True),
    "qwen2_5_omni": _FamilySpec(windowed=True),  # the thinker's ViT is Qwen2.5-VL's
    "qwen3_vl": _FamilySpec(learned_pos_embed=True, deepstack=True),
    "qwen3_5": _FamilySpec(learned_pos_embed=True),
    "qwen3_5_moe": _FamilySpec(learned_pos_embed=True),  # Qwen3.5's ViT
    "qwen3_vl_moe": _FamilySpec(learned_pos_embed=True, deepstack=True),  # Qwen3-VL's ViT
    "qwen3_omni_moe": _FamilySpec(learned_pos_embed=True, deepstack=True),  # Qwen3-VL's ViT
}


@dataclass
class VisionShardPlan:
    """How one vision DP replica's images are split over its SP ranks (plain data, same on all ranks).

    Attributes:
        grid_thw: ``[n_img, 3]`` images of this replica, canonical order.
        order: ``[R]`` merged-row ids in processing order (row id = index into the stock
            ``pooler_output``; R = total patches / merge**2).
        cuts: ``sp + 1`` offsets into ``order``; SP rank k computes rows ``order[cuts[k]:cuts[k+1]]``.
        merge_unit: patches per row (``spatial_merge_size ** 2``).
        cu_seqlens: ``[n_seg + 1]`` int32 global attention segments (one per frame) in processing
            order, in patches; used by full-attention blocks.
        local_cu_window_seqlens: per SP rank, the window segments of its own tokens (local patch
            offsets) for Qwen2.5-VL window blocks; ``None`` for the other families.
    """

    grid_thw: torch.LongTensor
    order: torch.LongTensor
    cuts: list[int]
    merge_unit: int
    cu_seqlens: torch.Tensor
    local_cu_window_seqlens: Optional[list[torch.Tensor]] = None

    @property
    def sp(self) -> int:
        return len(self.cuts) - 1

    def rows(self, sp_rank: int) -> torch.LongTensor:
        """Merged-row ids computed by ``sp_rank`` (in its output order)."""
        return self.order[self.cuts[sp_rank]:self.cuts[sp_rank + 1]]

    def tokens_per_rank(self) -> list[int]:
        return [(self.cuts[k + 1] - self.cuts[k]) * self.merge_unit for k in range(self.sp)]


def _spec(family: str) -> _FamilySpec:
    if family not in _VISION_FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; expected one of {sorted(_VISION_FAMILIES)}")
    return _VISION_FAMILIES[family]


def _check_heads(num_heads: int, sp: int) -> None:
    if sp < 1:
        raise ValueError(f"sequence-parallel degree must be >= 1, got sp={sp}")
    if num_heads % sp:
        raise ValueError(f"vision num_heads={num_heads} is not divisible by the vision sequence-parallel "
                         f"degree sp={sp}; choose a sequence_parallel degree that divides {num_heads}.")


def _balanced_cuts(bounds: list[int], sp: int) -> list[int]:
    """Greedy cuts: for each rank boundary, the allowed boundary (in ``bounds``, ascending, from 0
    to the total) nearest to the ideal ``k * total / sp``, never moving backwards."""
    total, cuts, j = bounds[-1], [0], 0
    for k in range(1, sp):
        target = k * total / sp
        while j + 1 < len(bounds) and abs(bounds[j + 1] - target) <= abs(bounds[j] - target):
            j += 1
        cuts.append(max(bounds[j], cuts[-1]))
    return cuts + [total]


def _local_windows(row_bounds: torch.Tensor, cuts: list[int], unit: int) -> list[torch.Tensor]:
    """Per rank: the window boundaries inside its row range, as local patch offsets (int32)."""
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        inside = row_bounds[(row_bounds >= lo) & (row_bounds <= hi)]
        out.append(((inside - lo) * unit).to(torch.int32))
    return out


def plan_vision_shards(family: str, vision_config, grid_thw: torch.LongTensor, sp: int) -> VisionShardPlan:
    """Plan the split of one replica's images over ``sp`` ranks; deterministic (same on all ranks).

    Args:
        family: ``"qwen2_vl"``, ``"qwen2_5_vl"`` or ``"qwen3_vl"``.
        vision_config: the tower's config (``model.config.vision_config``).
        grid_thw: ``[n_img, 3]`` (t, h, w) in patches; h and w multiples of the merge size.
        sp: sequence-parallel degree (must divide the number of heads).
    """
    spec = _spec(family)
    _check_heads(vision_config.num_heads, sp)
    grid_thw = torch.as_tensor(grid_thw, dtype=torch.long).cpu()
    merge = vision_config.spatial_merge_size
    unit = merge * merge
    n_rows = int(grid_thw.prod(-1).sum()) // unit
    if spec.windowed:
        order, cu_windows = get_vision_window_index(grid_thw, merge, vision_config.window_size,
                                                    vision_config.patch_size)
        row_bounds = (cu_windows.long() // unit).cpu()
    else:
        order, row_bounds = torch.arange(n_rows), torch.arange(n_rows + 1)
    cuts = _balanced_cuts(row_bounds.tolist(), sp)
    return VisionShardPlan(
        grid_thw=grid_thw, order=order.long(), cuts=cuts, merge_unit=unit,
        cu_seqlens=get_vision_cu_seqlens(grid_thw),
        local_cu_window_seqlens=_local_windows(row_bounds, cuts, unit) if spec.windowed else None,
    )


def plan_for(family: str, config, grid_thw: torch.LongTensor, sp: int) -> VisionShardPlan:
    """`plan_vision_shards` given the model's (or the tower's) config (`FamilySpec.plan_vision`)."""
    return plan_vision_shards(family, getattr(config, "vision_config", config), grid_thw, sp)


def install_for(family: str, visual: torch.nn.Module, sp: int = 1) -> None:
    """`install_ulysses` by degree (`FamilySpec.vision_module`'s common entry)."""
    _spec(family)
    for blk in visual.blocks:
        install_ulysses_attention(blk.attn, sp)


def install_ulysses(family: str, visual: torch.nn.Module, sp_group=None, comm=None) -> None:
    """Install the Ulysses attention forward on every block of ``visual`` (idempotent, optional).

    ``vision_forward`` calls this itself; call it early to fail fast when the head count is not
    divisible by the SP degree. ``comm`` is accepted for symmetry and not stored: the group and
    counter travel with each call, so an installed tower stays usable without any group (and
    then computes exactly like the stock non-flash path).
    """
    _spec(family)
    sp = 1 if sp_group is None else dist.get_world_size(sp_group)
    for blk in visual.blocks:
        install_ulysses_attention(blk.attn, sp)


def _full_attention_blocks(family: str, visual) -> set[int]:
    if _spec(family).windowed:
        return set(visual.config.fullatt_block_indexes)
    return set(range(len(visual.blocks)))


def _local_patches(plan: VisionShardPlan, sp_rank: int) -> torch.LongTensor:
    rows = plan.rows(sp_rank)
    return (rows[:, None] * plan.merge_unit + torch.arange(plan.merge_unit)).reshape(-1)


def _nonempty(module: torch.nn.Module, x: torch.Tensor, pad_rows: int) -> torch.Tensor:
    """``module(x)``; for an empty ``x`` run it on ``pad_rows`` zero rows and keep none of the
    output, so the result is empty but still depends on ``x`` (the backward must reach this
    rank's all-to-alls) and every parameter gets a (zero) gradient. The stock modules reshape
    with ``view(-1, ...)``, which an empty tensor cannot do."""
    if x.shape[0] > 0:
        return module(x)
    return module(torch.cat([x, x.new_zeros(pad_rows, *x.shape[1:])]))[:0]


def _learned_pos_embed(visual, grid_thw: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's interpolated learned position embedding, for the local patches only."""
    idx, w = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    dev = visual.pos_embed.weight.device
    idx, w = idx[patches].to(dev), w[patches].to(dev)
    return (visual.pos_embed(idx) * w[:, :, None]).sum(1)


def _ulysses_context(plan, sp_rank, sp_group, comm) -> Optional[UlyssesContext]:
    if plan.sp == 1:
        return None
    if sp_group is None or dist.get_world_size(sp_group) != plan.sp:
        size = None if sp_group is None else dist.get_world_size(sp_group)
        raise ValueError(f"the plan has sp={plan.sp} but the SP group has size {size}; plan with "
                         f"sp = the SP group size (sp=1 when running without a group)")
    return UlyssesContext(group=sp_group, seq_lens=plan.tokens_per_rank(), rank=sp_rank, comm=comm)


def vision_forward(family: str, visual: torch.nn.Module, pixel_values: torch.Tensor, plan: VisionShardPlan,
                   sp_rank: int, sp_group, comm: Optional[CommCounter] = None) -> torch.Tensor:
    """Run SP rank ``sp_rank``'s share of the vision tower.

    Args:
        pixel_values: all patches of the replica's images, processor order ``[N, C*T*P*P]``;
            this rank selects its own.
        sp_group: the SP process group (``None`` when ``plan.sp == 1``: no communication).
        comm: optional counter for the all-to-alls (``("all_to_all", "vision.sp")``).

    Returns:
        ``[rows_local, out_hidden]`` merged features of rows ``plan.rows(sp_rank)``; for Qwen3-VL
        ``torch.cat([pooler, *deepstack], dim=-1)``.
    """
    spec = _spec(family)
    install_ulysses(family, visual)
    ctx = _ulysses_context(plan, sp_rank, sp_group, comm)
    patches = _local_patches(plan, sp_rank)
    hidden = _nonempty(visual.patch_embed, pixel_values[patches.to(pixel_values.device)], pad_rows=1)
    if spec.learned_pos_embed:
        hidden = hidden + _learned_pos_embed(visual, plan.grid_thw, patches).to(hidden.dtype)
    position_ids = get_vision_position_ids(plan.grid_thw, visual.spatial_merge_size)[patches]
    rotary = visual.rotary_pos_emb(hidden, position_ids.to(hidden.device))
    full_blocks, deepstack = _full_attention_blocks(family, visual), []
    ds_index = list(visual.config.deepstack_visual_indexes) if spec.deepstack else []
    for i, blk in enumerate(visual.blocks):
        if i in full_blocks:
            cu, block_ctx = plan.cu_seqlens, ctx
        else:
            cu, block_ctx = plan.local_cu_window_seqlens[sp_rank], None
        # cu_seqlens stay on the host: the attention reads the segment lengths from them (no
        # device-to-host sync per block); the flash kernel takes its own device copy
        hidden = blk(hidden, cu_seqlens=cu, position_embeddings=rotary, ulysses=block_ctx)
        if i in ds_index:
            merger = visual.deepstack_merger_list[ds_index.index(i)]
            deepstack.append(_nonempty(merger, hidden, pad_rows=plan.merge_unit))
    pooled = _nonempty(visual.merger, hidden, pad_rows=plan.merge_unit)
    return torch.cat([pooled, *deepstack], dim=-1) if deepstack else pooled
