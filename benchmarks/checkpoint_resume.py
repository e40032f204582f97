"""Part 2 of `benchmarks.checkpoint_io`: peak RSS and time to the first step of a resume
against a fresh start (``python -m benchmarks.checkpoint_io --only resume`` runs it alone; the
module doc of `benchmarks.checkpoint_io` says what is measured)."""

from __future__ import annotations

import datetime
import json
import os
import resource
import shutil
import tempfile
import time

RESUMES = ("fresh", "resume", "resume-before")

RESUME_LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


STEPS = 2  # a fresh start's first step runs without AdamW moments (created in its first
#           update): its second step is the first with the whole training state, as every step
#           of a resumed run; the peak is taken to the end of the second step


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resume_body(rank, world, mode, root, tiny):
    import torch

    from benchmarks.shapes import make_batch, model_config
    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    config = model_config("vitheavy" if tiny else "vitheavy-wide")
    groups = build_groups(Topology.build(**RESUME_LAYOUT), torch.device("cpu"))
    cfg = TrainLoopConfig(global_batch_size=2, seed=0, lr=1e-4)
    batch = make_batch(2, 64, config)
    t0 = time.perf_counter()
    init = "checkpoint" if mode == "resume" else "source"
    engine = DHPEngine(config, groups, cfg.step_config(), init=init)
    loaded = None
    if mode != "fresh":
        checkpoint.load(os.path.join(root, "resume_ckpt"), engine)
        loaded = _peak()
    losses, peaks = [], []
    for k in range(STEPS):
        losses.append(float(engine.step([batch])["loss"]))
        peaks.append(_peak())
        if k == 0:
            t = time.perf_counter() - t0
    out = {"peak_rss": peaks[-1], "peak_rss_by_step": peaks, "peak_rss_after_load": loaded,
           "time_to_first_step_s": t, "loss": losses[0], "losses": losses}
    if mode == "fresh":  # the checkpoint the resumes load, written by the library's async path
        out["staging"] = _staging_of(engine, os.path.join(root, "resume_ckpt"))
    return out


def _staging_of(engine, directory: str) -> dict:
    """`BackgroundWriter` on a real engine (after the measurement): seconds to reserve the
    buffers, a save point's blocked time (`start`: the capture of parameters, AdamW moments,
    positions, then staging) and one plain copy of the same tensors into the same buffers."""
    import torch.distributed as dist

    from benchmarks.checkpoint_io import _barrier_max, _window
    from ray_dhp.checkpointing.checkpoint import train_state
    from ray_dhp.checkpointing.staging import BackgroundWriter, staged_bytes

    class _Pos:
        def state_dict(self):
            return {}

    writer = BackgroundWriter("cpu")
    dist.barrier()
    reserve = writer.reserve(engine)
    flat = {}

    def walk(state, key=""):
        if isinstance(state, dict):
            for k, v in state.items():
                walk(v, f"{key}/{k}")
        elif hasattr(state, "copy_"):
            flat[key] = getattr(state, "_local_tensor", state)

    walk(train_state(engine))
    dist.barrier()
    memcpy = _window(lambda: [writer.buffers[k].copy_(v) for k, v in flat.items()])
    dist.barrier()
    blocked = writer.start(directory, engine, _Pos())
    writer.wait()
    return {"bytes": staged_bytes(writer.buffers), "reserve_s": _barrier_max(reserve),
            "start_blocked_s": _barrier_max(blocked), "memcpy_s": _barrier_max(memcpy["wall"])}


def _resume_rows(resume: dict) -> dict:
    return {m: {"peak_rss_per_rank": [o["peak_rss"] for o in outs],
                "peak_rss_by_step_per_rank": [o["peak_rss_by_step"] for o in outs],
                "peak_rss_after_load_per_rank": [o["peak_rss_after_load"] for o in outs],
                "time_to_first_step_s": max(o["time_to_first_step_s"] for o in outs),
                "losses": outs[0]["losses"]} for m, outs in resume.items()}


def _resume_goal(rows: dict) -> dict:
    """Resume peak / fresh peak (slowest rank), to the end of step 2 and (as measured before)
    of step 1 only."""
    def peak(m, k):
        return max(p[k] for p in rows[m]["peak_rss_by_step_per_rank"])

    return {"resume_peak_over_fresh": peak("resume", -1) / peak("fresh", -1),
            "resume_peak_over_fresh_step1_only": peak("resume", 0) / peak("fresh", 0)}


def run_resume(out_dir: str, tiny: bool) -> dict:
    """Part 2 alone (``--only resume``): the resume memory, re-measured after a change."""
    from ray_dhp.train.launch import spawn

    root = tempfile.mkdtemp(prefix="ckpt_io_", dir=os.environ.get("CKPT_IO_DIR"))
    try:
        resume = {m: spawn(_resume_body, 2, (m, root, tiny)) for m in RESUMES}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"date": datetime.date.today().isoformat(), "layout": RESUME_LAYOUT,
              "model": "vitheavy" if tiny else "vitheavy-wide",
              "resume": _resume_rows(resume), "staging_on_engine": resume["fresh"][0]["staging"]}
    result.update(_resume_goal(result["resume"]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"checkpoint-io-resume{'-tiny' if tiny else ''}-cpu2-"
                                    f"{result['date']}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result
