"""One full training step of a real-width Qwen2.5-VL, collocated SP=2 / TP=2 on 2 gloo ranks.

The model is the start-up benchmark's (`benchmarks.startup_memory.model_config`: 7B text width —
hidden 3584, vocab 152064, MLP 18944 — with 2 text layers and 8 ViT blocks of width 1280, 1.76 B
parameters). Each rank builds only its shards (meta + materialise), trains one optimizer step on
``--samples`` synthetic samples with one ``--patches``-patch image each under ``--precision``,
and reports: its peak RSS (``ru_maxrss``), the state it holds after the step (weights, grads at the
optimizer, fp32 masters, AdamW moments — measured from the tensors, `DHPEngine.state_bytes`),
what `ray-dhp plan`'s policy arithmetic says it holds (`ray_dhp.planning.memory.rank_state`), the loss and
the step time. Results: ``results/real-width-step-<width>-<precision>-cpu2-<date>.json``.

    python -m benchmarks.real_width_step [--precision bf16] [--patches 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import time

RESULTS = os.path.join(os.path.dirname(__file__), "results")
GIB = 1024 ** 3
LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


def model_config(width: str = "7b"):
    from benchmarks import startup_memory

    if width != "7b":
        raise ValueError("only the 7b text width is prepared (benchmarks.startup_memory)")
    return startup_memory.model_config()


def _rank_body(rank, world, config, precision, samples, patches):
    import torch

    from benchmarks.shapes import make_batch
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    topo = Topology.build(**LAYOUT)
    groups = build_groups(topo, torch.device("cpu"))
    cfg = TrainLoopConfig(global_batch_size=samples, seed=0, precision=precision, lr=1e-5)
    t0 = time.perf_counter()
    engine = DHPEngine(config, groups, cfg.step_config())
    built = time.perf_counter() - t0
    batch = make_batch(samples, patches, config)
    t0 = time.perf_counter()
    out = engine.step([batch])
    step_s = time.perf_counter() - t0
    held = engine.state_bytes()
    planned = rank_state(count_params(config), topo, rank, engine.policy)
    return {"rank": rank, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "held": held, "planned": {k: getattr(planned, k) for k in
                                      ("weights", "grads", "masters", "optimizer", "total")},
            "loss": out["loss"], "grad_norm": out["grad_norm"], "build_s": built, "step_s": step_s}


def run(width: str, precision: str, samples: int, patches: int, out_dir: str) -> dict:
    from ray_dhp.train.launch import spawn
    from ray_dhp.models.sizes import count_params

    config = model_config(width)
    counts = count_params(config)
    ranks = spawn(_rank_body, 2, (config, precision, samples, patches), backend="gloo", threads=1,
                  timeout_s=3000)
    result = {"model": f"qwen2_5_vl {width} text width, 2 text layers, 8 ViT blocks",
              "parameters": counts.vision + counts.text, "layout": "collocated SP2/TP2",
              "precision": precision, "samples": samples, "patches_per_image": patches,
              "machine": "2-core CPU, gloo, shared", "ranks": ranks}
    os.makedirs(out_dir, exist_ok=True)
    name = f"real-width-step-{width}-{precision}-cpu2-{datetime.date.today().isoformat()}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", default="7b", choices=["7b"])
    p.add_argument("--precision", default="bf16")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--patches", type=int, default=256)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    r = run(a.width, a.precision, a.samples, a.patches, a.out)
    for k in r["ranks"]:
        print(f"rank {k['rank']}: peak RSS {k['peak_rss'] / GIB:.2f} GiB; held "
              f"{k['held']['total'] / GIB:.2f} GiB (plan {k['planned']['total'] / GIB:.2f} GiB); "
              f"loss {k['loss']:.4f}; build {k['build_s']:.0f} s, step {k['step_s']:.0f} s")


if __name__ == "__main__":
    main()
