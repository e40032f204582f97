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

Before/after a change to the data code (#15): ``--ab OLD_TREE`` times the reader (a 100k-line
JSONL) and the one-process loader (`StepLoader.next` over `StepSampler`: processing included)
of this tree and of ``OLD_TREE``'s ``ray_dhp/data`` (e.g. ``git archive 82c2878 | tar -x -C
/tmp/old``), loaded side by side in one process and alternated within each round.

    python -m benchmarks.data_pipeline --ab /tmp/old [--rounds 6]
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
    from ray_dhp.config.train_loop import TrainLoopConfig

    cfg = TrainLoopConfig(global_batch_size=batch, num_steps=1000, seed=seed)
    return StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path), cfg.sampler_config()), cfg


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
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    topo = Topology.build(**LAYOUTS[world])
    groups = build_groups(topo, torch.device("cpu"))
    cfg = _sampler(path, batch)[1]
    engine = DHPEngine(demo.tiny_model_config(), groups, cfg.step_config())
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


def _old_modules(old_tree: str) -> dict:
    """The data modules of ``old_tree`` loaded beside this tree's (as ``_old_<name>``); they
    share this tree's unchanged helpers (budget, collate). The old sampler gets the old tree's
    mixture (the single-dataset order changed since): ``ray_dhp.data.mixture`` points at it
    while the old sampler is imported."""
    import importlib.util
    import sys

    importlib.import_module("ray_dhp.data.mixture")  # this tree's: restored after the old sampler
    mods = {}
    for name in ("reading", "processing", "mixture", "sampler", "loader"):
        path = os.path.join(old_tree, "ray_dhp", "data", f"{name}.py")
        if name == "mixture" and not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location(f"_old_{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]  # dataclasses look their module up there
        here = sys.modules["ray_dhp.data.mixture"]
        if name == "sampler" and "mixture" in mods:
            sys.modules["ray_dhp.data.mixture"] = mods["mixture"]
        try:
            spec.loader.exec_module(mods[name])
        finally:
            sys.modules["ray_dhp.data.mixture"] = here
    mods["processing"].Record = mods["reading"].Record  # records of the old reader
    return mods


def _contenders(old_tree: str) -> dict:
    from ray_dhp import demo
    from ray_dhp.data import loader, reading, sampler

    proc = demo.tiny_processor()
    old = _old_modules(old_tree)
    old_proc = old["processing"].VLProcessor(proc.tokenizer, proc.image_processor)
    return {"before": (old["reading"], old["sampler"], old["loader"], old_proc),
            "after": (reading, sampler, loader, proc)}


def ab_compare(old_tree: str, rounds: int, steps: int) -> dict:
    """Reader and one-process loader throughput of this tree's data code vs ``old_tree``'s, in
    one process, alternating before/after within each round (pairs close in time, so a busy
    machine slows both alike); ratios are medians over rounds of the paired ratios."""
    from ray_dhp import demo
    from ray_dhp.config.train_loop import TrainLoopConfig

    versions = _contenders(old_tree)
    times = {v: {"reader": [], "loader": []} for v in versions}
    with tempfile.TemporaryDirectory() as root:
        path = str(demo.make_dataset(os.path.join(root, "d"), num_samples=256))
        lines = open(path, "rb").read().splitlines()
        big = os.path.join(root, "big.jsonl")
        with open(big, "wb") as f:
            f.write(b"\n".join(lines[i % len(lines)] for i in range(100_000)) + b"\n")
        cfg = TrainLoopConfig(global_batch_size=8, num_steps=1000)
        for r in range(rounds + 1):  # round 0: warm-up, not counted
            for v in (["before", "after"] if r % 2 else ["after", "before"]):
                reading, sampler, loader, proc = versions[v]
                t = time.perf_counter()
                records = reading.read_annotations(big)
                t_read = time.perf_counter() - t
                small = reading.read_annotations(path)
                ld = loader.StepLoader(sampler.StepSampler(small, proc, os.path.dirname(path), cfg.sampler_config()),
                                       prefetch=False)
                t = time.perf_counter()
                n = sum(len(mb) for _ in range(steps) for mb in ld.next())
                t_load = time.perf_counter() - t
                if r:
                    times[v]["reader"].append(len(records) / t_read)
                    times[v]["loader"].append(n / t_load)
    med = {v: {f"{k}_per_s": round(statistics.median(x), 1) for k, x in t.items()}
           for v, t in times.items()}
    ratio = {f"{k}_after_over_before": round(statistics.median(
        a / b for a, b in zip(times["after"][k], times["before"][k])), 3) for k in ("reader", "loader")}
    return {"rounds": rounds, "steps_per_round": steps, "batch": 8, "reader_lines": 100_000,
            "old_tree": old_tree, "median": med, **ratio, "per_round": times}


def main(argv=None):
    from benchmarks.launcher import spawn

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ab", metavar="OLD_TREE", help="before/after throughput vs an older tree")
    a = p.parse_args(argv)
    if a.ab:
        out = {"date": datetime.date.today().isoformat(), "hardware": f"cpu{os.cpu_count()}",
               **ab_compare(a.ab, a.rounds, 4 * a.steps)}
        os.makedirs(RESULTS, exist_ok=True)
        name = f"data-pipeline-ab-cpu{os.cpu_count()}-{out['date']}.json"
        with open(os.path.join(RESULTS, name), "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps({k: v for k, v in out.items() if k != "per_round"}, indent=2))
        return out
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
