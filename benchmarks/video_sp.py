"""Long videos over vision sequence parallelism (issue #27): vision activations per rank at SP
1 / 2 / 4 on one decoded video, and the longest 2 fps 448x448 video per 8 x 80 GB (planner).

**Measured.** A moving-square clip is written as H.264 (`ray_dhp.demo.video.write_mp4`, PyAV),
decoded and sampled as Qwen's ``qwen-vl-utils`` does (`ray_dhp.data.video.load_video`: 2 fps,
frames resized to ``--size`` px) and turned into ``pixel_values_videos`` (`video_patches`). A
Qwen2.5-VL vision tower at the real width (hidden 1280, 16 heads, MLP 3456, 112 px windows,
2x2 merge; ``--depth`` blocks, the last of every two a full-attention block) runs forward +
backward on it with `ray_dhp.models.vision_qwen.vision_forward` on ``sp`` gloo ranks
(window-aligned split per frame, `plan_vision_shards`), for sp = 1, 2, 4 side by side in one run.
Per rank: the bytes autograd saves for backward inside the tower (`measure.ActivationCounter`,
each storage once, parameters excluded) — the vision activations — next to the memory model's
`ray_dhp.planning.memory.vision_activation_bytes` for the same shapes; the features every layout
computes are compared with SP1's (max abs difference, fp32).

**Planned.** For Qwen2.5-VL-7B and -32B (`ray_dhp.cli.presets`), the longest video of 448x448
frames at 2 fps (`ray_dhp.planning.video.VideoShape`) that fits 8 x 80 GiB: DHP = any layout
`ray_dhp.planning.recommend.recommend` finds feasible (every collocated / disjoint layout and
ZeRO stage; one video per micro-batch, 8 micro-batches), against ZeRO-3 over 8 GPUs
(`estimate_zero3`: one video per GPU, no SP/TP); bf16_mixed state, bf16 activations, flash
attention, with and without activation checkpointing, 64 text tokens per sample.

Run: ``python -m benchmarks.video_sp [--seconds 8] [--size 224] [--depth 4]``; writes
``benchmarks/results/video-sp-<hw>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SPS = (1, 2, 4)


def vision_config(depth: int):
    """Qwen2.5-VL's ViT at its published width (`ray_dhp.cli.presets`), ``depth`` blocks."""
    import transformers

    from ray_dhp.cli.presets import _QWEN2_5_VL_VISION

    full = [i for i in range(depth) if i % 2 == 1]
    vc = transformers.Qwen2_5_VLConfig(vision_config=dict(
        _QWEN2_5_VL_VISION, depth=depth, fullatt_block_indexes=full,
        out_hidden_size=1024)).vision_config
    vc._attn_implementation = "sdpa"
    return vc


def decoded_video(seconds: float, size: int) -> dict:
    """Write, decode and sample a clip: ``pixel_values_videos`` and ``video_grid_thw``."""
    from ray_dhp import demo
    from ray_dhp.data.video import VideoSettings, load_video, video_patches
    from ray_dhp.demo.video import moving_square, write_mp4

    fps = 4
    with tempfile.TemporaryDirectory() as d:
        path = write_mp4(os.path.join(d, "clip.mp4"),
                         moving_square("right", int(seconds * fps), (size, size), side=size // 4), fps)
        nbytes = os.path.getsize(path)
        clip = load_video(path, VideoSettings(fps=2.0, min_pixels=size * size, max_pixels=size * size),
                          unit=28)
    pixels, grid = video_patches(clip.frames, demo.tiny_processor("qwen2_5_vl").image_processor)
    return {"pixels": pixels, "grid": grid, "sampled_frames": int(clip.frames.shape[0]),
            "mp4_bytes": nbytes, "source_frames": int(seconds * fps)}


def rank_body(rank, world, opts: dict):
    """One SP rank: forward + backward of its share of the video; saved vision bytes."""
    import torch.distributed as dist
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from benchmarks import measure
    from ray_dhp.models.vision_qwen import plan_vision_shards, vision_forward

    torch.set_num_threads(1)
    vc = vision_config(opts["depth"])
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vc, dtype=torch.float32)
    plan = plan_vision_shards("qwen2_5_vl", vc, opts["grid"], world)
    group = dist.group.WORLD if world > 1 else None
    acts = measure.ActivationCounter()
    handles = acts.watch_vision(tower)
    with acts.count():
        out = vision_forward("qwen2_5_vl", tower, opts["pixels"], plan, rank, group)
    out.square().mean().backward()
    for h in handles:
        h.remove()
    return {"vision_bytes": acts.as_dict()["vision"], "tokens": plan.tokens_per_rank()[rank],
            "rows": plan.rows(rank), "features": out.detach()}


def measure_sp(video: dict, depth: int) -> list:
    from benchmarks.launcher import spawn
    from ray_dhp.planning.memory import ActivationSettings, vision_activation_bytes

    vc = vision_config(depth)
    tokens = int(video["grid"].prod(-1).sum())
    opts = {"depth": depth, "grid": video["grid"], "pixels": video["pixels"]}
    per_sp, rows = {}, []
    for sp in SPS:
        per_sp[sp] = spawn(rank_body, sp, (opts,), backend="gloo", threads=1, timeout_s=1800)
    def pooled(ranks):  # the features in the stock pooler's row order (rows: its row ids)
        out = torch.empty(sum(len(r["rows"]) for r in ranks), ranks[0]["features"].shape[-1])
        for r in ranks:
            out[r["rows"]] = r["features"]
        return out

    ref = pooled(per_sp[1])
    base = max(r["vision_bytes"] for r in per_sp[1])
    for sp in SPS:
        ranks = per_sp[sp]
        feats = pooled(ranks)
        worst = max(r["vision_bytes"] for r in ranks)
        model = vision_activation_bytes(vc, tokens, sp, ActivationSettings(4, "flash", False))
        rows.append({"sp": sp, "tokens_per_rank": [r["tokens"] for r in ranks],
                     "vision_bytes_per_rank": [r["vision_bytes"] for r in ranks],
                     "max_rank_bytes": worst, "fraction_of_sp1": worst / base, "ideal": 1 / sp,
                     "model_bytes": model, "model_error": model / worst - 1,
                     "max_abs_diff_vs_sp1": float((feats - ref).abs().max())})
    return rows


def longest_videos(size: int = 448, gpus: int = 8, device_gib: float = 80.0,
                   text_tokens: int = 64) -> list:
    """Longest ``size``-px video at 2 fps per model, DHP (planner) vs ZeRO-3, AC off / on."""
    from ray_dhp.cli.models import config_from_dims
    from ray_dhp.cli.presets import preset_dims
    from ray_dhp.planning.memory import GIB, ActivationSettings, estimate_zero3
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Workload, recommend
    from ray_dhp.planning.video import VideoShape, longest_frames
    from ray_dhp.step.precision import POLICIES

    policy = POLICIES["bf16_mixed"]
    out = []
    for name, preset in (("Qwen2.5-VL-7B", "7b"), ("Qwen2.5-VL-32B", "32b")):
        config = config_from_dims(preset_dims("qwen2_5_vl", preset), "qwen2_5_vl")
        counts, vc = count_params(config), config.vision_config
        for ac in (False, True):
            s = ActivationSettings(dtype_bytes=2, attention="flash", checkpointing=ac)

            def workload(frames):
                v = VideoShape(frames, size, size)
                return Workload(v.tokens(vc), text_tokens, gpus, gpus, s, float(policy.state_bytes()),
                                device_gib, policy=policy, vision_segment=v.frame_tokens(vc))

            def dhp(frames):
                best = recommend(config, gpus, workload(frames), counts=counts)[0]
                return best if best.feasible else None

            def zero3(frames):
                w = workload(frames)
                return estimate_zero3(config, counts, gpus, vision_tokens=w.vision_tokens,
                                      text_tokens=text_tokens, settings=s,
                                      state_bytes=policy.state_bytes(),
                                      segment_tokens=w.vision_segment) <= device_gib * GIB
            f_dhp, f_z3 = longest_frames(dhp), longest_frames(zero3)
            best = dhp(f_dhp) if f_dhp else None
            out.append({"model": name, "activation_checkpointing": ac, "frame_px": size,
                        "dhp_frames": f_dhp, "dhp_seconds": f_dhp / 2,
                        "dhp_vision_tokens": workload(f_dhp).vision_tokens if f_dhp else 0,
                        "dhp_layout": best.layout.describe() if best else None,
                        "dhp_gib_per_gpu": round(best.peak_memory_gib, 1) if best else None,
                        "zero3_frames": f_z3, "zero3_seconds": f_z3 / 2,
                        "ratio": f_dhp / f_z3 if f_z3 else None})
    return out


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = result["measured"]
    names = [f"SP{r['sp']}" for r in rows]
    a.bar(names, [r["max_rank_bytes"] / 2**20 for r in rows], color="#37a", label="measured")
    a.plot(names, [r["model_bytes"] / 2**20 for r in rows], "ko", label="memory model")
    a.set_ylabel("vision activations / rank (MiB)")
    a.set_title(f"{result['video']['grid']} patches ({result['video']['sampled_frames']} frames)",
                fontsize=8)
    a.legend(fontsize=7)
    plan = result["longest"]
    labels = [f"{r['model'].split('-')[-1]}{' AC' if r['activation_checkpointing'] else ''}" for r in plan]
    x = range(len(plan))
    b.bar([i - 0.2 for i in x], [r["dhp_seconds"] for r in plan], 0.4, label="DHP (planner)")
    b.bar([i + 0.2 for i in x], [r["zero3_seconds"] for r in plan], 0.4, label="ZeRO-3")
    b.set_xticks(list(x), labels)
    b.set_ylabel("longest video (s at 2 fps, 448x448)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--size", type=int, default=224, help="frame side in pixels (multiple of 28)")
    p.add_argument("--depth", type=int, default=4, help="ViT blocks (the published model: 32)")
    a = p.parse_args(argv)
    video = decoded_video(a.seconds, a.size)
    measured = measure_sp(video, a.depth)
    longest = longest_videos()
    date, hw = datetime.date.today().isoformat(), f"cpu{os.cpu_count()}"
    result = {"hardware": hw, "date": date, "depth": a.depth,
              "video": {"seconds": a.seconds, "size": a.size, "grid": video["grid"].tolist()[0],
                        "sampled_frames": video["sampled_frames"],
                        "source_frames": video["source_frames"], "mp4_bytes": video["mp4_bytes"]},
              "measured": measured, "longest": longest}
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"video-sp-{hw}-{date}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    _plot(result, stem + ".png")
    for r in measured + longest:
        print(json.dumps(r))
    return result


if __name__ == "__main__":
    main()
