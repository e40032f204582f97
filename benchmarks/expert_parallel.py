"""Expert parallelism vs experts replicated (plain DP) vs experts sharded by TP, same model, same ranks.

A tiny ``qwen3_vl_moe`` widened in the experts (``--experts`` experts of intermediate
``--moe-intermediate``, top-2), collocated on ``--ranks`` ranks (vision DP = ranks). Contenders:

* ``replicated (ep=1)``: text DP = ranks, every rank holds and steps all experts, expert
  gradients all-reduced over all ranks;
* ``expert parallel (ep=ranks)``: text DP = ranks, the experts partitioned over them
  (`ray_dhp.parallel.expert`: token all-to-alls, expert gradients reduced over EDP = 1);
* ``tp=ranks, experts replicated``: text TP = ranks (attention, dense parts sharded), the sparse
  blocks replicated on every TP rank (the family's default under TP);
* ``tp=ranks, experts tp-sharded``: the same, each expert's intermediate dim sharded over the TP
  ranks like a dense MLP (`text.expert_tensor_parallel`, `ray_dhp.parallel.expert_tp`: one
  all-gather of the gate/up activations and two all-reduces per sparse layer).

All engines are built in one world from the same seed and stepped **interleaved** on the same
micro-batches (one warm-up step each, then ``--steps`` timed steps in rotating order, a barrier
before each; step time = slowest rank, medians). Reported per contender: step time, bytes each
rank sends per step by collective (`ray_dhp.parallel.comm.CommCounter`), model-state bytes and
the experts' bytes measured from the rank's tensors next to `ray_dhp.planning.memory.rank_state`
(the ``ray-dhp plan`` figure), and the first step's loss (equal up to summation order).

Run: ``python -m benchmarks.expert_parallel [--ranks 4] [--steps 4]``; writes
``benchmarks/results/expert-parallel-<hw>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _config(opts: dict):
    from ray_dhp import demo

    config = demo.tiny_model_config("qwen3_vl_moe")
    tc = config.text_config
    tc.num_experts, tc.moe_intermediate_size = opts["experts"], opts["moe_intermediate"]
    return config


def body(rank, world, opts: dict):
    import torch
    import torch.distributed as dist

    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp import demo
    from ray_dhp.parallel.comm import CommCounter
    from ray_dhp.parallel.expert import expert_params
    from ray_dhp.parallel.tensor import local
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.step.precision import policy_of
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    config = _config(opts)
    cfg = TrainLoopConfig(lr=1e-4, global_batch_size=2 * world, micro_batches=1,
                          num_steps=opts["steps"] + 1)
    path = demo.make_dataset(os.path.join(opts["tmp"], "data"), num_samples=4 * world, seed=0)
    sampler = StepSampler(read_annotations(path), demo.tiny_processor("qwen3_vl_moe"),
                          resolve_data_root(path), cfg.sampler_config())
    steps = [sampler.next_step() for _ in range(cfg.optim.num_steps)]
    names = {"replicated (ep=1)": dict(text_dp=world, text_tp=1),
             f"expert parallel (ep={world})": dict(text_dp=world, text_tp=1, text_ep=world),
             f"tp={world}, experts replicated": dict(text_dp=1, text_tp=world),
             f"tp={world}, experts tp-sharded": dict(text_dp=1, text_tp=world, text_expert_tp=True)}
    engines, comms, topos = {}, {}, {}
    for name, layout in names.items():
        topos[name] = Topology.build(placement="collocated", vision_dp=world, vision_sp=1, **layout)
        comms[name] = CommCounter()
        engines[name] = DHPEngine(config, build_groups(topos[name], torch.device("cpu")), cfg.step_config(),
                                  comm=comms[name])
    out = {n: {"times": []} for n in names}
    for name, e in engines.items():  # warm-up step, counted traffic
        comms[name].reset()
        out[name]["first_loss"] = e.step(steps[0])["loss"]
        out[name]["comm"] = comms[name].as_dict()
    for k in range(opts["steps"]):
        order = list(engines)[k % len(engines):] + list(engines)[:k % len(engines)]
        for name in order:
            dist.barrier()
            t = time.perf_counter()
            engines[name].step(steps[1 + k])
            dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            out[name]["times"].append(float(dt))
    counts = count_params(config)
    no_experts = _without_experts(counts)
    for name, e in engines.items():
        want = rank_state(counts, topos[name], rank, policy_of(cfg.precision))
        out[name]["state_measured"] = e.state_bytes()["total"]
        out[name]["state_plan"] = want.total
        out[name]["expert_bytes_measured"] = sum(local(p).numel() * local(p).element_size()
                                                 for p in expert_params(e.text_model, e.family.moe))
        out[name]["expert_bytes_plan"] = want.weights - rank_state(no_experts, topos[name], rank,
                                                                   policy_of(cfg.precision)).weights
    return out


def _without_experts(counts):
    """``counts`` minus the experts' tensors (the plan's expert weight bytes: the difference)."""
    import dataclasses

    experts = [q for q in counts.text_sizes if q.expert]
    return dataclasses.replace(
        counts, text=counts.text - sum(q.numel for q in experts),
        text_sharded=counts.text_sharded - sum(q.numel for q in experts if q.sharded),
        text_sizes=tuple(q for q in counts.text_sizes if not q.expert))


def main(argv=None) -> None:
    import tempfile

    from ray_dhp.train.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    opts = {"steps": a.steps, "experts": a.experts, "moe_intermediate": a.moe_intermediate,
            "tmp": tempfile.mkdtemp()}
    per_rank = spawn(body, a.ranks, (opts,))
    rows = []
    for name in per_rank[0]:
        sent = [sum(v["bytes"] for v in r[name]["comm"].values()) for r in per_rank]
        rows.append({"contender": name, "median_step_s": statistics.median(per_rank[0][name]["times"]),
                     "bytes_sent_per_rank_max": max(sent),
                     "bytes_by_collective_rank0": per_rank[0][name]["comm"],
                     "state_measured_max": max(r[name]["state_measured"] for r in per_rank),
                     "state_plan_max": max(r[name]["state_plan"] for r in per_rank),
                     "measured_equals_plan": all(r[name]["state_measured"] == r[name]["state_plan"]
                                                 for r in per_rank),
                     "expert_bytes_measured_max": max(r[name]["expert_bytes_measured"] for r in per_rank),
                     "expert_bytes_plan_max": max(r[name]["expert_bytes_plan"] for r in per_rank),
                     "expert_bytes_measured_equals_plan": all(
                         r[name]["expert_bytes_measured"] == r[name]["expert_bytes_plan"] for r in per_rank),
                     "first_loss": per_rank[0][name]["first_loss"]})
    stem = f"expert-parallel-cpu{os.cpu_count()}-{datetime.date.today().isoformat()}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, stem + ".json"), "w") as f:
        json.dump({"ranks": a.ranks, "experts": a.experts, "moe_intermediate": a.moe_intermediate,
                   "steps": a.steps, "rows": rows}, f, indent=1)
    _plot(rows, os.path.join(a.out, stem + ".png"))
    for r in rows:
        print(f"{r['contender']:<30} step {r['median_step_s']:.3f} s  sent {r['bytes_sent_per_rank_max'] / 2**20:.2f} MiB"
              f"  state {r['state_measured_max'] / 2**20:.2f} MiB (plan {r['state_plan_max'] / 2**20:.2f})"
              f"  experts {r['expert_bytes_measured_max'] / 2**20:.2f} MiB (plan {r['expert_bytes_plan_max'] / 2**20:.2f})"
              f"  loss {r['first_loss']:.6f}")


def _plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    names = [r["contender"].replace(", ", "\n") for r in rows]
    for ax, key, label in zip(axes, ("median_step_s", "bytes_sent_per_rank_max", "state_measured_max",
                                     "expert_bytes_measured_max"),
                              ("step time (s, median)", "bytes sent / rank / step",
                               "model state / rank (B)", "expert weights / rank (B)")):
        ax.bar(names, [r[key] for r in rows],
               color=["tab:gray", "tab:blue", "tab:olive", "tab:orange"][:len(rows)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
