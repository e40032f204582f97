"""Plan figures for the LM's context parallelism (issue #44): the longest LM sequence and the
longest 2 fps 448x448 video that train on 8 GPUs of 80 GB, with and without
``text.context_parallel``, next to ZeRO-3 and to text TP alone.

Planner only (`ray_dhp.planning`), no GPU: for each model and each length the layouts are ranked
by `ray_dhp.planning.recommend.recommend` and a length "fits" when a layout's planned peak per
rank (state + saved activations + CP's all-to-all buffers, or the step / start-up peak) stays
under the device's memory less its margin (`ray_dhp.planning.devices`: an H100's 79.1 GiB less
6.7 GiB; ``--no-margin``: the whole 80 GiB, as `benchmarks/video_sp.py`'s table). Contenders:

* **DHP + CP**: every collocated / disjoint layout and ZeRO stage, with every text
  context-parallel degree the heads admit (``recommend(..., context_parallel=True)``);
* **DHP, no CP**: the same without CP (text TP with or without text SP, DP);
* **text TP only**: the DHP layouts without text SP and without CP (what uniform tensor
  parallelism gives the LM: its sequence replicated on every TP rank);
* **ZeRO-3**: `ray_dhp.planning.memory.estimate_zero3`, one sample per GPU, no SP/TP/CP.

Workload: one sample per micro-batch, 8 micro-batches (global batch 8); bf16_mixed state,
bf16 activations, flash attention, activation checkpointing on. LM sequence: one 1024-patch
image (256 LM tokens) + N text tokens, N a multiple of 1024. Video: F frames at 2 fps of
448x448 (`ray_dhp.planning.video.VideoShape`) + 64 text tokens.

Run: ``python -m benchmarks.context_parallel [--no-margin]``; writes
``benchmarks/results/context-parallel-plan-<date>.json`` and prints the README tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = (("Qwen2.5-VL-7B", "7b"), ("Qwen2.5-VL-32B", "32b"))
GOAL = 262144  # LM tokens


def _setup(preset: str):
    from ray_dhp.cli.models import config_from_dims
    from ray_dhp.cli.presets import preset_dims
    from ray_dhp.models.sizes import count_params

    config = config_from_dims(preset_dims("qwen2_5_vl", preset), "qwen2_5_vl")
    return config, count_params(config)


def _workload(vision_tokens: int, text_tokens: int, margin: bool, segment=None):
    from ray_dhp.planning.devices import budget_of
    from ray_dhp.planning.memory import ActivationSettings
    from ray_dhp.planning.recommend import Workload
    from ray_dhp.step.precision import POLICIES

    policy = POLICIES["bf16_mixed"]
    b = budget_of("h100") if margin else None
    return Workload(vision_tokens, text_tokens, 8, 8, ActivationSettings(2, "flash", True),
                    float(policy.state_bytes()), b.memory_gib if b else 80.0,
                    margin_gib=b.margin_gib if b else 0.0, policy=policy, vision_segment=segment)


def _best(config, counts, w, contender: str):
    """The fastest feasible candidate of ``contender`` for workload ``w`` (None: none fits)."""
    from ray_dhp.planning.memory import GIB, estimate_zero3
    from ray_dhp.planning.recommend import recommend

    if contender == "zero3":
        need = estimate_zero3(config, counts, 8, vision_tokens=w.vision_tokens,
                              text_tokens=w.text_tokens, settings=w.settings,
                              state_bytes=w.state_bytes, segment_tokens=w.vision_segment) / GIB
        return {"layout": "ZeRO-3 over 8", "gib": round(need, 1)} \
            if need <= w.device_gib - w.margin_gib else None
    cands = recommend(config, 8, w, counts=counts, context_parallel=contender == "cp")
    if contender == "tp":
        cands = [c for c in cands if not c.layout.text_sp and c.layout.text_cp == 1]
    ok = [c for c in cands if c.feasible]
    if not ok:
        return None
    return {"layout": ok[0].layout.describe(), "gib": round(ok[0].peak_memory_gib, 1),
            "step_s": ok[0].step_s}


def _longest(fits, unit: int, limit: int) -> int:
    """Largest multiple of ``unit`` (<= limit) for which ``fits`` holds (monotone), 0 if none."""
    from ray_dhp.planning.video import longest_frames

    return longest_frames(fits, step=unit, limit=limit)


CONTENDERS = ("cp", "nocp", "tp", "zero3")


def sequences(margin: bool) -> list:
    out = []
    for name, preset in MODELS:
        config, counts = _setup(preset)
        row = {"model": name}
        for c in CONTENDERS:
            def fits(n, c=c):
                return _best(config, counts, _workload(1024, n - 256, margin), c) is not None
            n = _longest(fits, 1024, 1 << 21)
            row[c] = {"lm_tokens": n, **(_best(config, counts, _workload(1024, n - 256, margin), c)
                                         or {})} if n else {"lm_tokens": 0}
        goal = _best(config, counts, _workload(1024, GOAL - 256, margin), "cp")
        row["goal_256k_with_cp"] = goal
        out.append(row)
        print(json.dumps(row))
    return out


def videos(margin: bool) -> list:
    from ray_dhp.planning.video import VideoShape

    out = []
    for name, preset in MODELS:
        config, counts = _setup(preset)
        vc = config.vision_config
        row = {"model": name}
        for c in CONTENDERS:
            def w_of(frames):
                v = VideoShape(frames, 448, 448)
                return _workload(v.tokens(vc), 64, margin, v.frame_tokens(vc))

            f = _longest(lambda fr, c=c: _best(config, counts, w_of(fr), c) is not None, 2, 1 << 14)
            row[c] = {"frames": f, "seconds": f / 2, **((_best(config, counts, w_of(f), c) or {})
                                                       if f else {})}
        out.append(row)
        print(json.dumps(row))
    return out


def tables(res: dict) -> str:
    names = {"cp": "DHP + CP", "nocp": "DHP, no CP", "tp": "text TP only", "zero3": "ZeRO-3"}
    lines = ["| model | " + " | ".join(f"{names[c]} LM tokens" for c in CONTENDERS)
             + " | DHP + CP layout (planned GiB) |", "|---|" + "---:|" * len(CONTENDERS) + "---|"]
    for r in res["sequences"]:
        lines.append(f"| {r['model']} | " + " | ".join(f"{r[c]['lm_tokens']:,}" for c in CONTENDERS)
                     + f" | {r['cp'].get('layout')} ({r['cp'].get('gib')}) |")
    lines += ["", "| model | " + " | ".join(f"{names[c]} frames" for c in CONTENDERS)
              + " | DHP + CP layout (planned GiB) |", "|---|" + "---:|" * len(CONTENDERS) + "---|"]
    for r in res["videos"]:
        lines.append(f"| {r['model']} | " + " | ".join(
            f"{r[c]['frames']} ({r[c]['seconds']:g} s)" for c in CONTENDERS)
            + f" | {r['cp'].get('layout')} ({r['cp'].get('gib')}) |")
    lines += [""] + [f"256k LM tokens, {r['model']}, with CP: "
                     + (f"{r['goal_256k_with_cp']['layout']} ({r['goal_256k_with_cp']['gib']} GiB)"
                        if r["goal_256k_with_cp"] else "does not fit") for r in res["sequences"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-margin", action="store_true", help="plan for the whole 80 GiB")
    args = ap.parse_args()
    margin = not args.no_margin
    res = {"date": datetime.date.today().isoformat(), "device": "h100 less margin" if margin
           else "80 GiB, no margin", "sequences": sequences(margin), "videos": videos(margin)}
    os.makedirs(RESULTS, exist_ok=True)
    tag = "margin" if margin else "nomargin"
    path = os.path.join(RESULTS, f"context-parallel-plan-{tag}-{res['date']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(tables(res))
    print("wrote", path)


if __name__ == "__main__":
    main()
