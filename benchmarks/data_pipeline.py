"""Data pipeline throughput, decode-once across ranks, and whether it keeps the step fed (#4).

On the demo captioning set (PNG decode + resize + patchify + chat template + tokenisation +
label masking), in one run:
* samples/s of the pipeline alone on one process (`StepSampler.next_step`);
* records processed per rank per step by `StepLoader` on the 2-rank demo layout (SP=2 / TP=2)
  vs the global batch (what every rank used to process);
* the tiny-model step on that layout fed pre-made tensors vs `StepLoader` without prefetch vs
  with prefetch, in rounds of blocks (A B C A B C ...) so machine noise hits all three alike.

    python -m benchmarks.data_pipeline [--steps 8] [--rounds 3]
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


def _sampler(path, batch, seed=0):
    from ray_dhp import demo
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.train_config import TrainLoopConfig

    cfg = TrainLoopConfig(global_batch_size=batch, num_steps=1000, seed=seed)
    return StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path), cfg), cfg


def _pipeline_alone(path, batch, steps):
    sampler, _ = _sampler(path, batch)
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        n += sum(len(mb) for mb in sampler.next_step())
    return n / (time.perf_counter() - t0)


def _body(rank, world, path, batch, steps, rounds):
    import torch

    from ray_dhp import demo
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.engine import DHPEngine
    from ray_dhp.mesh import build_groups
    from ray_dhp.topology import Topology

    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    groups = build_groups(topo, torch.device("cpu"))
    sampler, cfg = _sampler(path, batch)
    engine = DHPEngine(demo.tiny_model_config(), groups, cfg)
    premade = StepLoader(_sampler(path, batch, seed=1)[0], groups, prefetch=False).next()
    engine.step(premade)  # warm-up
    times = {"premade": [], "loader": [], "loader_prefetch": []}
    processed = []
    for _ in range(rounds):
        for name in times:
            if name == "premade":
                feed = lambda: premade  # noqa: E731
            else:
                loader = StepLoader(sampler, groups, prefetch=name == "loader_prefetch")
                loader.start(steps)
                feed = loader.next
            torch.distributed.barrier()
            for _ in range(steps):
                t = time.perf_counter()
                engine.step(feed())
                times[name].append(time.perf_counter() - t)
            if name != "premade":
                processed.append(loader.processed_here / steps)
    return {**{f"step_s_{k}": statistics.median(v) for k, v in times.items()},
            "records_processed_per_step": statistics.mean(processed)}


def main(argv=None):
    from benchmarks.launcher import spawn

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    from ray_dhp import demo

    with tempfile.TemporaryDirectory() as root:
        path = str(demo.make_dataset(root, num_samples=256))
        alone = _pipeline_alone(path, a.batch, 2 * a.steps)
        ranks = spawn(_body, 2, (path, a.batch, a.steps, a.rounds))
    r = {k: statistics.mean(x[k] for x in ranks) for k in ranks[0]}
    r["records_processed_per_rank_per_step"] = [x["records_processed_per_step"] for x in ranks]
    del r["records_processed_per_step"]
    date = datetime.date.today().isoformat()
    out = {"dataset": "demo captioning (56-112 px PNG)", "hardware": f"cpu{os.cpu_count()}",
           "date": date, "global_batch": a.batch, "layout": "collocated SP=2 / TP=2, 2 ranks",
           "pipeline_samples_per_s_one_process": round(alone, 1),
           **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
           "fed_over_premade_no_prefetch": round(r["step_s_loader"] / r["step_s_premade"], 3),
           "fed_over_premade_prefetch": round(r["step_s_loader_prefetch"] / r["step_s_premade"], 3)}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"data-pipeline-tiny-cpu{os.cpu_count()}-{date}.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
