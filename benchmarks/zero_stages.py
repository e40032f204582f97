"""ZeRO stages 0-3 side by side (issue #25): per-rank model state measured vs `ray-dhp plan`,
step time and bytes communicated, at one model on 4 gloo ranks.

Layout: collocated, text DP = vision DP = ``--ranks`` (text TP 1, vision SP 1), so every rank is
a replica of both modules and the stages differ only in what a replica keeps. Contenders, built
once each in the same processes (same seed: the same initial weights, first-step losses recorded):
``s0`` (text 0, vision 0), ``s1`` (1, 1), ``s2`` (2, 2), ``s3`` (text 3 = FSDP2, vision 2),
``s3v`` (both modules at stage 3: FSDP2 for the ViT too, `ray_dhp.models.fsdp_vision`),
``s1-offload`` (``s1`` with both modules' masters and moments on the host,
`ray_dhp.step.offload`), ``s3-plain``/``s3v-plain`` (below); ``--contenders`` runs a subset
(``s0`` always). One warm-up step each, one counted
step each (collectives by name, `benchmarks.measure.CollectiveCounter`, FSDP2's included), then
``--steps`` rounds in rotating order with a barrier before each step. Step time = the slowest
rank's; medians and ratios to ``s0``.

State: `DHPEngine.state_bytes` (weights, gradients at their peak, fp32 masters, AdamW moments,
measured from the tensors) vs `ray_dhp.planning.memory.rank_state` for every rank. Collective
bytes: the input bytes each rank hands to each collective (counted), and the ring estimate of
bytes sent (`all_reduce` 2(n-1)/n of its input, `reduce`/`broadcast`/`reduce_scatter` (n-1)/n,
`all_gather` (n-1) x its shard), next to the planner's `ray_dhp.parallel.zero.replica_bytes`.
Host AdamW (`host_adam`, in the driver, one thread): DeepSpeedCPUAdam vs torch's foreach and
single-tensor AdamW over ``--host-adam-numel`` fp32 parameters, the engine choice of
`ray_dhp.step.offload.host_adamw`.

Shapes (`benchmarks.shapes`): ``text-wide``, Qwen2.5-0.5B's text width (hidden 896, MLP 4864,
14/2 heads) with 2 layers and the vitheavy ViT, all contenders resident side by side; ``7b-wide``,
Qwen2.5-VL-7B's text width (hidden 3584, MLP 18944, 28/4 heads) with one decoder layer (236 M
parameters: ~4 GB per rank at stage 0), too large for the contenders to live side by side on a
24 GiB machine: ``--one-at-a-time`` builds, measures, times and frees one contender after the
other in the given order (its step times are then not interleaved: read its ratios as coarser).

``s3-plain`` / ``s3v-plain``: ``s3`` / ``s3v`` with FSDP2's defaults instead of the engine's
explicit prefetch (`ray_dhp.parallel.fsdp.FSDPShards.overlap`), side by side with them.

Run: ``python -m benchmarks.zero_stages [--ranks 4] [--steps 5] [--tiny] [--contenders s0,s3v]
[--shape 7b-wide --one-at-a-time]``;
writes ``benchmarks/results/zero-stages-<shape>-cpu2-<date>[-<subset>].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# name: (vision stage, text stage, optimizer offload of both modules)
CONTENDERS = {"s0": (0, 0, False), "s1": (1, 1, False), "s2": (2, 2, False), "s3": (2, 3, False),
              "s3v": (3, 3, False), "s1-offload": (1, 1, True),
              "s3-plain": (2, 3, False), "s3v-plain": (3, 3, False)}
# FSDP2's defaults (no explicit prefetch, synchronous gathers on gloo; `FSDPShards.overlap`)
PLAIN = {"s3-plain", "s3v-plain"}
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce": lambda n: (n - 1) / n,
        "broadcast": lambda n: (n - 1) / n, "reduce_scatter_single": lambda n: (n - 1) / n,
        "reduce_scatter_tensor": lambda n: (n - 1) / n, "all_gather_single": lambda n: n - 1,
        "all_gather_into_tensor": lambda n: n - 1}


def _layout(world: int) -> dict:
    return dict(placement="collocated", vision_dp=world, vision_sp=1, text_dp=world, text_tp=1)


def _build(config, world, name, cfg):
    import torch

    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    vz, tz, off = CONTENDERS[name]
    topo = Topology.build(**_layout(world), vision_zero=vz, text_zero=tz, vision_offload=off,
                          text_offload=off)
    engine = DHPEngine(config, build_groups(topo, torch.device("cpu")), cfg.step_config())
    for fsdp in engine.sharding.values():  # each stage-3 module's FSDP2 sharding
        fsdp.overlap(name not in PLAIN)
    return topo, engine


def _timed(engine, batch) -> tuple:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = engine.step([batch])
    return time.perf_counter() - t0, out["loss"]


def zero_body(rank, world, opts: dict) -> dict:
    import torch

    from benchmarks.measure import CollectiveCounter
    from benchmarks.shapes import make_batch, model_config
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.config.train_loop import TrainLoopConfig

    torch.manual_seed(0)
    config = model_config(opts["shape"])
    cfg = TrainLoopConfig(global_batch_size=world, seed=0, precision=opts["precision"], lr=1e-5)
    batch = make_batch(world, opts["patches"], config)
    counts = count_params(config)
    counter = CollectiveCounter()
    out = {}

    def measure(name):
        topo, engine = _build(config, world, name, cfg)
        _, loss = _timed(engine, batch)  # warm-up
        with counter.counting():
            _timed(engine, batch)
        plan = rank_state(counts, topo, rank, engine.policy)
        out[name] = {"first_loss": loss, "comm": counter.as_dict(), "times": [],
                     "held": engine.state_bytes(),
                     "plan": {k: getattr(plan, k) for k in ("weights", "grads", "masters",
                                                            "optimizer", "total", "host")}}
        return engine

    with counter.installed():
        if opts["one_at_a_time"]:  # a shape whose contenders do not fit side by side
            for name in opts["contenders"]:
                engine = measure(name)
                out[name]["times"] = [_timed(engine, batch)[0] for _ in range(opts["steps"])]
                del engine
                gc.collect()
            return out
        engines = {name: measure(name) for name in opts["contenders"]}
        names = list(opts["contenders"])
        for r in range(opts["steps"]):
            for name in names[r % len(names):] + names[:r % len(names)]:
                out[name]["times"].append(_timed(engines[name], batch)[0])
    return out


def host_adam(numel: int, repeats: int = 5) -> dict:
    """Seconds per step (median of ``repeats``, one thread) of the host AdamW candidates over
    ``numel`` fp32 parameters in 8 tensors: DeepSpeedCPUAdam, torch foreach, torch single-tensor;
    and the largest difference of DeepSpeed's parameters from torch's single-tensor ones after
    the steps (relative to the largest parameter)."""
    import torch

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(1)

    def params():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(numel // 8, generator=g)) for _ in range(8)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        return ps

    makers = {"deepspeed_cpu_adam": lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.1),
              "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
              "torch_single": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False)}
    out, final = {"numel": numel}, {}
    for name, make in makers.items():
        ps = params()
        opt, times = make(ps), []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
        final[name] = torch.cat([p.detach().reshape(-1) for p in ps])
    ref = final["torch_single"]
    out["max_rel_diff_deepspeed_vs_torch"] = float(
        (final["deepspeed_cpu_adam"] - ref).abs().max() / ref.abs().max())
    return out


def _ring_bytes(comm: dict, n: int) -> float:
    total = 0.0
    for key, v in comm.items():
        op = key.split(".", 1)[1]
        if op in RING:
            total += RING[op](n) * v["bytes"]
    return total


def summarise(per_rank: list, counts, world: int, policy) -> dict:
    """Per contender: step-time median (slowest rank per step), ratio to ``s0``, state held vs
    plan for every rank, collective bytes (counted, ring estimate, planner's)."""
    import torch

    from ray_dhp.parallel.zero import replica_bytes

    rows = {}
    for name in per_rank[0]:
        vz, tz, off = CONTENDERS[name]
        steps = [max(r[name]["times"][i] for r in per_rank)
                 for i in range(len(per_rank[0][name]["times"]))]
        r0 = per_rank[0][name]
        g, w = torch.empty((), dtype=policy.reduce_dtype).element_size(), policy.weight_bytes()
        planned = (replica_bytes(world, tz, g * counts.text, w * counts.text)
                   + replica_bytes(world, vz, g * counts.vision, w * counts.vision))
        rows[name] = {
            "stages": {"vision": vz, "text": tz}, "offload": off, "step_s_median": statistics.median(steps),
            "step_s": steps, "first_loss": [r[name]["first_loss"] for r in per_rank],
            "held_vs_plan": [{"held": r[name]["held"], "plan": r[name]["plan"]} for r in per_rank],
            "held_equals_plan": all(all(r[name]["held"][k] == r[name]["plan"][k] for k in
                                        ("weights", "grads", "masters", "optimizer", "host"))
                                    for r in per_rank),
            "comm_rank0": r0["comm"], "ring_bytes_rank0": _ring_bytes(r0["comm"], world),
            "planned_sync_bytes": planned,
        }
    base = rows["s0"]["step_s_median"] if "s0" in rows else None
    for row in rows.values():
        row["step_vs_s0"] = None if base is None else row["step_s_median"] / base
    return rows


def table(result: dict) -> str:
    """The README table of a result (``python -m benchmarks.zero_stages --table RESULT.json``)."""
    mib = 2 ** 20
    lines = ["| contender | stages v/t | rank 0 state MiB (plan) | of it on the host | every rank = plan "
             "| step (median s) | vs s0 | rank 0 sent MiB/step (planner) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result["contenders"].items():
        h = r["held_vs_plan"][0]
        lines.append(
            f"| `{name}` | {r['stages']['vision']}/{r['stages']['text']} | "
            f"{h['held']['total'] / mib:.1f} ({h['plan']['total'] / mib:.1f}) | "
            f"{h['held'].get('host', 0) / mib:.1f} | {'yes' if r['held_equals_plan'] else 'NO'} | "
            f"{r['step_s_median']:.3f} | {_ratio(r)} | "
            f"{r['ring_bytes_rank0'] / mib:.1f} ({r['planned_sync_bytes'] / mib:.1f}) |")
    return "\n".join(lines)


def _ratio(row: dict) -> str:
    return "—" if row["step_vs_s0"] is None else f"{row['step_vs_s0']:.2f}x"


def _plot(rows: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    bottom = [0.0] * len(names)
    for kind in ("weights", "grads", "masters", "optimizer"):
        vals = [rows[n]["held_vs_plan"][0]["held"][kind] / 2 ** 20 for n in names]
        axes[0].bar(names, vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].scatter(names, [rows[n]["held_vs_plan"][0]["plan"]["total"] / 2 ** 20 for n in names],
                    color="k", marker="_", s=400, label="plan", zorder=3)
    axes[0].set_ylabel("rank 0 model state (MiB)")
    axes[0].legend(fontsize=7)
    axes[1].bar(names, [rows[n]["step_vs_s0"] or 0.0 for n in names], color="tab:gray")
    axes[1].axhline(1.3, ls="--", color="r", lw=0.8)
    axes[1].set_ylabel("step time / stage 0 (median)")
    axes[2].bar(names, [rows[n]["ring_bytes_rank0"] / 2 ** 20 for n in names], label="counted (ring est.)")
    axes[2].scatter(names, [rows[n]["planned_sync_bytes"] / 2 ** 20 for n in names], color="k",
                    marker="_", s=400, label="planner", zorder=3)
    axes[2].set_ylabel("rank 0 bytes sent per step (MiB)")
    axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--patches", type=int, default=256)
    p.add_argument("--shape", default="text-wide")
    p.add_argument("--precision", default="bf16_mixed")
    p.add_argument("--tiny", action="store_true", help="vitheavy shape, 64 patches, 1 round")
    p.add_argument("--host-adam-numel", type=int, default=8_000_000)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {', '.join(CONTENDERS)} (s0 is always run)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="build, measure and free one contender at a time, in the given order "
                        "(shapes whose contenders do not fit side by side; s0 not forced)")
    p.add_argument("--table", metavar="RESULT_JSON", help="print the README table of a result")
    a = p.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            print(table(json.load(f)))
        return {}
    if a.tiny:
        a.shape, a.patches, a.steps, a.host_adam_numel = "vitheavy", 64, 1, 80_000
    from benchmarks.shapes import model_config
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.train.launch import spawn

    names = [n for n in a.contenders.split(",") if n]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        p.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    if not a.one_at_a_time:
        names = ["s0"] + [n for n in names if n != "s0"]
    opts = {"shape": a.shape, "patches": a.patches, "steps": a.steps, "precision": a.precision,
            "contenders": names, "one_at_a_time": a.one_at_a_time}
    load_start = os.getloadavg()
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")  # PyTorch's THP CPU allocation, set by hand
    per_rank = spawn(zero_body, a.ranks, (opts,), backend="gloo", threads=1, timeout_s=3000)
    counts = count_params(model_config(a.shape))
    rows = summarise(per_rank, counts, a.ranks, POLICIES[a.precision])
    result = {"shape": a.shape, "parameters": counts.vision + counts.text, "ranks": a.ranks,
              "layout": f"collocated vision DP{a.ranks} / text DP{a.ranks}", **opts,
              "load_average_start": load_start, "thp_mem_alloc_enable": thp,
              "load_average_end": os.getloadavg(), "machine": "2-core CPU, gloo, shared",
              "contenders": rows, "host_adam": host_adam(a.host_adam_numel)}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"zero-stages-{a.shape}-cpu2-{datetime.date.today().isoformat()}")
    if a.precision != "bf16_mixed":
        stem += f"-{a.precision}"
    if set(names) != set(CONTENDERS):  # a subset: its own files
        stem += "-" + "-".join(names)
    if thp != "0":
        stem += "-thp"
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    _plot(rows, stem + ".png", f"ZeRO stages, {a.shape}, {a.ranks} gloo ranks, {a.precision}")
    for name, r in rows.items():
        h = r["held_vs_plan"][0]
        print(f"{name}: rank0 state {h['held']['total'] / 2 ** 20:.1f} MiB (plan "
              f"{h['plan']['total'] / 2 ** 20:.1f}; on the host {h['held']['host'] / 2 ** 20:.1f}), all ranks = plan: {r['held_equals_plan']}; "
              f"step {r['step_s_median']:.3f} s ({_ratio(r)} s0); sent "
              f"{r['ring_bytes_rank0'] / 2 ** 20:.1f} MiB (planner {r['planned_sync_bytes'] / 2 ** 20:.1f})")
    h = result["host_adam"]
    print(f"host AdamW over {h['numel']} fp32 params: DeepSpeedCPUAdam {h['deepspeed_cpu_adam']:.4f} s, "
          f"torch foreach {h['torch_foreach']:.4f} s, single {h['torch_single']:.4f} s; max rel diff "
          f"{h['max_rel_diff_deepspeed_vs_torch']:.1e}")
    return result


if __name__ == "__main__":
    main()
