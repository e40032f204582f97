"""Disjoint placement: sequential vs pipelined micro-batch schedule vs collocated (issue #8).

Same model shape (``vitheavy``), data and total workers (2). The two disjoint schedules run in the
same processes, alternating step by step (so machine noise hits both alike); collocated
(SP=2 / TP=2 on the same 2 workers) runs in its own spawn. Per contender: median step time, and
per group the idle fraction = time blocked in the boundary exchanges / step time (for vision
ranks the boundary phases minus the vision backward that runs inside ``return_grads``).

    python -m benchmarks.schedules [--patches 1024] [--steps 6]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch

from benchmarks.launcher import spawn
from benchmarks.shapes import make_batch, model_config

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _idle(m: dict, vision: bool) -> float:
    wait = m.get("time_send_features_s", 0.0) + m.get("time_return_grads_s", 0.0)
    if vision:
        wait -= m.get("time_vision_bwd_s", 0.0)
    return wait


def _body(rank, world, layout, schedules, steps, patches, micro, shape):
    import time

    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    config = model_config(shape)
    cfg = TrainLoopConfig(lr=1e-4, global_batch_size=2 * micro, micro_batches=micro, num_steps=steps)
    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(config, groups, cfg.step_config())
    batch = make_batch(cfg.optim.global_batch_size, patches, config)
    mbs = [batch[k:k + cfg.micro_batch_size()] for k in range(0, len(batch), cfg.micro_batch_size())]
    out = {s: [] for s in schedules}
    for i in range(steps + 1):  # first round is warm-up
        for s in schedules:
            engine.schedule = s
            torch.distributed.barrier()
            t0 = time.perf_counter()
            m = engine.step(mbs)
            m["step_s"] = time.perf_counter() - t0
            if i > 0:
                out[s].append(m)
    return {"roles": groups.topology.roles(rank), "runs": out}


def _summarise(per_rank: list) -> dict:
    res = {}
    for sched in per_rank[0]["runs"]:
        step = statistics.median(m["step_s"] for m in per_rank[0]["runs"][sched])
        idle = {}
        for r in per_rank:
            role = "+".join(r["roles"])
            vals = [_idle(m, "vision" in r["roles"] and "text" not in r["roles"]) / m["step_s"]
                    for m in r["runs"][sched]]
            idle[role] = round(statistics.median(vals), 3)
        res[sched] = {"step_s": step, "idle_fraction": idle}
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--patches", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--shape", default="vitheavy")
    a = p.parse_args(argv)
    disjoint = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
    colloc = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    args = (a.steps, a.patches, a.micro_batches, a.shape)
    d = _summarise(spawn(_body, 2, (disjoint, ["sequential", "pipelined"]) + args))
    c = _summarise(spawn(_body, 2, (colloc, ["sequential"]) + args))
    rows = {"disjoint 1v+1t sequential": d["sequential"], "disjoint 1v+1t pipelined": d["pipelined"],
            "collocated sp2/tp2": c["sequential"]}
    speedup = d["sequential"]["step_s"] / d["pipelined"]["step_s"]
    date = datetime.date.today().isoformat()
    result = {"shape": a.shape, "hardware": f"cpu{os.cpu_count()}", "date": date,
              "patches_per_image": a.patches, "micro_batches": a.micro_batches,
              "global_batch": 2 * a.micro_batches, "rows": rows,
              "pipelined_speedup_over_sequential": round(speedup, 3)}
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"schedules-{a.shape}-cpu{os.cpu_count()}-{date}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    _plot(rows, stem + ".png", a.shape, a.patches, a.micro_batches)
    print(json.dumps(result, indent=2))
    return result


def _plot(rows: dict, path: str, shape: str, patches: int, micro: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(names, [rows[n]["step_s"] for n in names], color=["#999", "#3a7", "#37a"])
    ax.set_xlabel("median step time (s), 2 workers")
    ax.set_title(f"Micro-batch schedules ({shape}, {patches} patches, {micro} micro-batches, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
