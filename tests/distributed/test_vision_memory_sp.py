"""The vision activation model at vision SP 2 (`ray_dhp.planning.memory_vision`: the Ulysses
full-attention blocks keep the all-to-all's q, k, v and the output all-to-all's result instead of
the qkv output and the rotated q and k) against the bytes each SP rank's autograd saves, on the
stock Qwen2.5-VL tower at its published width (one window and one full-attention block, 512
patch tokens, fp32). Tolerance as in ``tests/unit/test_vision_memory.py`` (0.1 %; exact to the
byte measured)."""

import pytest
import torch

from tests.spawn import run_on_ranks

CASE = ("qwen2_5_vl", 2, {"fullatt_block_indexes": [1]}, (2, 16, 16), torch.float32)


def _body(rank, world):
    import torch.distributed as dist

    from tests.unit.memory_cases import measured

    torch.set_num_threads(1)
    vc, tokens, saved = measured(*CASE, sp=world, rank=rank, group=dist.group.WORLD)
    return vc.to_dict(), tokens, saved


@pytest.mark.slow
def test_vision_activation_bytes_match_saved_tensors_at_sp2():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from ray_dhp.planning.memory import ActivationSettings, vision_activation_bytes

    outs = run_on_ranks(_body, 2)
    vc = Qwen2_5_VLVisionConfig(**outs[0][0])
    model = vision_activation_bytes(vc, outs[0][1], 2, ActivationSettings(4, "flash", False))
    for _, _, saved in outs:
        assert abs(model / saved - 1) < 1e-3, (model, saved)
