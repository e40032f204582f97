"""Run every benchmark once and write ``results/<shape>-<hardware>-<date>.json`` + PNGs + README table.

    python -m benchmarks.run --ranks 4                 # the full CPU run (~10 min on 2 cores)
    python -m benchmarks.run --ranks 4 --tiny          # a one-minute dry run of everything
    python -m benchmarks.run --backend nccl --autocast bfloat16 ...   # see benchmarks/gpu/

Sections: contender sweep (step time, vision tokens/s, exact saved activations, state bytes,
peak RSS, collectives), 1/SP activation check, memory-model validation and Qwen2.5-VL-7B/32B
evaluation, Ray plugin overhead. Targets are reported hit or miss; nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import memory_model as mm  # noqa: E402
from benchmarks import report, shapes  # noqa: E402
from benchmarks.contenders import NAMES  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--shape", default="vitheavy", choices=sorted(shapes.SHAPES))
    p.add_argument("--lengths", default="256,512,1024,2048", help="vision patches per image (multiples of 64)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: --ranks, one image per rank)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender and length")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--contenders", default=",".join(NAMES))
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--autocast", default=None, choices=(None, "bfloat16"))
    p.add_argument("--hardware", default=None, help="name in the results file (default: cpu<N> / <gpu>x<N>)")
    p.add_argument("--sp-length", type=int, default=2048, help="image length of the 1/SP activation check")
    p.add_argument("--overhead-length", type=int, default=1024)
    p.add_argument("--overhead-steps", type=int, default=6)
    p.add_argument("--skip-ray", action="store_true")
    p.add_argument("--tiny", action="store_true", help="dry run: 2 short lengths, 2 steps, small checks")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--rescore", metavar="JSON", help="recompute ratios/targets/plots/README from a results file")
    a = p.parse_args(argv)
    if a.tiny:
        a.lengths, a.steps, a.sp_length, a.overhead_length, a.overhead_steps = "64,256", 2, 256, 256, 3
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.contenders = a.contenders.split(",")
    a.batch = a.batch or a.ranks
    return a


def hardware_name(backend: str) -> str:
    if backend == "nccl":
        import torch

        name = torch.cuda.get_device_name(0).split()[-1].lower()
        return f"{name}x{torch.cuda.device_count()}"
    return f"cpu{os.cpu_count()}"


def _git() -> dict:
    def run(*cmd):
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": run("git", "rev-parse", "HEAD"), "dirty_files": run("git", "status", "--short").splitlines()}


def summarise_sweep(per_rank: list, opts: dict) -> tuple[dict, dict]:
    r0 = per_rank[0]
    contenders = {"errors": r0["errors"], "build_s": r0["build_s"],
                  "state_per_rank": {n: [r["state"].get(n) for r in per_rank] for n in r0["state"]},
                  "state_max": {n: max(sum(r["state"][n].values()) for r in per_rank) for n in r0["state"]}}
    sweep = {}
    for length in opts["lengths"]:
        rows = {}
        for n in per_rank[0]["runs"][length]:
            runs = [r["runs"][length][n] for r in per_rank]
            times = [max(r["times"][i] for r in runs) for i in range(len(runs[0]["times"]))]
            med = statistics.median(times)
            acts = [r["activations"] for r in runs]
            rows[n] = {
                "step_time_median_s": med, "step_time_min_s": min(times), "step_times_s": times,
                "vision_tokens_per_s": opts["batch"] * length / med,
                "losses": runs[0]["losses"],
                "activations_per_rank": acts,
                "activation_max": max(a["total"] for a in acts),
                "vision_act_max": max(a["vision"] for a in acts),
                "text_act_max": max(a["text"] for a in acts),
                "peak_rss_per_rank": [r["peak_rss"] for r in runs],
                "cuda_peak_per_rank": [r["cuda_peak"] for r in runs],
                "collectives_rank0": runs[0]["collectives"],
                "collectives_per_rank": [r["collectives"] for r in runs],
            }
        sweep[str(length)] = rows
    return contenders, sweep


def ratios(sweep: dict, key: str = "step_time_median_s") -> dict:
    """Throughput ratios ``a/b`` per length, from median (default) or minimum step times."""
    out = {}
    for length, rows in sweep.items():
        tput = {n: 1.0 / r[key] for n, r in rows.items()}
        out[length] = {f"{a}/{b}": tput[a] / tput[b] for a in ("dhp", "dhp-disjoint") for b in tput
                       if a in tput and b != a}
    return out


def _layout_for(name: str, ranks: int, batch: int) -> tuple:
    """(memory-model Layout, images whose tokens one rank holds) for a contender of the sweep."""
    if name == "dhp":
        return mm.Layout("dhp", ranks, sp=ranks, tp=ranks), batch / ranks
    if name == "dhp-disjoint":
        return mm.Layout("dhp-disjoint", ranks, sp=ranks // 2, tp=ranks // 2), batch / (ranks // 2)
    if name == "tp":
        return mm.Layout("tp", ranks, tp=ranks), batch
    return mm.Layout(name, ranks), batch / ranks


def validate_model(sweep: dict, config, opts: dict) -> dict:
    d = mm.Dims.from_config(config)
    rows = []
    for length, runs in sweep.items():
        for n, r in runs.items():
            lay, share = _layout_for(n, opts["ranks"], opts["batch"])
            model = mm.per_rank_bytes(d, lay, int(length), mm.FP32, samples_per_rank=share)
            if n == "dhp-disjoint":  # vision and text ranks are separate: compare the worst rank
                model["activations"] = max(model["vision_act"], model["text_act"])
            rows.append({"contender": n, "length": int(length), "measured": r["activation_max"],
                         "model": model["activations"],
                         "rel_err": model["activations"] / r["activation_max"] - 1})
    return {"validation": rows, "max_abs_rel_err": max(abs(r["rel_err"]) for r in rows),
            "by_contender": {n: max(abs(r["rel_err"]) for r in rows if r["contender"] == n)
                             for n in {r["contender"] for r in rows}}}


def small_scale_fit(config, ranks: int, budget_gib: float = 1.0) -> dict:
    d = mm.Dims.from_config(config)
    out = {"budget_gib": budget_gib}
    for n in ("dhp", "tp", "zero3"):
        lay, _ = _layout_for(n, ranks, ranks)
        out[n] = mm.max_length(d, lay, budget_gib * mm.GiB, mm.FP32)
    return out


def sp_check(per_rank: list, length: int) -> dict:
    sps = sorted(per_rank[0], key=int)
    base = max(r[sps[0]]["vision"] for r in per_rank)
    rows = {}
    for sp in sps:
        v = max(r[sp]["vision"] for r in per_rank)
        rows[str(sp)] = {"vision_bytes": v, "per_rank": [r[sp]["vision"] for r in per_rank],
                         "fraction": v / base, "within_10pct": abs(v / base * int(sp) - 1) <= 0.10}
    return {"length": length, "rows": rows}


def targets(res: dict) -> list:
    out = []
    longest = list(res["sweep"])[-1]
    r = res["ratios"][longest].get("dhp/tp")
    r_min = res["ratios_min"][longest].get("dhp/tp")
    out.append({"name": "DHP >= 1.3x uniform TP vision tokens/s at the longest length", "value": r,
                "hit": bool(r and r >= 1.3 and r_min >= 1.3),
                "detail": f"{_fmt(r)} from median step times, {_fmt(r_min)} from minimum step times, at "
                          f"{longest} patches ({res['meta']['hardware']}, {res['meta']['ranks']} ranks: see "
                          "'Reading CPU numbers')"})
    big = res["memory_model"]["big_models"]
    fits = "; ".join(f"{row['model']} {'with' if row['activation_checkpointing'] else 'without'} AC: "
                     f"{row['dhp_text_sp'] / max(row['zero3'], 1):.1f}× with text SP "
                     f"({row['dhp_text_sp']:,} vs {row['zero3']:,}; {row['dhp'] / max(row['zero3'], 1):.1f}× without)"
                     for row in big)
    best = max(row["dhp_text_sp"] / max(row["zero3"], 1) for row in big)
    out.append({"name": "max vision sequence at a fixed per-rank budget >= 7x ZeRO-3's (memory model, 8x80GB)",
                "value": best, "hit": all(row["dhp_text_sp"] >= 7 * row["zero3"] for row in big),
                "detail": f"hit only if every row reaches 7×; best {best:.1f}×. " + fits})
    big32 = [row for row in big if row["model"] == "Qwen2.5-VL-32B"]
    worst32 = min(row["dhp_text_sp"] / max(row["zero3"], 1) for row in big32) if big32 else None
    out.append({"name": "Qwen2.5-VL-32B: DHP + text SP >= 8x ZeRO-3's longest image, with and without AC "
                        "(memory model, 8x80GB)", "value": worst32,
                "hit": bool(big32) and all(row["dhp_text_sp"] >= 8 * row["zero3"] for row in big32),
                "detail": "; ".join(f"{'with' if r['activation_checkpointing'] else 'without'} AC: "
                                    f"{r['dhp_text_sp'] / max(r['zero3'], 1):.1f}× ({r['dhp_text_sp']:,} vs "
                                    f"{r['zero3']:,})" for r in big32)})
    o = res.get("ray_overhead") or {}
    if "plain" in o:
        o.update(overhead_summary(o))
        detail = (f"Ray/plain per-step ratio {_fmt(o['ratio_min'])} from minimum step times, "
                  f"{_fmt(o['step_time_ratio_ray_over_plain'])} from medians; the two plain runs alone differ by "
                  f"{100 * o['plain_vs_plain_median_spread']:.0f}% in median (other jobs on the machine), so "
                  "medians cannot resolve 3% here; the minimum estimates the uncontended step")
        out.append({"name": "plugin per-step overhead <= 3%", "value": o["ratio_min"],
                    "hit": o["ratio_min"] <= 1.03, "detail": detail})
    else:
        out.append({"name": "plugin per-step overhead <= 3%", "value": None, "hit": False, "detail": "not measured"})
    return out


def overhead_summary(o: dict) -> dict:
    plain_times = [t for run in o["plain"] for t in run["times"][1:]]
    meds = [statistics.median(run["times"][1:]) for run in o["plain"]]
    return {"ratio_min": min(o["ray"]["times"][1:]) / min(plain_times),
            "plain_vs_plain_median_spread": max(meds) / min(meds) - 1}


def finalise(res: dict) -> dict:
    """Derived numbers (ratios, targets) from the raw measurements; also used by --rescore."""
    res["ratios"] = ratios(res["sweep"])
    res["ratios_min"] = ratios(res["sweep"], "step_time_min_s")
    res["targets"] = targets(res)
    return res


def _fmt(x):
    return "n/a" if x is None else f"{x:.2f}×"


def rescore(path: str) -> str:
    with open(path) as f:
        res = json.load(f)
    for rows in res["sweep"].values():
        for r in rows.values():
            r["step_time_min_s"] = min(r["step_times_s"])
    res["meta"]["rescored"] = "ratios/targets recomputed from the raw measurements by --rescore"
    finalise(res)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    stem = os.path.splitext(os.path.basename(path))[0]
    report.plots(res, os.path.splitext(path)[0])
    report.update_readme(os.path.join(HERE, "README.md"), report.markdown(res, stem))
    print(report.markdown(res, stem))
    return path


def main(argv=None) -> str:
    a = parse(argv)
    if a.rescore:
        return rescore(a.rescore)
    from benchmarks.launcher import spawn
    from benchmarks.sweep import sp_scaling_body, sweep_body

    opts = {"backend": a.backend, "shape": a.shape, "batch": a.batch, "lengths": a.lengths,
            "contenders": a.contenders, "warmup": a.warmup, "steps": a.steps, "autocast": a.autocast,
            "ranks": a.ranks}
    date = datetime.date.today().isoformat()
    hw = a.hardware or hardware_name(a.backend)
    meta = {"shape": a.shape, "hardware": hw, "date": date, "ranks": a.ranks, "backend": a.backend,
            "lengths": a.lengths, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
            "contenders": a.contenders, "autocast": a.autocast, "tiny": a.tiny,
            "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
            "loadavg_before": [round(x, 1) for x in os.getloadavg()], "python": platform.python_version(),
            "git": _git(), "versions": _versions()}
    print(f"[bench] sweep {a.contenders} x {a.lengths} on {a.ranks} ranks", flush=True)
    threads = 1 if a.backend == "gloo" else 4
    per_rank = spawn(sweep_body, a.ranks, (opts,), backend=a.backend, threads=threads)
    contenders, sweep = summarise_sweep(per_rank, opts)
    print(f"[bench] 1/SP check at {a.sp_length}", flush=True)
    sp = spawn(sp_scaling_body, a.ranks, (dict(opts, length=a.sp_length),), backend=a.backend, threads=threads)
    config = shapes.model_config(a.shape)
    res = {"meta": meta, "contenders": contenders, "sweep": sweep, "sp_scaling": sp_check(sp, a.sp_length)}
    mem = validate_model(sweep, config, opts) if a.autocast is None else {"validation": [], "note": "fp32 only"}
    mem.update(gpus=8, gpu_gib=80, reserve_gib=6, budget_gib=74, big_models=mm.big_model_table(8, 80.0, 6.0),
               small_scale=small_scale_fit(config, a.ranks))
    res["memory_model"] = mem
    if a.skip_ray or a.backend != "gloo":
        res["ray_overhead"] = {"skipped": "--skip-ray" if a.skip_ray else "CPU only"}
    else:
        print("[bench] Ray overhead", flush=True)
        from benchmarks.ray_overhead import measure_overhead

        try:
            res["ray_overhead"] = measure_overhead({"ranks": a.ranks, "shape": a.shape, "batch": a.batch,
                                                    "length": a.overhead_length, "steps": a.overhead_steps})
        except Exception as e:  # noqa: BLE001 - recorded in the results
            res["ray_overhead"] = {"error": f"{type(e).__name__}: {e}"}
    meta["loadavg_after"] = [round(x, 1) for x in os.getloadavg()]
    finalise(res)
    os.makedirs(a.out, exist_ok=True)
    stem = f"{a.shape}-{hw}-{date}" + ("-tiny" if a.tiny else "")
    path = os.path.join(a.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    if not a.tiny or a.out != os.path.join(HERE, "results"):
        report.plots(res, os.path.splitext(path)[0])
        if not a.tiny:
            report.update_readme(os.path.join(HERE, "README.md"), report.markdown(res, stem))
    print(report.markdown(res, stem))
    print(f"[bench] wrote {path}")
    return path


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for p in ("torch", "transformers", "deepspeed", "ray"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


if __name__ == "__main__":
    main()
