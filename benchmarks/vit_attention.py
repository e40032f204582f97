"""One attention call per ViT block vs the per-segment loop (issue #13).

Vision tower forward + backward (one process, no parallelism) on one image of 1k / 4k / 16k
patches, with the attention of every block run either as one SDPA call per segment in a Python
loop (the old path, ``batched_segments = False``) or as one batched call per block (segments
stacked and padded to the longest, pad keys masked; the new default). Both contenders run side by
side in one process, alternating, on the same tower and inputs; the medians of ``--reps`` timings
are reported. Two towers, both narrow (hidden 64, 4 heads, depth 2) so that 16k patches fit in a
few GiB on a CPU:

* ``qwen2_5_vl`` windows: block 0 is a window block (64-patch windows: 16 per 1k patches),
  block 1 a full-attention block (one segment: the image);
* ``qwen2_vl`` frames: a video of 256-patch frames (one segment per frame: 4 / 16 / 64 segments),
  every block full attention.

On a CUDA machine the same script runs the tower on the GPU (fp32 SDPA; the flash-attn varlen
path needs half precision and ``attn_implementation="flash_attention_2"``). Run:
``python -m benchmarks.vit_attention [--sizes 1024 4096 16384] [--reps 3]``; writes
``benchmarks/results/vit-attention-<hw>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HIDDEN, HEADS, DEPTH = 64, 4, 2


def _tower(family: str):
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    common = dict(depth=DEPTH, num_heads=HEADS, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(vision_config=dict(
            common, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, out_hidden_size=HIDDEN,
            window_size=112, fullatt_block_indexes=[1])).vision_config
        cls = Qwen2_5_VisionTransformerPretrainedModel
    else:
        cfg = transformers.Qwen2VLConfig(vision_config=dict(
            common, embed_dim=HIDDEN, hidden_size=HIDDEN, mlp_ratio=2)).vision_config
        cls = Qwen2VisionTransformerPretrainedModel
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls._from_config(cfg, dtype=torch.float32)


def _grid(family: str, patches: int) -> list:
    side = int(round(patches ** 0.5))
    if family == "qwen2_5_vl":
        return [(1, side, side)]  # one square image
    return [(patches // 256, 16, 16)]  # a video of 256-patch frames


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_once(visual, family, pv, plan) -> float:
    from ray_dhp.models.vision_qwen import vision_forward

    _sync(pv.device)
    t0 = time.perf_counter()
    out = vision_forward(family, visual, pv, plan, 0, None)
    out.square().mean().backward()
    _sync(pv.device)
    visual.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _measure(family: str, patches: int, reps: int) -> dict:
    from ray_dhp.models.vision_qwen import install_ulysses, plan_vision_shards

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    visual = _tower(family).to(dev)
    install_ulysses(family, visual)
    grid = torch.tensor(_grid(family, patches))
    plan = plan_vision_shards(family, visual.config, grid, sp=1)
    pv = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)).to(dev)
    times = {"loop": [], "batched": []}
    for rep in range(reps + 1):  # the first round warms up and is dropped
        for name in ("loop", "batched"):
            for blk in visual.blocks:
                blk.attn.batched_segments = name == "batched"
            t = _time_once(visual, family, pv, plan)
            if rep:
                times[name].append(t)
    segs = {"window": len(plan.local_cu_window_seqlens[0]) - 1} if plan.local_cu_window_seqlens else {}
    segs["full"] = len(plan.cu_seqlens) - 1
    loop, batched = statistics.median(times["loop"]), statistics.median(times["batched"])
    return {"family": family, "patches": int(grid.prod(-1).sum()), "segments_per_block": segs,
            "loop_s": round(loop, 4), "batched_s": round(batched, 4), "speedup": round(loop / batched, 3),
            "all_loop_s": times["loop"], "all_batched_s": times["batched"]}


def _plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, family in zip(axes, ("qwen2_5_vl", "qwen2_vl")):
        sel = [r for r in rows if r["family"] == family]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["loop_s"] for r in sel], 0.4, label="per-segment loop", color="#999")
        ax.bar([i + 0.2 for i in x], [r["batched_s"] for r in sel], 0.4, label="one call per block", color="#37a")
        ax.set_xticks(list(x), [f"{r['patches']}" for r in sel])
        ax.set_yscale("log")
        ax.set_xlabel("patches")
        ax.set_ylabel("vision fwd+bwd (s)")
        ax.set_title({"qwen2_5_vl": "Qwen2.5-VL windows", "qwen2_vl": "Qwen2-VL 256-patch frames"}[family])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--families", nargs="+", default=["qwen2_5_vl", "qwen2_vl"])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dev = "cuda" if torch.cuda.is_available() else f"cpu{os.cpu_count()}"
    rows = []
    for family in a.families:
        for n in a.sizes:
            rows.append(_measure(family, n, a.reps))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("all_")}), flush=True)
    date = datetime.date.today().isoformat()
    result = {"hardware": dev, "date": date, "threads": a.threads, "hidden": HIDDEN, "heads": HEADS,
              "depth": DEPTH, "reps": a.reps, "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"vit-attention-{dev}-{date}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    _plot(rows, stem + ".png")
    return result


if __name__ == "__main__":
    main()
