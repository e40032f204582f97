"""Data pipeline throughput, and whether it keeps the training step fed (issue #4).

Measures, on the demo captioning set (PNG decode + resize + patchify + chat template +
tokenisation + label masking):
* samples/s of the pipeline alone (`StepSampler.next_step`, what every rank runs per step);
* the tiny-model DHP step (1 rank) fed by the pipeline vs fed pre-made tensors, side by side.

    python -m benchmarks.data_pipeline [--steps 10]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _sampler(root, batch, seed=0):
    from ray_dhp import demo
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.train_config import TrainLoopConfig

    path = demo.make_dataset(root, num_samples=256, seed=seed)
    cfg = TrainLoopConfig(global_batch_size=batch, num_steps=1000)
    return StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path), cfg), cfg


def _body(rank, world, root, batch, steps):
    import torch

    from ray_dhp import demo
    from ray_dhp.engine import DHPEngine
    from ray_dhp.mesh import build_groups
    from ray_dhp.topology import Topology

    sampler, cfg = _sampler(root, batch)
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += sum(len(mb) for mb in sampler.next_step())
    pipeline_sps = n / (time.perf_counter() - t0)
    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
    engine = DHPEngine(demo.tiny_model_config(), build_groups(topo, torch.device("cpu")), cfg)
    premade = sampler.next_step()
    engine.step(premade)  # warm-up
    fed, pre = [], []
    for _ in range(steps):  # alternate: machine noise hits both alike
        t = time.perf_counter()
        engine.step(sampler.next_step())
        fed.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.step(premade)
        pre.append(time.perf_counter() - t)
    return {"pipeline_samples_per_s": pipeline_sps, "step_s_real_data": statistics.median(fed),
            "step_s_premade": statistics.median(pre)}


def main(argv=None):
    from benchmarks.launcher import spawn

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        r = spawn(_body, 1, (root, a.batch, a.steps))[0]
    r["data_share_of_step"] = 1 - r["step_s_premade"] / r["step_s_real_data"]
    date = datetime.date.today().isoformat()
    out = {"dataset": "demo captioning (56-112 px PNG)", "hardware": f"cpu{os.cpu_count()}",
           "date": date, "global_batch": a.batch, **{k: round(v, 4) for k, v in r.items()}}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"data-pipeline-tiny-cpu{os.cpu_count()}-{date}.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
