"""Balanced work for mixed-resolution data (issue #18): cost-balanced vs equal-count split.

Vision DP=2 x SP=2 / text TP=2 x DP=2, collocated on 4 gloo ranks, model shape ``vitheavy``
(`shapes.py`). Every step holds 12 samples in a seeded random order: 1 document (1024 patches),
3 charts (256), 4 photos (64) — 16x between the largest and smallest — and 4 text-only samples
(256 text tokens). Three contenders train on them, interleaved step by step in rotating order
(so machine noise hits all alike), each in its own `DHPEngine` (same seed, same initial weights):

* ``count``  — today's split: contiguous equal-count ranges per replica (``balance: count``);
* ``cost``   — the cost-balanced plan (``balance: cost``, `ray_dhp.parallel.balance`);
* ``equal``  — the same number of samples and patches with equal sizes (8 images of 256 patches
  + the same 4 text-only samples): the well-balanced case the mixed set should come close to.

Measured per step and rank: wall time, and per phase the **thread CPU time** (`time.thread_time`;
torch runs single-threaded here, so it is the rank's own compute, not time waiting for other
ranks or for a core). Derived:

* ``busy`` per replica: vision replica = mean over its SP ranks of vision forward + backward CPU;
  text replica = mean over its TP ranks of text forward + backward CPU; imbalance = max / mean;
* ``modelled step``: the step as a dedicated core per rank would run it — the phases are
  separated by synchronisation (boundary hand-off, gradient all-reduce), so it is the sum over
  phases of the slowest rank's CPU time in that phase;
* ``parallel efficiency``: all ranks' CPU work / (ranks x modelled step) — 1 when no rank waits;
  unlike step times it does not reward a set for simply having less work;
* the cost model's own imbalance (max / mean replica cost) for both plans.

On a shared 2-core machine four ranks time-share the cores, so wall step times mostly measure
the *total* work (which balancing does not change); the modelled step and the busy imbalance
show what a machine with one core (or one GPU) per rank gets.

    python -m benchmarks.balance [--steps 6] [--rounds 2] [--text-only-tokens 256] [--out ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time

import torch

from benchmarks.launcher import spawn
from benchmarks.shapes import make_sample, model_config

RESULTS = os.path.join(os.path.dirname(__file__), "results")
LAYOUT = dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
MIX = [1024] + [256] * 3 + [64] * 4 + [0] * 4     # patches per sample (0: text-only)
EQUAL = [256] * 8 + [0] * 4                        # same count and total patches, equal sizes
TEXT_ONLY_TOKENS = 256
PHASES = ("vision_fwd", "send_features", "text_fwd_bwd", "return_grads", "optimizer")


def text_sample(index: int, config, tokens: int = TEXT_ONLY_TOKENS, seed: int = 0):
    """A text-only synthetic `Sample` of ``tokens`` tokens, the second half trained."""
    from ray_dhp.data.processing import Sample

    g = torch.Generator().manual_seed(seed * 100_003 + index + 7)
    ids = torch.randint(10, config.text_config.vocab_size, (tokens,), generator=g)
    labels = torch.full_like(ids, -100)
    labels[tokens // 2:] = ids[tokens // 2:]
    return Sample(index=index, input_ids=ids, labels=labels, mm_token_type_ids=torch.zeros_like(ids))


def make_step(sizes: list, config, seed: int, text_tokens: int = TEXT_ONLY_TOKENS) -> list:
    """One step's samples (one micro-batch) of the given patch counts, in a seeded random order."""
    order = list(sizes)
    random.Random(seed).shuffle(order)
    return [text_sample(i, config, text_tokens, seed=seed) if p == 0 else make_sample(i, p, config, seed)
            for i, p in enumerate(order)]


def model_imbalance(steps: list, config) -> dict:
    """The cost model's max/mean replica cost of both plans (vision; text replicas pad their
    samples to the longest, so a text replica costs samples x cost(longest)), per step."""
    from ray_dhp.parallel.balance import Balancer, imbalance

    ref = Balancer.for_config("cost", config)

    def padded(samples, parts):
        loads = [len(p) * ref.model.text(max(samples[i].num_tokens for i in p)) for p in parts]
        return max(loads) / (sum(loads) / len(loads))

    out = {}
    for mode in ("count", "cost"):
        bal = Balancer.for_config(mode, config)
        v = [imbalance(ref.vision_costs(s), bal.vision_replicas(s, 2)) for s in steps]
        t = [padded(s, bal.text_replicas(s, 2)) for s in steps]
        out[mode] = {"vision": v, "text": t}
    return out


class _CpuTimer:
    """A `ray_dhp.engine.PhaseTimer` that also sums each phase's thread CPU time."""

    def __init__(self):
        import contextlib

        self.totals, self.cpu = {}, {}

        @contextlib.contextmanager
        def call(phase):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                yield
            finally:
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - w0
                self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - c0
        self._call = call

    def __call__(self, phase):
        return self._call(phase)

    def as_metrics(self) -> dict:
        return {**{f"time_{k}_s": v for k, v in self.totals.items()},
                **{f"cpu_{k}_s": v for k, v in self.cpu.items()}}


def _body(rank, world, steps_n, rounds, seed, text_tokens):
    import ray_dhp.engine as eng
    from ray_dhp.engine import DHPEngine
    from ray_dhp.mesh import build_groups
    from ray_dhp.topology import Topology
    from ray_dhp.train_config import TrainLoopConfig

    eng.PhaseTimer = _CpuTimer  # benchmark-only: CPU time per phase as well as wall time
    config = model_config("vitheavy")
    groups = build_groups(Topology.build(**LAYOUT), torch.device("cpu"))
    base = dict(lr=1e-5, global_batch_size=len(MIX), micro_batches=1, num_steps=1, seed=seed)
    engines = {name: DHPEngine(config, groups, TrainLoopConfig(**base, balance=mode))
               for name, mode in (("count", "count"), ("cost", "cost"), ("equal", "cost"))}
    mixed = [make_step(MIX, config, seed + k, text_tokens) for k in range(steps_n)]
    equal = [make_step(EQUAL, config, seed + k, text_tokens) for k in range(steps_n)]
    for name, e in engines.items():  # warm-up
        e.step([(equal if name == "equal" else mixed)[0]])
    names, out = list(engines), {n: [] for n in engines}
    for r in range(rounds):
        for k in range(steps_n):
            rot = (r * steps_n + k) % len(names)
            for name in names[rot:] + names[:rot]:
                torch.distributed.barrier()
                t0 = time.perf_counter()
                m = engines[name].step([(equal if name == "equal" else mixed)[k]])
                m["wall_s"] = time.perf_counter() - t0
                m["step"] = k
                out[name].append({key: v for key, v in m.items()
                                  if key.startswith(("time_", "cpu_")) or key in ("wall_s", "step", "loss")})
    return {"rank": rank, "vision": groups.vision_coord, "text": groups.text_coord, "steps": out}


def summarise(per_rank: list) -> dict:
    """Per contender: median wall step (slowest rank), modelled step, busy time per replica."""
    out = {}
    for name in per_rank[0]["steps"]:
        walls, modelled, v_imb, t_imb, v_busy, t_busy, work = [], [], [], [], [], [], []
        for i in range(len(per_rank[0]["steps"][name])):
            ms = [r["steps"][name][i] for r in per_rank]
            walls.append(max(m["wall_s"] for m in ms))
            modelled.append(sum(max(m.get(f"cpu_{p}_s", 0.0) for m in ms) for p in PHASES))
            work.append(sum(m.get(f"cpu_{p}_s", 0.0) for m in ms for p in PHASES))
            vb = {}
            tb = {}
            for r, m in zip(per_rank, ms):
                v = m.get("cpu_vision_fwd_s", 0.0) + m.get("cpu_vision_bwd_s", 0.0)
                vb.setdefault(r["vision"][0], []).append(v)
                tb.setdefault(r["text"][0], []).append(m.get("cpu_text_fwd_bwd_s", 0.0))
            vr = [statistics.mean(x) for _, x in sorted(vb.items())]
            tr = [statistics.mean(x) for _, x in sorted(tb.items())]
            v_busy.append(vr)
            t_busy.append(tr)
            v_imb.append(max(vr) / statistics.mean(vr))
            t_imb.append(max(tr) / statistics.mean(tr))
        out[name] = {
            "wall_step_s_median": statistics.median(walls),
            "modelled_step_s_median": statistics.median(modelled),
            "modelled_step_s_mean": statistics.mean(modelled),
            "total_cpu_s_mean": statistics.mean(work),  # all ranks' work
            # the share of the ranks' time spent working in the modelled step (1 = no waiting)
            "parallel_efficiency": statistics.mean(w / (len(per_rank) * m) for w, m in zip(work, modelled)),
            "vision_busy_imbalance_mean": statistics.mean(v_imb),
            "text_busy_imbalance_mean": statistics.mean(t_imb),
            "vision_busy_s_per_replica_mean": [statistics.mean(c) for c in zip(*v_busy)],
            "text_busy_s_per_replica_mean": [statistics.mean(c) for c in zip(*t_busy)],
            "wall_s": walls, "modelled_s": modelled,
            "vision_busy_s_per_replica": v_busy, "text_busy_s_per_replica": t_busy,
        }
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    names = list(s)
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    ax[0].bar(names, [s[n]["modelled_step_s_median"] for n in names], label="modelled (1 core/rank)")
    ax[0].plot(names, [s[n]["wall_step_s_median"] for n in names], "ko", label="wall (shared 2 cores)")
    ax[0].set_ylabel("step time (s, median)")
    ax[0].legend()
    for j, side in enumerate(("vision", "text")):
        width = 0.35
        for rep in range(2):
            ax[1 + j].bar([i + (rep - 0.5) * width for i in range(len(names))],
                          [s[n][f"{side}_busy_s_per_replica_mean"][rep] for n in names], width,
                          label=f"{side} replica {rep}")
        ax[1 + j].set_xticks(range(len(names)), names)
        ax[1 + j].set_ylabel("busy CPU s per step (mean)")
        ax[1 + j].set_title(f"{side} replicas")
        ax[1 + j].legend()
    fig.suptitle(f"mixed resolutions (1x1024 + 3x256 + 4x64 patches + 4 text-only of "
                 f"{result['text_only_tokens']} tokens), vision DP2xSP2 / text TP2xDP2, 4 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="distinct mixed steps (random orders)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-only-tokens", type=int, default=TEXT_ONLY_TOKENS,
                   help="length of the text-only samples")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    config = model_config("vitheavy")
    steps = [make_step(MIX, config, args.seed + k, args.text_only_tokens) for k in range(args.steps)]
    imb = model_imbalance(steps, config)
    t0 = time.perf_counter()
    per_rank = spawn(_body, 4, (args.steps, args.rounds, args.seed, args.text_only_tokens),
                     threads=1)
    summary = summarise(per_rank)
    s = summary
    result = {
        "benchmark": "balance", "layout": LAYOUT, "shape": "vitheavy", "mix_patches": MIX,
        "equal_patches": EQUAL, "text_only_tokens": args.text_only_tokens, "steps": args.steps,
        "rounds": args.rounds, "seed": args.seed, "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores, shared with other jobs (load average "
                   f"{os.getloadavg()[0]:.1f} at the end); 4 ranks, 1 torch thread each",
        "model_imbalance": {m: {k: statistics.mean(v) for k, v in d.items()} for m, d in imb.items()},
        "model_imbalance_per_step": imb,
        "summary": summary,
        "speedup_cost_vs_count": {
            "modelled": s["count"]["modelled_step_s_median"] / s["cost"]["modelled_step_s_median"],
            "wall": s["count"]["wall_step_s_median"] / s["cost"]["wall_step_s_median"]},
        "cost_vs_equal_sizes": {
            "modelled": s["equal"]["modelled_step_s_median"] / s["cost"]["modelled_step_s_median"],
            "wall": s["equal"]["wall_step_s_median"] / s["cost"]["wall_step_s_median"]},
        "elapsed_s": time.perf_counter() - t0,
    }
    os.makedirs(args.out, exist_ok=True)
    tag = "" if args.text_only_tokens == TEXT_ONLY_TOKENS else f"-text{args.text_only_tokens}"
    stem = os.path.join(args.out, f"balance-vitheavy{tag}-cpu{os.cpu_count()}-{result['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    print(json.dumps({k: result[k] for k in ("model_imbalance", "speedup_cost_vs_count",
                                             "cost_vs_equal_sizes")}, indent=1))
    for n, v in s.items():
        print(n, {k: v[k] for k in v if not isinstance(v[k], list) or k.endswith("_mean")})
    return result


if __name__ == "__main__":
    main()
