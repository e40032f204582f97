"""Datasets of millions of records (#28): per-worker memory and time to the first step.

Generates LLaVA JSONL sets (one image and a ~40-word answer a record, ~400 B) into ``--dir``
(default ``/tmp/ray_dhp_data_scale``, deleted afterwards unless ``--keep``) and, for each size,
runs one fresh process per contender — standing for one worker: imports, the tiny demo
processor, then the run's loader (`read_annotations` -> `StepSampler` -> `StepLoader`) and its
first step (8 samples decoded) — side by side in one run:

* ``after-cold``: this tree, no index yet (it is built: the data file is in the page cache,
  as right after writing it; the scan rate is records / build time);
* ``after-warm``: this tree, the index built by the cold run read back (a restart);
* ``before``: ``--before-tree``'s ``ray_dhp`` (e.g. ``git archive 4a8c7a6 ray_dhp | tar -x -C
  /tmp/before``): every record parsed into a Python object (sizes up to ``--before-max``: at
  10M records it needs ~26 GiB).

Per contender: RSS over the process's base (after imports and the processor, before the data)
once the loader is built and after its first step, the peak, and the seconds from the process's
start (``Popen``) to the first step. ``--ray-rows``: a Ray Dataset (``ray.data.read_json`` of a
generated set) of that many rows and of 1,000 rows trains 2 steps through `DisaggregatedTrainer`
(2 workers, tiny demo model); every worker's RSS is sampled during the run (peak compared).

    python -m benchmarks.data_scale --sizes 1000000 --before-tree /tmp/before --ray-rows 1000000
    python -m benchmarks.data_scale --sizes 10000000 --before-max 0 --no-ray
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
_WORDS = ("red green blue yellow circle square triangle small large left right top bottom near far "
          "bright dark plain shape image shows there are two three one of the in on with a").split()


def generate(folder: Path, n: int) -> Path:
    """``folder/data.jsonl`` of ``n`` records over 8 small PNGs in ``folder/images``."""
    import random

    from PIL import Image

    path = folder / "data.jsonl"
    if path.exists() and sum(1 for _ in open(path, "rb")) == n:
        return path
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for k in range(8):
        Image.new("RGB", (56, 56), (30 * k, 200 - 20 * k, 90)).save(folder / "images" / f"{k}.png")
    rng = random.Random(0)
    answers = [json.dumps(" ".join(rng.choice(_WORDS) for _ in range(40))) for _ in range(997)]
    head = '{"id": "%d", "image": "images/%d.png", "conversations": [{"from": "human", "value": ' \
           '"<image>\\nDescribe the image in detail."}, {"from": "gpt", "value": %s}]}\n'
    with open(path, "w") as f:
        for start in range(0, n, 100_000):
            f.write("".join(head % (i, i % 8, answers[i % 997])
                            for i in range(start, min(n, start + 100_000))))
    return path


# -- one worker (a child process) --------------------------------------------------------------

def _rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def child(path: str, spawned_at: float) -> dict:
    import torch

    torch.set_num_threads(1)
    from ray_dhp import demo
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.config.train_loop import TrainLoopConfig

    processor = demo.tiny_processor()
    base = _rss()
    t0 = time.time()
    records = read_annotations(path)
    t_read = time.time() - t0
    cfg = TrainLoopConfig(global_batch_size=8, num_steps=10, seed=0, balance="count")
    loader = StepLoader(StepSampler(records, processor, resolve_data_root(path), cfg.sampler_config()), prefetch=False)
    built, t_built = _rss(), time.time() - t0
    samples = sum(len(mb) for mb in loader.next())
    first, t_first = _rss(), time.time()
    import ray_dhp

    n = len(records)
    return {"tree": str(Path(ray_dhp.__file__).parent.parent), "records": n,
            "samples_first_step": samples, "read_s": t_read, "build_s": t_built,
            "to_first_step_s": t_first - spawned_at, "loader_to_first_step_s": t_first - t0,
            "start_s": t0 - spawned_at, "base_rss": base["VmRSS"],
            "built_over_base": built["VmRSS"] - base["VmRSS"],
            "first_step_over_base": first["VmRSS"] - base["VmRSS"],
            "bytes_per_record": (built["VmRSS"] - base["VmRSS"]) / n,
            "bytes_per_record_after_step": (first["VmRSS"] - base["VmRSS"]) / n,
            "peak_over_base": first["VmHWM"] - base["VmRSS"], "rss_anon": first["RssAnon"],
            "rss_file": first["RssFile"]}


def run_child(tree: Path, path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    spawned = time.time()
    # run as a script from elsewhere: only PYTHONPATH decides which ray_dhp is imported
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(path),
                          str(spawned)], env=env, cwd=path.parent, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({tree}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def scan_rate(path: Path, n: int, repeats: int = 3) -> dict:
    """Lines/s of the index build alone (into a scratch folder), ``repeats`` times in this
    process (the data file in the page cache): the machine is shared, so min and median."""
    from ray_dhp.data.index import index_file

    times = []
    for _ in range(repeats):
        scratch = path.parent / ".scan_scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        t0 = time.perf_counter()
        index_file(path, scratch)
        times.append(time.perf_counter() - t0)
    shutil.rmtree(scratch, ignore_errors=True)
    times.sort()
    return {"times_s": times, "median_lines_per_s": n / times[len(times) // 2],
            "best_lines_per_s": n / times[0]}


def scale(path: Path, n: int, before_tree, before_max: int) -> dict:
    here = Path(__file__).resolve().parent.parent
    shutil.rmtree(path.parent / ".ray_dhp_index", ignore_errors=True)
    res = {"after-cold": run_child(here, path), "after-warm": run_child(here, path)}
    res["after-cold"]["index_lines_per_s"] = n / res["after-cold"]["read_s"]
    res["scan"] = scan_rate(path, n)
    if before_tree and n <= before_max:
        res["before"] = run_child(Path(before_tree), path)
    return res


# -- a Ray Dataset through the trainer ---------------------------------------------------------

def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


def _workers_rss(stop: threading.Event, peaks: dict) -> None:
    """Peak VmRSS / RssAnon / RssFile / RssShmem of every train worker (and of the spool task),
    sampled every 0.2 s."""
    import psutil

    me = psutil.Process()
    while not stop.is_set():
        for p in me.children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                kind = "worker" if "RayTrainWorker" in cmd else "spool_task" if "_write" in cmd else None
                if kind is None:
                    continue
                peak = peaks.setdefault((kind, p.pid), {})
                for k, v in _status(p.pid).items():
                    peak[k] = max(peak.get(k, 0), v)
            except (psutil.Error, OSError):
                pass
        time.sleep(0.2)


def ray_run(path: Path, rows: int, storage: Path) -> dict:
    import ray
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo

    ds = ray.data.read_json(str(path))
    if rows < 1_000_000_000:
        ds = ds.limit(rows)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    trainer = DisaggregatedTrainer(
        train_loop_config=dict(lr=1e-3, global_batch_size=4, num_steps=2, seed=0, log_every=1,
                               data_root=str(path.parent), index_dir=str(storage / "spool")),
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=f"rows{rows}", storage_path=str(storage / "runs")),
        datasets={"train": ds})
    peaks, stop = {}, threading.Event()
    watcher = threading.Thread(target=_workers_rss, args=(stop, peaks), daemon=True)
    watcher.start()
    t0 = time.time()
    result = trainer.fit()
    stop.set()
    watcher.join()
    workers = [v for (kind, _), v in sorted(peaks.items()) if kind == "worker"]
    return {"rows": rows, "steps": result.metrics["step"], "fit_s": time.time() - t0,
            "worker_peak_rss": sorted(w["VmRSS"] for w in workers), "workers": workers,
            "spool_task": [v for (kind, _), v in sorted(peaks.items()) if kind == "spool_task"]}


def ray_section(path: Path, rows: int, storage: Path) -> dict:
    import ray

    ray.init(address="local", num_cpus=6, include_dashboard=False)
    try:
        small = ray_run(path, 1000, storage)
        large = ray_run(path, rows, storage)
    finally:
        ray.shutdown()
    growth = [b - a for a, b in zip(small["worker_peak_rss"], large["worker_peak_rss"])]
    return {"small": small, "large": large, "worker_peak_growth": growth,
            "max_worker_peak_growth": max(large["worker_peak_rss"]) - max(small["worker_peak_rss"])}


# -- report ------------------------------------------------------------------------------------

def table(res: dict) -> str:
    mib = 1 << 20
    rows = ["| records | contender | RSS over base, built | B/record | after 1st step | peak over "
            "base | start to 1st step (of which imports) | index scan |",
            "|---|---|---|---|---|---|---|---|"]
    for n, per in res["sizes"].items():
        for name, r in per.items():
            if name == "scan":
                continue
            scan = ""
            if "index_lines_per_s" in r:
                sc = per["scan"]
                scan = (f"{r['index_lines_per_s'] / 1e6:.2f} M lines/s in the worker; alone: median "
                        f"{sc['median_lines_per_s'] / 1e6:.2f}, best {sc['best_lines_per_s'] / 1e6:.2f}")
            rows.append(f"| {int(n):,} | {name} | {r['built_over_base'] / mib:.0f} MiB | "
                        f"{r['bytes_per_record']:.1f} | {r['first_step_over_base'] / mib:.0f} MiB | "
                        f"{r['peak_over_base'] / mib:.0f} MiB | {r['to_first_step_s']:.1f} s "
                        f"({r['start_s']:.1f} s) | {scan} |")
    if "ray" in res:
        r = res["ray"]
        rows.append("")
        rows.append(f"Ray Dataset, 2 steps, 2 workers: peak worker RSS {r['small']['rows']:,} rows "
                    f"{[round(x / mib) for x in r['small']['worker_peak_rss']]} MiB, "
                    f"{r['large']['rows']:,} rows {[round(x / mib) for x in r['large']['worker_peak_rss']]}"
                    f" MiB: growth {[round(x / mib, 1) for x in r['worker_peak_growth']]} MiB, of the "
                    f"largest {r['max_worker_peak_growth'] / mib:.1f} MiB "
                    f"(fit {r['small']['fit_s']:.0f} s vs {r['large']['fit_s']:.0f} s)")
        for part in ("small", "large"):
            w = r[part]
            rows.append(f"- {w['rows']:,} rows: workers' peak RssAnon "
                        f"{[round(x['RssAnon'] / mib) for x in w['workers']]} MiB, RssShmem "
                        f"{[round(x.get('RssShmem', 0) / mib) for x in w['workers']]} MiB; spool task "
                        f"peak VmRSS {[round(x['VmRSS'] / mib) for x in w['spool_task']]} MiB")
    return "\n".join(rows)


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("before", "after-cold", "after-warm"):
        pts = sorted((int(n), per[name]) for n, per in res["sizes"].items() if name in per)
        if pts:
            a.plot([n for n, _ in pts], [r["built_over_base"] / (1 << 20) for _, r in pts], "o-", label=name)
            b.plot([n for n, _ in pts], [r["to_first_step_s"] for _, r in pts], "o-", label=name)
    for ax, title in ((a, "RSS over base after the loader is built (MiB)"),
                      (b, "process start to first step (s)")):
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("records")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--before-tree")
    ap.add_argument("--before-max", type=int, default=1_000_000)
    ap.add_argument("--ray-rows", type=int, default=1_000_000)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--no-scale", action="store_true", help="the Ray Dataset section only")
    ap.add_argument("--dir", default="/tmp/ray_dhp_data_scale")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--tag", default="cpu2")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], float(args.child[1]))))
        return
    root = Path(args.dir)
    res = {"date": datetime.date.today().isoformat(), "sizes": {}}
    try:
        for n in [] if args.no_scale else args.sizes:
            path = generate(root / f"n{n}", n)
            res["sizes"][str(n)] = scale(path, n, args.before_tree, args.before_max)
            print(json.dumps({n: res["sizes"][str(n)]}, indent=1), flush=True)
        if not args.no_ray:
            path = generate(root / f"n{args.ray_rows}", args.ray_rows)
            res["ray"] = ray_section(path, args.ray_rows, root / "ray")
            print(json.dumps(res["ray"], indent=1), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    what = "ray" if args.no_scale else "-".join(str(n) for n in args.sizes)
    stem = f"data-scale-{what}-{args.tag}-{res['date']}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=1))
    if res["sizes"]:
        plot(res, RESULTS / f"{stem}.png")
    print(table(res))


if __name__ == "__main__":
    main()
