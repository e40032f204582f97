"""Model FLOPs of a training step and model FLOPs utilisation (MFU).

The counts are the cost model's (`ray_dhp.planning.cost_model.vision_flops` / `text_flops`: 6 x parameters
per token for the dense layers plus the attention term, forward + backward), applied to the
step's real samples: each image with its own patch count, each sample with its own text length.
Recomputation under activation checkpointing is *not* counted (MFU, not hardware utilisation).
"""

from __future__ import annotations

from typing import Optional

from ray_dhp.planning.devices import ACCELERATORS

# Dense bf16 peak per device (FLOP/s), by a substring of torch.cuda.get_device_name(): the
# device table's (`ray_dhp.planning.devices`), in its matching order.
PEAK_BF16 = tuple((a.match, a.peak_bf16) for a in ACCELERATORS.values())


def step_flops(config, counts, micro_batches) -> float:
    """Model FLOPs (forward + backward) of one step over all its samples."""
    from ray_dhp.planning.cost_model import text_flops, vision_flops

    total = 0.0
    for mb in micro_batches:
        for s in mb:
            total += text_flops(config, counts.text, 0, s.num_tokens)
            if s.image_grid_thw is not None:
                for t, h, w in s.image_grid_thw.tolist():
                    total += t * vision_flops(config, counts.vision, h * w)  # attention per frame
    return total


def peak_flops(device, dtype: Optional[str]) -> Optional[float]:
    """The device's dense peak for the training dtype, when known (bf16 on known GPUs), else None."""
    import torch

    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16 if key in name), None)
