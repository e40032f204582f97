"""Model state saved per rank by freezing modules or training LoRA adapters (`ray_dhp.config.tuning`).

Two parts, both collocated SP=2 / TP=2 under the bf16_mixed policy (bf16 weights and grads,
fp32 masters and AdamW moments) with vision ZeRO-1:

* measured: a small Qwen2.5-VL (text hidden 512, 4 layers, vocab 8192; ViT 8 blocks of width
  640) on 2 spawned gloo ranks, one optimizer step per choice; each rank's weights, gradients
  at the optimizer, masters and moments counted from its tensors (`DHPEngine.state_bytes`),
  next to what `ray-dhp plan` computes (`ray_dhp.planning.memory.rank_state`);
* plan: the same choices for the published Qwen2.5-VL-7B dims (`ray-dhp plan` arithmetic, which
  the test suite checks equals the measured bytes to the byte; nothing is allocated).

Results: ``results/tuning-memory-cpu2-<date>.json`` and ``.png``.

    python -m benchmarks.tuning_memory
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

RESULTS = os.path.join(os.path.dirname(__file__), "results")
LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
PRECISION = "bf16_mixed"
CHOICES = {
    "full": None,
    "frozen vision tower": {"vision": {"train": False}},
    "frozen vision + merger": {"vision": {"train": False}, "merger": {"train": False}},
    "frozen LLM": {"llm": {"train": False}},
    "LoRA r=16 (vision frozen)": {"vision": {"train": False}, "merger": {"train": False},
                                  "llm": {"lora": {"r": 16, "alpha": 32}}},
}
MIB = 1024 ** 2


def small_config():
    from ray_dhp.cli.models import config_from_dims
    from ray_dhp.cli.presets import preset_dims

    dims = preset_dims("qwen2_5_vl", "7b")
    dims["text_config"].update(hidden_size=512, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=1536, vocab_size=8192)
    dims["vision_config"].update(depth=8, hidden_size=640, num_heads=8, intermediate_size=1728,
                                 fullatt_block_indexes=[3, 7], out_hidden_size=512)
    return config_from_dims(dims, "qwen2_5_vl")


def _planned(config, modules, rank: int) -> dict:
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.tuning import parse_tuning

    tuning = parse_tuning(modules)
    st = rank_state(count_params(config, None if tuning.default else tuning), Topology.build(**LAYOUT),
                    rank, POLICIES[PRECISION])
    return {k: getattr(st, k) for k in ("weights", "grads", "masters", "optimizer", "total")}


def _rank_body(rank, world, config):
    import torch

    from benchmarks.shapes import make_batch
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    groups = build_groups(Topology.build(**LAYOUT), torch.device("cpu"))
    out = {}
    for name, modules in CHOICES.items():
        cfg = TrainLoopConfig(global_batch_size=2, seed=0, precision=PRECISION, lr=1e-4,
                              modules=modules)
        engine = DHPEngine(config, groups, cfg.step_config())
        engine.step([make_batch(2, 64, config)])
        out[name] = {"held": engine.state_bytes(), "planned": _planned(config, modules, rank)}
    return out


def run(out_dir: str) -> dict:
    from ray_dhp.cli.models import config_from_dims
    from ray_dhp.cli.presets import preset_dims
    from ray_dhp.train.launch import spawn

    config = small_config()
    ranks = spawn(_rank_body, 2, (config,), backend="gloo", threads=1, timeout_s=1800)
    big = config_from_dims(preset_dims("qwen2_5_vl", "7b"), "qwen2_5_vl")
    result = {"layout": "collocated SP2/TP2, vision ZeRO-1", "precision": PRECISION,
              "machine": "2-core CPU, gloo, shared with other jobs (bytes do not depend on it)",
              "measured_model": "qwen2_5_vl: text hidden 512 x 4 layers, vocab 8192; ViT 8 x 640",
              "measured": ranks,
              "plan_7b": {name: [_planned(big, m, r) for r in range(2)] for name, m in CHOICES.items()}}
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"tuning-memory-cpu2-{datetime.date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, stem + ".png")
    return result


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(CHOICES)
    parts = ("weights", "grads", "masters", "optimizer")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (title, rows, unit, scale) in zip(axes, (
            ("measured, small model, rank 0", [result["measured"][0][n]["held"] for n in names], "MiB", MIB),
            ("plan, Qwen2.5-VL-7B, rank 0", [result["plan_7b"][n][0] for n in names], "GiB", 1024 ** 3))):
        bottom = [0.0] * len(names)
        for part in parts:
            vals = [r[part] / scale for r in rows]
            ax.barh(names, vals, left=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(title)
        ax.set_xlabel(f"model state per rank ({unit})")
        ax.invert_yaxis()
    axes[0].legend(loc="lower right")
    fig.suptitle(f"Per-module training choices: model state per rank ({PRECISION}, SP2/TP2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    r = run(a.out)
    for name in CHOICES:
        m = [k[name] for k in r["measured"]]
        print(f"{name:28s} measured rank0 {m[0]['held']['total'] / MIB:8.2f} MiB (plan "
              f"{m[0]['planned']['total'] / MIB:8.2f}); 7B plan rank0 "
              f"{r['plan_7b'][name][0]['total'] / 1024 ** 3:6.2f} GiB")


if __name__ == "__main__":
    main()
