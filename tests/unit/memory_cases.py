"""The stock transformers vision towers at their published widths, measured: the bytes autograd
saves through `vision_forward` (each saved storage once, parameters excluded: the counter of
``benchmarks/video_sp.py``). Shared by `test_vision_memory.py` (SP 1) and
``tests/distributed/test_vision_memory_sp.py`` (SP 2)."""

import torch

from benchmarks.measure import ActivationCounter
from ray_dhp import demo
from ray_dhp.models import build_model
from ray_dhp.models.vision_qwen import plan_vision_shards, vision_forward

WIDTHS = {  # the published ViT widths (ray_dhp.cli.presets); depth and block kinds: the caller's case
    "qwen2_vl": dict(embed_dim=1280, num_heads=16, mlp_ratio=4),
    "qwen2_5_vl": dict(hidden_size=1280, num_heads=16, intermediate_size=3456, window_size=112),
    "qwen3_vl": dict(hidden_size=1152, num_heads=16, intermediate_size=4304),
}


def measured(family, depth, extra, grid, dtype, sp=1, rank=0, group=None):
    """(vision config, patch tokens, vision bytes saved on SP rank ``rank`` of ``sp``)."""
    config = demo.tiny_model_config(family)
    vc = config.vision_config
    for k, v in dict(WIDTHS[family], depth=depth, **extra).items():
        setattr(vc, k, v)
    vc._attn_implementation = "sdpa"
    tower = build_model(config, seed=0, dtype=dtype).model.visual
    grid_thw = torch.tensor([grid])
    pixels = torch.randn(int(grid_thw.prod()), vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                         generator=torch.Generator().manual_seed(0)).to(dtype)
    plan = plan_vision_shards(family, vc, grid_thw, sp)
    counter = ActivationCounter()
    handles = counter.watch_vision(tower)
    with counter.count():
        out = vision_forward(family, tower, pixels, plan, rank, group)
    out.float().square().mean().backward()
    for h in handles:
        h.remove()
    return vc, int(grid_thw.prod()), counter.as_dict()["vision"]
