"""fp64 parity with video samples (issue #27): every step mixes video, image+video and
text-only samples; the DHP engine (videos through the vision SP ranks and the same feature
boundary as images) against the stock single-process model given ``pixel_values_videos`` /
``video_grid_thw`` (/ ``second_per_grid_ts``) by `ray_dhp.step.reference`.

Tolerance as in test_parity.py's fp64 matrix (1e-10 relative: only summation orders differ,
~1e-14 measured; a real bug — a video row in the wrong place, a missing second_per_grid_ts or
timestamp — is O(1)). Every rank's copy of every parameter, every update and the loss and
grad-norm of every step are compared; the clipped gradients of every step too.
"""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.data.video import VideoSettings
from ray_dhp.demo.video import make_video_dataset
from ray_dhp.models.vision_qwen import plan_vision_shards
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import assert_parity, reference_fixture, run_engine, run_reference
from tests.distributed.video_cases import LONG_CFG, long_video_steps

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=2,
                      max_grad_norm=0.5, weight_decay=0.1, seed=0)

LAYOUTS = {
    "collocated-sp2-tp2": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2),
    "disjoint-1v-2t": dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2),
}
DEFAULT = {("qwen2_5_vl", "collocated-sp2-tp2")}


def video_steps(tmp_path, family: str, cfg: TrainLoopConfig):
    """Steps of a generated moving-square set: videos of 8-12 frames at 4 fps (4-6 sampled at
    2 fps: 2-3 temporal patches), frames resized to 2x2 merge units, stills as images."""
    path = make_video_dataset(tmp_path / f"video_{family}", num_samples=8, seed=cfg.optim.seed)
    unit = 32 if family == "qwen3_vl" else 28
    proc = demo.tiny_processor(family).configured(
        video=VideoSettings(min_pixels=(2 * unit) ** 2, max_pixels=(2 * unit) ** 2))
    sampler = StepSampler(read_annotations(path), proc, resolve_data_root(path), cfg.sampler_config())
    steps = [sampler.next_step() for _ in range(cfg.optim.num_steps)]
    kinds = [[s.modalities.tolist() if s.modalities is not None else [] for mb in mbs for s in mb]
             for mbs in steps]
    assert any([2] in k and [1, 2] in k and [] in k for k in kinds)  # a step mixing all three
    return steps


video_reference = reference_fixture(cfg=CFG, make=video_steps, name="video_reference")


@pytest.mark.parametrize("family,layout", [
    pytest.param(f, l, marks=() if (f, l) in DEFAULT else (pytest.mark.slow,), id=f"{f}-{l}")
    for f in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl") for l in LAYOUTS])
def test_video_parity_fp64(family, layout, video_reference):
    _, steps, ref = video_reference(family)
    got = run_engine(family, LAYOUTS[layout], CFG, steps, torch.float64, grads=True)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
    print(f"{family} {layout}: worst update error {worst[0]:.2e}, parameter {worst[1]:.2e} ({worst[2]})")


@pytest.mark.slow  # ~75 s on the loaded 2-core machine; the default run keeps the plan's unit test
def test_long_video_over_sp2_window_attention_fp64(tmp_path):
    """A long video split over Qwen2.5-VL's two vision SP ranks: the cut falls inside a frame,
    on a window boundary (window blocks stay local, full-attention blocks gather whole frames);
    exact against the stock model (tolerance as above)."""
    steps = long_video_steps(tmp_path, LONG_CFG)
    grids = [s.image_grid_thw for s in steps[0][0] if s.image_grid_thw is not None]
    assert [g.tolist() for g in grids] == [[[9, 8, 8]]]
    vc = demo.tiny_model_config("qwen2_5_vl").vision_config
    plan = plan_vision_shards("qwen2_5_vl", vc, grids[0], 2)
    assert plan.cuts[1] % 16 and plan.cuts[1] % 4 == 0  # inside frame 5, between two windows
    ref = run_reference("qwen2_5_vl", LONG_CFG, steps, torch.float64)
    got = run_engine("qwen2_5_vl", LAYOUTS["collocated-sp2-tp2"], LONG_CFG, steps, torch.float64,
                     grads=True)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
    print(f"long video sp2: worst update error {worst[0]:.2e}, parameter {worst[1]:.2e} ({worst[2]})")
