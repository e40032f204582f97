"""plan_vision_shards: permutation, window alignment, balance, local windows (no process group)."""

from __future__ import annotations

import pytest
import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

from ray_dhp.models.vision_qwen import plan_vision_shards
from tests.distributed.tiny_towers import FAMILIES, tiny_vision_config

UNIT = 4  # merge 2 x 2
GRIDS = [
    [[1, 4, 4], [1, 8, 6], [1, 6, 8]],
    [[1, 16, 16]],  # 8x8 merge units: 16 windows of 2x2 units at window_size 56
    [[2, 6, 10], [1, 2, 2], [1, 16, 12]],  # a 2-frame clip, a one-unit image, a large one
]


def _windows(grid_thw):
    """Stock Qwen2.5-VL windows as (start_row, end_row) in processing order."""
    _, cu = get_vision_window_index(grid_thw, 2, 56, 14)
    rows = (cu.long() // UNIT).tolist()
    return list(zip(rows[:-1], rows[1:]))


@pytest.mark.parametrize("grids", GRIDS)
@pytest.mark.parametrize("sp", [1, 2, 3, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_is_a_balanced_partition(family, sp, grids):
    cfg = tiny_vision_config(family)
    cfg.num_heads = 12  # the planner only checks divisibility; 12 heads allow sp = 3
    grid_thw = torch.tensor(grids)
    plan = plan_vision_shards(family, cfg, grid_thw, sp)
    n_rows = int(grid_thw.prod(-1).sum()) // UNIT
    # order is a permutation of the pooler rows; cuts cover it contiguously and monotonically
    assert torch.equal(plan.order.sort().values, torch.arange(n_rows))
    assert len(plan.cuts) == sp + 1 and plan.cuts[0] == 0 and plan.cuts[-1] == n_rows
    assert all(a <= b for a, b in zip(plan.cuts, plan.cuts[1:]))
    assert sum(plan.tokens_per_rank()) == n_rows * UNIT
    assert torch.equal(torch.cat([plan.rows(k) for k in range(sp)]), plan.order)
    assert torch.equal(plan.cu_seqlens, get_vision_cu_seqlens(grid_thw))
    loads = [plan.cuts[k + 1] - plan.cuts[k] for k in range(sp)]
    if family == "qwen2_5_vl":
        assert torch.equal(plan.order, get_vision_window_index(grid_thw, 2, 56, 14)[0])
        windows = _windows(grid_thw)
        # window-aligned: every window lies inside one rank's range
        for lo, hi in windows:
            assert any(plan.cuts[k] <= lo and hi <= plan.cuts[k + 1] for k in range(sp)), (lo, hi)
        biggest = max(hi - lo for lo, hi in windows)
    else:
        assert torch.equal(plan.order, torch.arange(n_rows))
        biggest = 1  # cuts at any merge unit
    # greedy balance: every load within one item of the ideal share
    assert max(abs(load - n_rows / sp) for load in loads) <= biggest


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_local_windows_are_the_stock_windows(sp):
    grid_thw = torch.tensor(GRIDS[2])
    plan = plan_vision_shards("qwen2_5_vl", tiny_vision_config("qwen2_5_vl"), grid_thw, sp)
    rebuilt = set()
    for k, cu in enumerate(plan.local_cu_window_seqlens):
        assert cu.dtype == torch.int32 and int(cu[0]) == 0
        assert int(cu[-1]) == plan.tokens_per_rank()[k]
        rows = (cu.long() // UNIT + plan.cuts[k]).tolist()
        rebuilt |= set(zip(rows[:-1], rows[1:]))
    assert rebuilt == set(_windows(grid_thw))


def test_other_families_have_no_windows():
    for family in ("qwen2_vl", "qwen3_vl"):
        plan = plan_vision_shards(family, tiny_vision_config(family), torch.tensor(GRIDS[0]), 2)
        assert plan.local_cu_window_seqlens is None


def test_more_ranks_than_units_leaves_ranks_empty():
    plan = plan_vision_shards("qwen2_vl", tiny_vision_config("qwen2_vl"), torch.tensor([[1, 2, 2]]), 4)
    assert sorted(plan.tokens_per_rank()) == [0, 0, 0, 4]


def test_errors_say_what_to_change():
    cfg = tiny_vision_config("qwen2_vl")
    with pytest.raises(ValueError, match="divides 4"):
        plan_vision_shards("qwen2_vl", cfg, torch.tensor([[1, 4, 4]]), 3)
    with pytest.raises(ValueError, match="unknown vision family"):
        plan_vision_shards("llava", cfg, torch.tensor([[1, 4, 4]]), 1)


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_long_video_splits_on_windows_inside_frames(sp):
    """A long video (9 temporal patches of 8x8 patches: 4 windows of 2x2 units per frame) over
    Qwen2.5-VL's SP ranks: the cuts fall on window boundaries — also inside a frame (9 frames do
    not split evenly) — every window and every local window segment lies in one frame, and the
    full-attention segments are the frames (the all-to-all gathers them whole)."""
    cfg = tiny_vision_config("qwen2_5_vl")
    cfg.num_heads = 12
    grid_thw = torch.tensor([[9, 8, 8]])
    plan = plan_vision_shards("qwen2_5_vl", cfg, grid_thw, sp)
    frame_rows = 8 * 8 // UNIT
    frame_of = plan.order // frame_rows  # the frame of each row, in processing order
    windows = _windows(grid_thw)
    assert len(windows) == 9 * 4
    assert all(len(set(frame_of[lo:hi].tolist())) == 1 for lo, hi in windows)  # windows per frame
    bounds = {b for w in windows for b in w}
    assert set(plan.cuts) <= bounds  # window-aligned cuts
    assert any(c % frame_rows for c in plan.cuts) == bool(9 % sp)  # inside a frame unless even
    assert max(plan.tokens_per_rank()) - min(plan.tokens_per_rank()) <= 4 * UNIT  # one window
    for k, cu in enumerate(plan.local_cu_window_seqlens):
        rows = (cu.long() // UNIT + plan.cuts[k]).tolist()
        for lo, hi in zip(rows[:-1], rows[1:]):
            assert (lo, hi) in windows
    assert (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).tolist() == [64] * 9
