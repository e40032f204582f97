"""Data pipeline throughput, decode-once across ranks, and whether it keeps the step fed (#4).

On the demo captioning set (PNG decode + resize + patchify + chat template + tokenisation +
label masking), in one run:
* samples/s of the pipeline alone on one process (`StepSampler.next_step`);
* records processed per rank per step by `StepLoader` vs the global batch (what every rank used
  to process), on 1 rank (the data thread has a core of its own on a 2-core machine) and on the
  2-rank demo layout SP=2 / TP=2 (both cores busy with training);
* the tiny-model step on each layout fed pre-made tensors vs `StepLoader` without prefetch vs
  with prefetch (decoding in the loader thread) vs with prefetch and 1 decoding process per rank
  (``data_workers=1``), in rounds of blocks (order rotated each round) on the same steps, so
  machine noise and the data hit all four alike.

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


LAYOUTS = {
    1: dict(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1),
    2: dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2),
}


def _body(rank, world, path, batch, steps, rounds):
    import torch

    from ray_dhp import demo
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.engine import DHPEngine
    from ray_dhp.mesh import build_groups
    from ray_dhp.topology import Topology

    topo = Topology.build(**LAYOUTS[world])
    groups = build_groups(topo, torch.device("cpu"))
    cfg = _sampler(path, batch)[1]
    engine = DHPEngine(demo.tiny_model_config(), groups, cfg)
    engine.step(StepLoader(_sampler(path, batch, seed=99)[0], groups, prefetch=False).next())  # warm-up
    times = {"premade": [], "loader": [], "loader_prefetch": [], "loader_prefetch_1_worker": []}
    waits = {k: [] for k in times}
    processed = []
    for r in range(rounds):
        # every contender of a round trains on the same steps (same seed): only the feeding differs
        made = StepLoader(_sampler(path, batch, seed=r)[0], groups, prefetch=False)
        premade = [made.next() for _ in range(steps)]
        names = list(times)
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no order bias
            if name == "premade":
                feed = iter(premade).__next__
            else:
                workers = 1 if name.endswith("worker") else 0
                loader = StepLoader(_sampler(path, batch, seed=r)[0], groups, prefetch=name != "loader",
                                    num_workers=workers)
                if workers:  # start the worker process outside the timing
                    loader._workers().submit(int, 0).result()  # noqa: SLF001
                loader.start(steps)
                feed = loader.next
            torch.distributed.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                b = feed()
                t1 = time.perf_counter()
                engine.step(b)
                times[name].append(time.perf_counter() - t0)
                waits[name].append(t1 - t0)
            if name != "premade":
                processed.append(loader.processed_here / steps)
                loader.close()
    return {**{f"step_s_{k}": statistics.median(v) for k, v in times.items()},
            **{f"data_wait_s_{k}": statistics.median(v) for k, v in waits.items() if k != "premade"},
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
        runs = {n: spawn(_body, n, (path, a.batch, a.steps, a.rounds)) for n in (1, 2)}
    date = datetime.date.today().isoformat()
    out = {"dataset": "demo captioning (56-112 px PNG)", "hardware": f"cpu{os.cpu_count()}",
           "date": date, "global_batch": a.batch,
           "pipeline_samples_per_s_one_process": round(alone, 1), "layouts": {}}
    for n, ranks in runs.items():
        r = {k: statistics.mean(x[k] for x in ranks) for k in ranks[0]}
        out["layouts"][f"{n} rank(s), " + ("SP=2 / TP=2" if n == 2 else "no parallelism")] = {
            **{k: round(v, 4) for k, v in r.items() if k.startswith(("step_s", "data_wait_s"))},
            "records_processed_per_rank_per_step": [x["records_processed_per_step"] for x in ranks],
            "fed_over_premade_no_prefetch": round(r["step_s_loader"] / r["step_s_premade"], 3),
            "fed_over_premade_prefetch": round(r["step_s_loader_prefetch"] / r["step_s_premade"], 3),
            "fed_over_premade_prefetch_1_worker": round(r["step_s_loader_prefetch_1_worker"]
                                                        / r["step_s_premade"], 3),
        }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"data-pipeline-tiny-cpu{os.cpu_count()}-{date}.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
