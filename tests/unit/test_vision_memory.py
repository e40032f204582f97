"""The vision activation model (`ray_dhp.planning.memory_vision`) against the bytes autograd
really saves inside the stock transformers towers at their published widths (forward + backward
through `vision_forward` at SP 1, each saved storage once, parameters excluded: the counter of
``benchmarks/video_sp.py``): Qwen2.5-VL at two shapes (512 tokens, 2 blocks, fp32; 256 tokens,
3 blocks, bf16) in the default run, Qwen2-VL (LayerNorm, QuickGELU) and Qwen3-VL (deepstack,
learned position embedding) in the slow run; SP 2 (Ulysses full-attention blocks) in
``tests/distributed/test_vision_memory_sp.py``.

Tolerance: 0.1 %. Every tensor the towers save is a per-token tensor the model counts (measured
equal to the byte on torch 2.13 CPU, SDPA); what the bound leaves room for is per-call state a
kernel may save on another build (e.g. a flash kernel's RNG seed and offset), a few bytes per
block against ~100 KiB per token. The old ``(8h + 4i)·d`` count was ~21 % short of the
Qwen2.5-VL tower (no fp32 norm copies, qkv output, rotary tables, patch input, merger).
"""

import pytest
import torch

from ray_dhp.planning.memory import ActivationSettings, vision_activation_bytes
from tests.unit.memory_cases import measured

CASES = [  # family, depth, extra vision settings, grid (t, h, w), dtype; one family in the default run
    pytest.param("qwen2_5_vl", 2, {"fullatt_block_indexes": [1]}, (2, 16, 16), torch.float32,
                 id="qwen2_5_vl-512-fp32"),
    pytest.param("qwen2_5_vl", 3, {"fullatt_block_indexes": [2]}, (4, 8, 8), torch.bfloat16,
                 id="qwen2_5_vl-256-bf16"),
    pytest.param("qwen2_vl", 2, {}, (2, 16, 16), torch.float32, marks=pytest.mark.slow,
                 id="qwen2_vl-512-fp32"),
    pytest.param("qwen3_vl", 2, {"deepstack_visual_indexes": [0]}, (1, 16, 32), torch.float32,
                 marks=pytest.mark.slow, id="qwen3_vl-512-fp32"),
]


@pytest.mark.parametrize("family, depth, extra, grid, dtype", CASES)
def test_vision_activation_bytes_match_saved_tensors(family, depth, extra, grid, dtype):
    torch.set_num_threads(1)
    vc, tokens, saved = measured(family, depth, extra, grid, dtype)
    model = vision_activation_bytes(vc, tokens, 1, ActivationSettings(dtype.itemsize, "flash", False))
    print(f"{family} {grid} {dtype}: measured {saved} B, model {model:.0f} B")
    assert abs(model / saved - 1) < 1e-3, (model, saved)
