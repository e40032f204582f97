"""Balanced work for mixed-resolution data (issue #18): cost-balanced vs equal-count split.

Vision DP=2 x SP=2 / text TP=2 x DP=2, collocated on 4 gloo ranks, model shape ``vitheavy``
(`shapes.py`). Every step holds 12 samples in a seeded random order: 1 document (1024 patches),
3 charts (256), 4 photos (64) — 16x between the largest and smallest — and 4 text-only samples
(256 or 64 text tokens). Four contenders train on them, interleaved step by step in rotating
order (so machine noise hits all alike), each in its own `DHPEngine` (same seed, same initial
weights):

* ``count``       — today's split: contiguous equal-count ranges per replica (``balance: count``);
* ``cost_1batch`` — balanced by cost, each text replica one batch padded to its longest (the
  plan before padded groups);
* ``cost``        — ``balance: cost``: balanced by cost, each text replica's samples run as
  padded groups (`ray_dhp.parallel.balance.padded_groups`);
* ``equal``       — the same number of samples and patches with equal sizes (8 images of 256
  patches + the same 4 text-only samples), balanced by cost: the case the mix should come close to.

Measured per step and rank: wall time, and per phase the **thread CPU time** (`time.thread_time`;
torch runs single-threaded here, so it is the rank's own compute, not time waiting for other
ranks or for a core). Derived:

* ``busy`` per replica: vision replica = mean over its SP ranks of vision forward + backward CPU;
  text replica = mean over its TP ranks of text forward + backward CPU; imbalance = max / mean;
* ``modelled step``: the step as a dedicated core per rank would run it — the phases are
  separated by synchronisation (boundary hand-off, gradient all-reduce), so it is the sum over
  phases of the slowest rank's CPU time in that phase;
* ``parallel efficiency``: all ranks' CPU work / (ranks x modelled step) — 1 when no rank waits;
* from the plans: the cost model's imbalance (max / mean replica cost), the text tokens run incl.
  padding over the real ones, and the text calls per replica;
* the cost model's fit: measured busy times against the modelled costs (least squares);
* the losses of ``cost`` and ``cost_1batch`` against ``count`` on the same steps (same update).

``--repeats`` independent runs (fresh ranks); the figures are medians over the repeats of each
run's medians over its steps. On a shared 2-core machine four ranks time-share the cores, so wall
step times mostly measure the *total* work; the modelled step and the busy imbalance show what a
machine with one core (or one GPU) per rank gets.

    python -m benchmarks.balance [--steps 4] [--rounds 1] [--repeats 3] [--text-only-tokens 64]
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
    from ray_dhp.data.sample import Sample

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


CONTENDERS = ("count", "cost_1batch", "cost", "equal")


def balancer_of(name: str, config):
    """The contender's `Balancer`: ``count``; ``cost`` (text replicas run as padded groups);
    ``cost_1batch`` — by cost, but one padded batch per text replica (a call cost no split can
    save: the plan before padded groups); ``equal`` balances by cost."""
    import dataclasses

    from ray_dhp.step.microbatch import balancer_for

    if name == "count":
        return balancer_for("count", config)
    bal = balancer_for("cost", config)
    if name == "cost_1batch":
        return dataclasses.replace(bal, model=dataclasses.replace(bal.model, text_call=10 ** 30))
    return bal


def model_imbalance(steps: list, config, names=("count", "cost_1batch", "cost")) -> dict:
    """Per contender and step, from the plans alone: the cost model's max/mean replica cost
    (vision: sum of image costs; text: the replica's padded groups, ``group size x
    cost(longest) + call`` each), the text tokens run incl. padding over the real tokens, and
    the number of text forward/backward calls per replica."""
    from ray_dhp.parallel.balance import imbalance

    ref = balancer_of("cost", config).model
    out = {}
    for name in names:
        bal = balancer_of(name, config)
        v, t, pad, calls = [], [], [], []
        for s in steps:
            v.append(imbalance([ref.vision(x.image_grid_thw) for x in s], bal.vision_replicas(s, 2)))
            groups = [bal.text_groups(s, idx) for idx in bal.text_replicas(s, 2)]
            loads = [sum(len(g) * ref.text(max(s[i].num_tokens for i in g)) + ref.text_call for g in gs)
                     for gs in groups]
            t.append(max(loads) / (sum(loads) / len(loads)))
            run = sum(len(g) * max(s[i].num_tokens for i in g) for gs in groups for g in gs)
            pad.append(run / sum(x.num_tokens for x in s))
            calls.append([len(gs) for gs in groups])
        out[name] = {"vision": v, "text": t, "text_tokens_run_over_real": pad, "text_calls": calls}
    return out


class _CpuTimer:
    """A `ray_dhp.step.engine.PhaseTimer` that also sums each phase's thread CPU time."""

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
    import ray_dhp.step.engine as eng
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    eng.PhaseTimer = _CpuTimer  # benchmark-only: CPU time per phase as well as wall time
    config = model_config("vitheavy")
    groups = build_groups(Topology.build(**LAYOUT), torch.device("cpu"))
    base = dict(lr=1e-5, global_batch_size=len(MIX), micro_batches=1, num_steps=1, seed=seed)
    engines = {}
    for name in CONTENDERS:
        e = DHPEngine(config, groups, TrainLoopConfig(**base, balance="count" if name == "count" else "cost").step_config())
        e._balancer = balancer_of(name, config)  # benchmark-only: the contender's plan
        engines[name] = e
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

    s, reps = result["summary"], result["repeats"]
    names = list(s)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    x = range(len(names))
    ax[0].bar(x, [s[n]["modelled_step_s_median"] for n in names], label="modelled (1 core/rank), median")
    for k, rep in enumerate(result["per_repeat"]):
        ax[0].plot(x, [rep[n]["modelled_step_s_median"] for n in names], "k.",
                   label="each repeat" if k == 0 else None)
    ax[0].set_xticks(x, names)
    ax[0].set_ylabel(f"step time (s): median of {reps} repeats")
    ax[0].legend()
    for j, side in enumerate(("vision", "text")):
        width = 0.35
        for rep in range(2):
            ax[1 + j].bar([i + (rep - 0.5) * width for i in x],
                          [s[n][f"{side}_busy_s_per_replica_mean"][rep] for n in names], width,
                          label=f"{side} replica {rep}")
        ax[1 + j].set_xticks(x, names)
        ax[1 + j].set_ylabel("busy CPU s per step (mean)")
        ax[1 + j].set_title(f"{side} replicas")
        ax[1 + j].legend()
    fig.suptitle(f"mixed resolutions (1x1024 + 3x256 + 4x64 patches + 4 text-only of "
                 f"{result['text_only_tokens']} tokens), vision DP2xSP2 / text TP2xDP2, 4 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def combine(per_repeat: list) -> dict:
    """Per contender, the median over repeats of each repeat's medians and means."""
    out = {}
    for name in per_repeat[0]:
        runs = [r[name] for r in per_repeat]
        out[name] = {k: (statistics.median(r[k] for r in runs) if not isinstance(runs[0][k], list)
                         else [statistics.median(c) for c in zip(*(r[k] for r in runs))])
                     for k in runs[0] if not k.endswith("_s") and not k.endswith("_replica")}
    return out


def ratios(summary: dict, key: str = "modelled_step_s_median") -> dict:
    s = summary
    return {"cost_vs_count": s["count"][key] / s["cost"][key],
            "cost_1batch_vs_count": s["count"][key] / s["cost_1batch"][key],
            "cost_vs_equal_sizes": s["equal"][key] / s["cost"][key],
            "cost_1batch_vs_equal_sizes": s["equal"][key] / s["cost_1batch"][key]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="distinct mixed steps (random orders)")
    p.add_argument("--rounds", type=int, default=1, help="passes over the steps")
    p.add_argument("--repeats", type=int, default=3, help="independent runs (fresh ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-only-tokens", type=int, default=TEXT_ONLY_TOKENS,
                   help="length of the text-only samples")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    config = model_config("vitheavy")
    steps = [make_step(MIX, config, args.seed + k, args.text_only_tokens) for k in range(args.steps)]
    imb = model_imbalance(steps, config)
    t0 = time.perf_counter()
    per_repeat, loads, losses = [], [], []
    for _ in range(args.repeats):
        per_rank = spawn(_body, 4, (args.steps, args.rounds, args.seed, args.text_only_tokens),
                         threads=1)
        per_repeat.append(summarise(per_rank))
        for v in per_repeat[-1].values():
            v["rounds"] = args.rounds
        losses.append(loss_agreement(per_rank))
        loads.append(os.getloadavg()[0])
    summary = combine(per_repeat)
    result = {
        "benchmark": "balance", "layout": LAYOUT, "shape": "vitheavy", "mix_patches": MIX,
        "equal_patches": EQUAL, "text_only_tokens": args.text_only_tokens, "steps": args.steps,
        "rounds": args.rounds, "repeats": args.repeats, "seed": args.seed,
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores, shared with other jobs (load average after each "
                   f"repeat: {', '.join(f'{x:.1f}' for x in loads)}); 4 ranks, 1 torch thread each",
        "model_imbalance": {m: {k: statistics.mean(v) for k, v in d.items() if k != "text_calls"}
                            for m, d in imb.items()},
        "model_per_step": imb,
        "summary": summary,
        "modelled_ratios": {k: statistics.median(ratios(r)[k] for r in per_repeat)
                            for k in ratios(per_repeat[0])},
        "modelled_ratios_per_repeat": [ratios(r) for r in per_repeat],
        "wall_ratios_per_repeat": [ratios(r, "wall_step_s_median") for r in per_repeat],
        "loss_max_rel_diff_vs_count": max(losses),
        "cost_model_fit": fit(per_repeat, config, args.seed, args.text_only_tokens),
        "per_repeat": per_repeat,
        "elapsed_s": time.perf_counter() - t0,
    }
    os.makedirs(args.out, exist_ok=True)
    tag = "" if args.text_only_tokens == TEXT_ONLY_TOKENS else f"-text{args.text_only_tokens}"
    stem = os.path.join(args.out, f"balance-vitheavy{tag}-cpu{os.cpu_count()}-{result['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    print(json.dumps({k: result[k] for k in ("model_imbalance", "modelled_ratios", "cost_model_fit",
                                             "modelled_ratios_per_repeat", "loss_max_rel_diff_vs_count",
                                             "machine")}, indent=1))
    for n, v in summary.items():
        print(n, {k: v[k] for k in v if k.endswith(("_median", "_mean", "efficiency"))})
    return result


def fit(per_repeat: list, config, seed: int, text_tokens: int) -> dict:
    """The cost model against the measured busy times (every contender, step and replica):
    least squares of text busy = per_call x calls + per_token x tokens run (padding included),
    and of vision busy = intercept + slope x modelled image cost; R² of each."""
    import numpy as np

    ref = balancer_of("cost", config).model
    tx, ty, vx, vy = [], [], [], []
    for rep in per_repeat:
        for name in rep:
            bal = balancer_of(name, config)
            for i, (tb, vb) in enumerate(zip(rep[name]["text_busy_s_per_replica"],
                                             rep[name]["vision_busy_s_per_replica"])):
                k = i % (len(rep[name]["text_busy_s_per_replica"]) // rep[name]["rounds"])
                st = make_step(EQUAL if name == "equal" else MIX, config, seed + k, text_tokens)
                for j, idx in enumerate(bal.text_replicas(st, 2)):
                    gs = bal.text_groups(st, idx)
                    tx.append([len(gs), sum(len(g) * max(st[q].num_tokens for q in g) for g in gs)])
                    ty.append(tb[j])
                for j, idx in enumerate(bal.vision_replicas(st, 2)):
                    vx.append([1.0, sum(ref.vision(st[q].image_grid_thw) for q in idx)])
                    vy.append(vb[j])

    def lsq(x, y):
        x, y = np.array(x, float), np.array(y, float)
        c = np.linalg.lstsq(x, y, rcond=None)[0]
        return c, 1 - float(((x @ c - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    (call, tok), tr2 = lsq(tx, ty)
    (v0, v1), vr2 = lsq(vx, vy)
    call, tok, v0, v1 = (float(x) for x in (call, tok, v0, v1))
    return {"text": {"per_call_ms": call * 1e3, "per_token_ms": tok * 1e3,
                     "call_in_tokens": call / tok, "r2": tr2, "points": len(ty)},
            "vision": {"intercept_ms": v0 * 1e3, "ms_per_1e9_cost": v1 * 1e12, "r2": vr2,
                       "points": len(vy)}}


def loss_agreement(per_rank: list) -> float:
    """Largest relative difference of a mixed-set contender's loss from ``count``'s on the same
    step and round (same weights, same samples: only the plan differs, so fp32 rounding only)."""
    steps = per_rank[0]["steps"]
    worst = 0.0
    for name in ("cost_1batch", "cost"):
        for a, b in zip(steps[name], steps["count"]):
            worst = max(worst, abs(a["loss"] - b["loss"]) / abs(b["loss"]))
    return worst


if __name__ == "__main__":
    main()
