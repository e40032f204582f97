"""InternVL's tile split (`ray_dhp.models.vision_internvl`), no process group: the plan is a
partition of every tile's tokens cut on pixel-shuffle units, and the tower driven on that order
(one rank) gives the stock ``get_image_features`` rows, for InternViT-300M's LayerNorm tower and
InternViT-6B's RMSNorm tower with q/k norms (fp64, 1e-12: only summation orders differ)."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import FAMILIES, build_model
from ray_dhp.models.vision_internvl import plan_for, stock_pixels, vision_forward

GRID = torch.tensor([[3, 4, 4], [1, 4, 4], [2, 4, 4]])  # 6 tiles of 4x4 patches: 24 rows


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_plan_partitions_tokens_on_units(sp):
    plan = plan_for("internvl", demo.tiny_model_config("internvl"), GRID, sp)
    toks = torch.cat(plan.tokens)
    assert sorted(toks.tolist()) == list(range(-6, 0)) + list(range(6 * 16))  # each once
    assert plan.cuts[0] == 0 and plan.cuts[-1] == 24 and plan.merge_unit == 4
    for k in range(sp):  # a rank's patch tokens are its rows' units, 4 patches each
        assert int((plan.tokens[k] >= 0).sum()) == 4 * (plan.cuts[k + 1] - plan.cuts[k])
    assert plan.cu_seqlens.tolist() == [17 * t for t in range(7)]
    assert max(plan.tokens_per_rank()) - min(plan.tokens_per_rank()) <= 5  # a unit + a CLS


@pytest.mark.parametrize("tower", ["layer_norm", "rms_norm_qk"])
def test_tile_order_matches_stock_features(tower):
    config = demo.tiny_model_config("internvl")
    if tower == "rms_norm_qk":
        config.vision_config.norm_type, config.vision_config.use_qk_norm = "rms_norm", True
    model = build_model(config, seed=1, dtype=torch.float64)
    with torch.no_grad():  # break the zero-init symmetry (CLS, position table) of a fresh model
        for p in model.model.vision_tower.parameters():
            p.add_(0.1 * torch.randn_like(p))
    rows = torch.randn(int(GRID.prod(-1).sum()), 3 * 14 * 14, dtype=torch.float64)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=stock_pixels(config, rows, GRID)).pooler_output
    visual = FAMILIES["internvl"].visual(model)
    with torch.no_grad():
        got = vision_forward("internvl", visual, rows, plan_for("internvl", config, GRID, 1), 0, None)
    ref = ref.reshape(-1, ref.shape[-1])
    assert got.shape == ref.shape
    assert float((got - ref).norm() / ref.norm()) < 1e-12
