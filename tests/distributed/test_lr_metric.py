"""The reported ``lr`` is the rate the step trained with (read before the scheduler steps)."""

import pytest
import torch

from ray_dhp.step.optim import lr_factor
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps, run_engine

LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)


def test_lr_metric_is_the_rate_of_the_step(tmp_path):
    cfg = TrainLoopConfig(lr=2e-3, global_batch_size=2, num_steps=3, warmup_steps=2,
                          lr_schedule="cosine", max_grad_norm=None, weight_decay=0.0)
    steps = make_steps(tmp_path, "qwen2_5_vl", cfg, num_samples=8)
    out = run_engine("qwen2_5_vl", LAYOUT, cfg, steps[:1], dtype=torch.float64)
    reported = out["history"][0]["lr"]
    # step 1 trains at half the peak (warm-up 1/2); the next step's rate would be the full peak
    assert reported == pytest.approx(cfg.optim.lr * lr_factor(0, cfg.optim)) == pytest.approx(1e-3)
    # AdamW's first update moves every parameter with a gradient by lr * g / (|g| + eps): the
    # largest move of step 1 is the rate it trained with (eps = 1e-8 << |g|; fp64).
    moved = max(float((out["params"][n] - out["params0"][n]).abs().max()) for n in out["params0"])
    assert moved == pytest.approx(reported, rel=1e-5)
