"""Videos in the planner (`ray_dhp.planning.video`, ``ray-dhp plan --video``): tokens and
per-frame segments, the cost and memory models' per-frame attention, the CLI. No Ray."""

from pathlib import Path

import pytest

from ray_dhp import demo
from ray_dhp.cli import main
from ray_dhp.cli.models import config_from_dims
from ray_dhp.cli.presets import preset_dims
from ray_dhp.planning.cost_types import Workload
from ray_dhp.planning.cost_model import vision_flops
from ray_dhp.planning.memory import ActivationSettings, estimate_zero3
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.video import VideoShape, parse_videos

ROOT = Path(__file__).resolve().parents[2]
BIG = str(ROOT / "examples" / "qwen2_5_vl_32b_8gpu.yaml")
EAGER = ActivationSettings(dtype_bytes=2, attention="eager", checkpointing=False)


def test_video_shape_tokens_and_segments():
    vc = demo.tiny_model_config("qwen2_5_vl").vision_config
    v = VideoShape.parse("241x448X448")
    assert v == VideoShape(241, 448, 448)
    assert v.grid(vc) == (121, 32, 32)  # the last temporal patch repeats the last frame
    assert v.tokens(vc) == 121 * 1024 and v.frame_tokens(vc) == 1024
    assert parse_videos("2x56x56, 8x112x56") == [VideoShape(2, 56, 56), VideoShape(8, 112, 56)]
    for bad in ("240x448", "0x448x448", "ax1x1", ""):
        with pytest.raises(ValueError, match="FRAMESxHEIGHTxWIDTH|at least one video"):
            parse_videos(bad)
    with pytest.raises(ValueError, match="not a multiple of .* 28.*use e.g. 448"):
        VideoShape(4, 450, 448).grid(vc)


def test_cost_and_memory_models_attend_per_frame():
    config = demo.tiny_model_config("qwen2_5_vl")
    vc, counts = config.vision_config, count_params(config)
    v = VideoShape(64, 112, 112)
    n, seg = v.tokens(vc), v.frame_tokens(vc)
    # 32 frames of one frame's FLOPs, far less than one span of all the video's patches
    assert vision_flops(config, counts.vision, n, segment=seg) == pytest.approx(
        32 * vision_flops(config, counts.vision, seg))
    assert vision_flops(config, counts.vision, n) > 3 * vision_flops(config, counts.vision, n, segment=seg)
    # eager attention scores: per frame; flash: no score term, the segment does not matter
    per_frame = estimate_zero3(config, counts, 8, vision_tokens=n, text_tokens=16, settings=EAGER,
                               segment_tokens=seg)
    one_span = estimate_zero3(config, counts, 8, vision_tokens=n, text_tokens=16, settings=EAGER)
    assert per_frame < one_span
    flash = ActivationSettings(dtype_bytes=2, attention="flash")
    assert estimate_zero3(config, counts, 8, vision_tokens=n, text_tokens=16, settings=flash,
                          segment_tokens=seg) == estimate_zero3(config, counts, 8, vision_tokens=n,
                                                                text_tokens=16, settings=flash)
    with pytest.raises(ValueError, match="vision_segment=48"):
        Workload(n, 16, 1, vision_segment=48)


def test_plan_video_prints_its_tokens_and_memory(capsys, forbid_ray_init):
    assert main(["plan", BIG, "--video", "240x448x448"]) == 0
    out = capsys.readouterr().out
    assert not forbid_ray_init
    assert ("video 240x448x448 per sample (240 frames = 120 temporal patches of 32x32 patches: "
            "122880 vision tokens, 30720 LLM tokens; attention per frame of 1024 patches):") in out
    assert main(["plan", BIG, "--vision-tokens", "122880"]) == 0
    tokens = capsys.readouterr().out
    # flash attention (use_gpu): the same bytes as the video's token count
    lines = [ln for ln in out.splitlines() if ln.startswith("  rank 0 memory")]
    assert lines == [ln for ln in tokens.splitlines() if ln.startswith("  rank 0 memory")]
    assert main(["plan", BIG, "--video", "240x448x448", "--vision-tokens", "4096"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["plan", BIG, "--video", "240x450x448"]) == 2
    assert "--video: video 240x450x448: frame height 450" in capsys.readouterr().err


def test_recommend_plans_for_the_longest_video(capsys, forbid_ray_init):
    assert main(["plan", BIG, "--recommend", "--video", "16x448x448,240x448x448", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "workload: video 240x448x448 per sample" in out and "recommended:" in out


def test_longest_frames_search_on_the_zero3_estimate():
    """The search behind the benchmark's longest-video rows, on 7B's ZeRO-3 estimate."""
    from ray_dhp.planning.video import longest_frames

    assert longest_frames(lambda f: f <= 37) == 36 and longest_frames(lambda f: False) == 0
    config = config_from_dims(preset_dims("qwen2_5_vl", "7b"), "qwen2_5_vl")
    counts, vc = count_params(config), config.vision_config
    flash = ActivationSettings(dtype_bytes=2, attention="flash", checkpointing=True)

    def zero3(frames):
        v = VideoShape(frames, 448, 448)
        return estimate_zero3(config, counts, 8, vision_tokens=v.tokens(vc), text_tokens=64,
                              settings=flash, state_bytes=10) <= 80 * 2**30
    f = longest_frames(zero3)
    assert zero3(f) and not zero3(f + 2) and f > 2
