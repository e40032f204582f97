"""Checkpoint I/O: how long a save holds the training step, how long to a durable checkpoint,
how long a load takes, and what our integrity layer costs against plain DCP.

Part 1 (2 gloo ranks, side by side in one world, interleaved, ``--repeats`` rounds): the
parameter shapes of the start-up benchmark's real-width Qwen2.5-VL (`benchmarks.startup_memory.
model_config`: 7B text width — hidden 3584, vocab 152064, MLP 18944 — 2 text layers, 8 ViT
blocks of width 1280; 1.76 B parameters), every tensor sharded over the 2 ranks along dim 0 as
DTensors, in bf16: 3.3 GiB of state in total (weights only: the shared 24 GiB machine cannot hold
two ranks' AdamW state plus a staging copy; the cost per byte is what is compared). Contenders
for a save:

* ``memcpy`` — copying the state once in memory into the staging buffers (the reference for
  the asynchronous path's goal: blocked <= 1.5x this), measured beside each ``async`` staging:
  ``PAIRS`` adjacent (memcpy, staging) pairs per round, in alternating order, into the same
  buffers (allocated and touched once before round 1, as `BackgroundWriter.reserve` does in a
  run), each pair's wall and CPU seconds and page faults recorded; the first staging, which
  allocates the buffers, is recorded apart (``first_staging_per_rank``);
* ``dcp`` — plain ``dcp.save`` (fsynced files), no integrity layer;
* ``sync-before`` — the former save: ``dcp.save``, then every written file read back for its
  SHA-256, then the commit;
* ``sync`` — ours, synchronous: checksums computed while DCP writes, commit
  (`ray_dhp.checkpointing.checkpoint.write`);
* ``async`` — ours, background (`ray_dhp.checkpointing.staging`): blocked = staging into the
  reused host buffers (median of the round's pairs); durable = that plus the write in a thread
  until every rank has committed.

and for a load (into the same, already allocated tensors): ``dcp`` (plain ``dcp.load``),
``sync-before`` (SHA-256 of every file, split over the ranks, then ``dcp.load``), ``ours``
(`load_first_intact` with the item checksums checked as DCP reads them). The files were just
written, so loads read from the page cache (a cold read adds the storage's read time to all
three alike; the former path read every byte twice).

Part 2 (2 ranks, collocated SP=2 / TP=2, the ``vitheavy-wide`` model of `benchmarks.shapes`, fp32,
each in fresh processes): peak RSS to the end of the second step (``STEPS``: a fresh start's
first step runs without AdamW moments, which its first update creates; a resumed run has them
from the load on, so its first step is any later step's; the peak after step 1 is recorded
too) and time to the end of the first step, of a fresh start, of a resume onto an unfilled
(meta-built) engine (ours), and of the former resume (initial weights built first, then
overwritten by the load). The fresh start then writes the checkpoint the resumes load through
`BackgroundWriter` (``staging_on_engine``: seconds to reserve the buffers, a save point's
blocked time — capture of the engine's state plus staging — and one plain copy of the same
tensors).

Part 3: checksum rates in memory (one core): SHA-256, zlib CRC32, XXH3-128.

    python -m benchmarks.checkpoint_io [--repeats 2] [--out benchmarks/results] [--tiny]
    python -m benchmarks.checkpoint_io --only resume   # part 2 alone
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import tempfile
import time

from benchmarks.checkpoint_resume import RESUMES, _resume_body, _resume_goal, _resume_rows, run_resume

RESULTS = os.path.join(os.path.dirname(__file__), "results")
GIB = 1024 ** 3
SAVES = ("memcpy", "dcp", "sync-before", "sync", "async")
LOADS = ("dcp", "sync-before", "ours")


def _shapes(tiny: bool) -> dict:
    import torch

    from ray_dhp.models.loading import build_meta_model

    if tiny:
        from benchmarks.shapes import model_config as small

        config = small("vitheavy")
    else:
        from benchmarks.startup_memory import model_config

        config = model_config()
    meta = build_meta_model(config, dtype=torch.bfloat16).module
    return {n: tuple(p.shape) for n, p in meta.named_parameters()}


def _state(shapes: dict, rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shape in shapes.items():
        split = shape[0] % world == 0
        local_shape = (shape[0] // world,) + shape[1:] if split else shape
        local = torch.empty(local_shape, dtype=torch.bfloat16).uniform_(-1, 1)
        out[name] = DTensor.from_local(local, mesh, [Shard(0) if split else Replicate()],
                                       run_check=False)
    return {"model": out}


def _barrier_max(seconds: float) -> float:
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seconds)
    return max(every)


def _sha256_files(d: str, names) -> None:
    import hashlib

    for n in names:
        h = hashlib.sha256()
        with open(os.path.join(d, n), "rb") as f:
            while b := f.read(8 << 20):
                h.update(b)


def _window(fn) -> dict:
    """Run ``fn()``; its wall seconds, this thread's CPU seconds and the process's page faults
    (a wall time far above the CPU time: the thread waited, e.g. for a core of the shared
    machine; minor faults: pages touched for the first time)."""
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": wall, "cpu": cpu, "minflt": r1.ru_minflt - r0.ru_minflt,
            "majflt": r1.ru_majflt - r0.ru_majflt}


def _memcpy(state: dict, buffers: dict) -> None:
    for k, v in state["model"].items():
        buffers[f"/model/{k}"].copy_(v._local_tensor)


PAIRS = 3  # memcpy / staging pairs per round (each one in-memory copy of the state)


def _async_one(state: dict, d: str, buffers: dict, writer, snap_meta, r: int) -> dict:
    """The asynchronous save: ``PAIRS`` adjacent pairs of (one plain in-memory copy of the
    state, the staging of the save) into the same reused buffers, in alternating order, then
    the background write of the last staged snapshot. Both contenders of a pair see the same
    machine state (the same preceding write, the same neighbours)."""
    import threading

    import torch
    import torch.distributed as dist

    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.checkpointing.staging import stage

    pairs, snap = [], None
    for i in range(PAIRS):
        out = {}

        def staging():
            nonlocal snap
            snap = checkpoint.Snapshot(stage(state, buffers, pin=False),
                                       {"torch": torch.get_rng_state()}, snap_meta)

        for kind in (("memcpy", "async") if (r + i) % 2 == 0 else ("async", "memcpy")):
            dist.barrier()
            out[kind] = _window(staging if kind == "async" else lambda: _memcpy(state, buffers))
        pairs.append(out)
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    t = threading.Thread(target=checkpoint.write, args=(d, snap, writer.group))
    t.start()
    t.join()
    write, cpu = time.perf_counter() - t0, time.process_time() - c0
    blocked = _barrier_max(_median([p["async"]["wall"] for p in pairs]))
    return {"blocked": blocked, "durable": blocked + _barrier_max(write),
            "write_cpu": _barrier_max(cpu), "pairs": pairs}


def _save_one(kind: str, state: dict, d: str, buffers: dict, writer, r: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ray_dhp.checkpointing import checkpoint, integrity

    rank = dist.get_rank()
    snap_meta = {"format_version": checkpoint.FORMAT_VERSION, "step": 1} if rank == 0 else None
    if kind == "async":  # the step is blocked only while staging
        return _async_one(state, d, buffers, writer, snap_meta, r)
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    if kind == "dcp":
        dcp.save(state, checkpoint_id=d)
    elif kind == "sync-before":
        dcp.save(state, checkpoint_id=d)
        mine = [n for n in os.listdir(d) if n.startswith(f"__{rank}_")]
        _sha256_files(d, mine)
        dist.barrier()
        if rank == 0:
            _sha256_files(d, [".metadata"])
            integrity.commit(d, {**snap_meta, "files": {}})
    else:  # sync
        checkpoint.write(d, checkpoint.Snapshot(state, {"torch": torch.get_rng_state()}, snap_meta))
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"blocked": _barrier_max(total), "durable": _barrier_max(total),
            "write_cpu": _barrier_max(cpu)}


def _load_one(kind: str, state: dict, d: str) -> float:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ray_dhp.checkpointing import checkpoint, integrity
    from ray_dhp.checkpointing.hashing import VerifyingReader

    dist.barrier()
    t0 = time.perf_counter()
    if kind == "dcp":
        dcp.load(state, checkpoint_id=d)
    elif kind == "sync-before":
        names = sorted(n for n in os.listdir(d) if n.endswith(".distcp") or n == ".metadata")
        _sha256_files(d, names[dist.get_rank()::dist.get_world_size()])
        dist.barrier()
        dcp.load(state, checkpoint_id=d)
    else:
        checkpoint.load_first_intact(d, lambda c, meta: dcp.load(
            state, storage_reader=VerifyingReader(c, integrity.shard_chunks(meta))))
    return _barrier_max(time.perf_counter() - t0)


def _io_body(rank, world, shapes, repeats, root):
    import torch.distributed as dist

    from ray_dhp.checkpointing.staging import BackgroundWriter, stage, staged_bytes

    state = _state(shapes, rank, world)
    writer = BackgroundWriter("cpu")
    buffers: dict = {}
    dist.barrier()
    # The first staging allocates the buffers: what every save point would pay without
    # BackgroundWriter.reserve (the run allocates them once, after its first step).
    first = _window(lambda: stage(state, buffers, pin=False))
    local_bytes = staged_bytes(buffers)
    writes = [k for k in SAVES if k != "memcpy"]  # memcpy is measured beside each staging
    saves = {k: [] for k in writes}
    loads = {k: [] for k in LOADS}
    d = os.path.join(root, "ckpt")
    for r in range(repeats):
        for kind in writes[r % len(writes):] + writes[:r % len(writes)]:
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
            saves[kind].append(_save_one(kind, state, d, buffers, writer, r))
        if rank == 0:  # the last write is ours (sync or async): a complete checkpoint to load
            shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
        _save_one("sync", state, d, buffers, writer, r)
        for kind in LOADS[r % len(LOADS):] + LOADS[:r % len(LOADS)]:
            loads[kind].append(_load_one(kind, state, d))
    files = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".distcp"))
    return {"saves": saves, "loads": loads, "local_bytes": local_bytes, "distcp_bytes": files,
            "first_staging": first,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _rates(tiny: bool) -> dict:
    import hashlib
    import zlib

    import xxhash

    buf = memoryview(os.urandom((16 if tiny else 256) << 20))
    out = {}
    for name, f in (("sha256", lambda: hashlib.sha256(buf).digest()),
                    ("crc32", lambda: zlib.crc32(buf)),
                    ("xxh3_128", lambda: xxhash.xxh3_128(buf).digest())):
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            best = max(best, len(buf) / (time.perf_counter() - t0) / GIB)
        out[name] = round(best, 2)
    return out


def _pairs(io) -> list:
    """Every (memcpy, staging) pair of the asynchronous contender, each metric the slowest
    rank's (the step waits for the slowest)."""
    out = []
    for r, sample in enumerate(io[0]["saves"]["async"]):
        for i in range(len(sample["pairs"])):
            every = [o["saves"]["async"][r]["pairs"][i] for o in io]
            out.append({k: {m: max(e[k][m] for e in every) for m in every[0][k]}
                        for k in ("memcpy", "async")})
    return out


def _cpu_ratio(pairs) -> float:
    """Median over the pairs of staging CPU seconds / memcpy CPU seconds."""
    return _median([p["async"]["cpu"] / max(p["memcpy"]["cpu"], 1e-9) for p in pairs])


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def run(repeats: int, out_dir: str, tiny: bool) -> dict:
    from ray_dhp.train.launch import spawn

    root = tempfile.mkdtemp(prefix="ckpt_io_", dir=os.environ.get("CKPT_IO_DIR"))
    try:
        shapes = _shapes(tiny)
        params = sum(__import__("math").prod(s) for s in shapes.values())
        io = spawn(_io_body, 2, (shapes, repeats, root))
        resume = {m: spawn(_resume_body, 2, (m, root, tiny)) for m in RESUMES}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r0 = io[0]
    result = {
        "date": datetime.date.today().isoformat(), "machine": "2 CPU cores, gloo, shared (noisy)",
        "params_total": params, "dtype": "bfloat16", "ranks": 2,
        "state_bytes_per_rank": [o["local_bytes"] for o in io],
        "shard_file_bytes_total": r0["distcp_bytes"], "repeats": repeats,
        "raw": {"saves": r0["saves"], "loads": r0["loads"]},
        "io_peak_rss_per_rank": [o["peak_rss"] for o in io],
        "staging_pairs": _pairs(io), "pairs_per_round": PAIRS,
        "first_staging_per_rank": [o["first_staging"] for o in io],
        "resume": _resume_rows(resume), "staging_on_engine": resume["fresh"][0]["staging"],
        "hash_rates_gib_s": _rates(tiny),
    }
    summarise(result)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"checkpoint-io{'-tiny' if tiny else ''}-cpu2-{result['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, stem + ".png")
    return result


def summarise(result: dict) -> None:
    """Add the medians and the goals to ``result`` from its raw samples (``raw``: rank 0's
    writes and loads, each already the slowest rank's; ``staging_pairs``)."""
    raw, pairs = result["raw"], result["staging_pairs"]
    save = {k: {m: _median([x[m] for x in raw["saves"][k]]) for m in ("blocked", "durable")}
            for k in SAVES if k != "memcpy"}
    # memcpy and staging: the median over the same pairs (the step is blocked by one staging)
    for k in ("memcpy", "async"):
        save.setdefault(k, {})["blocked"] = _median([p[k]["wall"] for p in pairs])
    save["memcpy"]["durable"] = save["memcpy"]["blocked"]
    result["save_s"] = {k: save[k] for k in SAVES}
    result["load_s"] = {k: _median(raw["loads"][k]) for k in LOADS}
    result["blocked_cpu_s"] = {k: _median([p[k]["cpu"] for p in pairs]) for k in ("memcpy", "async")}
    # process CPU seconds of each write (slowest rank; kernel time included: page-cache copies,
    # reclaim), beside the wall seconds that the shared machine's waits stretch
    cpu = result["write_cpu_s"] = {  # None: a run from before it was recorded
        k: _median([x["write_cpu"] for x in raw["saves"][k]])
        if all("write_cpu" in x for x in raw["saves"][k]) else None for k in SAVES if k != "memcpy"}
    result["goals"] = {
        "async_blocked_over_memcpy": save["async"]["blocked"] / save["memcpy"]["blocked"],
        "async_blocked_over_memcpy_per_pair_median": _median(
            [p["async"]["wall"] / p["memcpy"]["wall"] for p in pairs]),
        "async_blocked_cpu_over_memcpy_cpu": _cpu_ratio(pairs),
        "integrity_overhead_vs_dcp_save": save["sync"]["durable"] / save["dcp"]["durable"] - 1,
        "integrity_cpu_overhead_vs_dcp_save": cpu["sync"] / cpu["dcp"] - 1 if cpu["dcp"] else None,
        **_resume_goal(result["resume"]),
    }


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(result["save_s"])
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [result["save_s"][n]["blocked"] for n in names], 0.4, label="step blocked")
    a.bar([i + 0.2 for i in x], [result["save_s"][n]["durable"] for n in names], 0.4, label="to durable")
    a.set_xticks(list(x), names)
    a.set_ylabel("seconds (median, slowest rank)")
    a.set_title(f"save, {result['params_total'] / 1e9:.2f} B params bf16, 2 ranks")
    a.legend()
    loads = list(result["load_s"])
    b.bar(loads, [result["load_s"][n] for n in loads])
    b.set_title("load (page cache warm)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--tiny", action="store_true", help="a small state (dry run of every part)")
    p.add_argument("--only", choices=("all", "resume"), default="all")
    args = p.parse_args(argv)
    if args.only == "resume":
        print(json.dumps(run_resume(args.out, args.tiny), indent=1))
    else:
        print(json.dumps(run(args.repeats, args.out, args.tiny)["goals"], indent=1))


if __name__ == "__main__":
    main()
