"""Single-GPU step time, tokens/s and MFU of the engine under ``bf16_mixed``, at the demo width
and the 7B text width, with the attention kernels that actually ran in the ViT and the LLM.

One rank (a 1-rank NCCL group on CUDA, gloo on CPU). Per shape: build the engine, one warm-up
step, then ``--steps`` timed steps (CUDA-synchronised), model FLOPs from
`ray_dhp.planning.flops.step_flops`, MFU against the device's dense bf16 peak
(`ray_dhp.planning.flops.peak_flops`; None off the known GPUs). The kernels are read from one
profiled step: every attention op (``scaled_dot_product*``, ``flash*``, ``*attention*`` kernels)
is attributed to the engine phase whose ``ray_dhp.<phase>`` range holds it (vision_fwd /
vision_bwd: the ViT; text_fwd_bwd: the LLM).

    python3 -m benchmarks.gpu.step_bench                      # on the GPU (~2 min)
    python3 -m benchmarks.gpu.step_bench --device cpu --tiny  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ATTENTION = ("scaled_dot_product", "flash", "attention", "fmha")


def shapes_for(tiny: bool) -> dict:
    """name -> (model config, patches per image, samples per step)."""
    from benchmarks.gpu.precision_check import model_config
    from ray_dhp import demo

    if tiny:
        return {"demo-width": (demo.tiny_model_config("qwen2_5_vl"), 64, 1),
                "7b-width(tiny)": (model_config(True), 64, 1)}
    return {"demo-width": (demo.tiny_model_config("qwen2_5_vl"), 1024, 8),
            "7b-width": (model_config(False), 1024, 4)}


def attention_kernels(prof) -> dict:
    """{"vision": [...], "text": [...]}: attention op / kernel names inside each phase's range."""
    events = list(prof.profiler.kineto_results.events())
    ranges = [(e.name().split(".", 1)[1], e.start_ns(), e.start_ns() + e.duration_ns())
              for e in events if e.name().startswith("ray_dhp.")]
    out = {"vision": set(), "text": set()}
    for e in events:
        name = e.name()
        low = name.lower()
        if (name.startswith(("ray_dhp.", "autograd::")) or name.endswith("Backward0")
                or not any(k in low for k in ATTENTION)):
            continue
        for phase, t0, t1 in ranges:
            if t0 <= e.start_ns() <= t1:
                out["text" if phase.startswith("text") else "vision"].add(name)
    return {k: sorted(v) for k, v in out.items()}


def _body(rank, world, tiny, steps):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ray_dhp.planning.flops import peak_flops, step_flops
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig
    from benchmarks import shapes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
    groups = build_groups(topo, device)
    results = []
    for name, (config, patches, batch) in shapes_for(tiny).items():
        cfg = TrainLoopConfig(lr=1e-5, global_batch_size=batch, num_steps=steps + 2,
                              max_grad_norm=1.0, precision="bf16_mixed", prefetch=False)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        engine = DHPEngine(config, groups, cfg.step_config())
        step = [shapes.make_batch(batch, patches, config)]
        engine.step(step)  # warm-up: allocator, kernels, AdamW state
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            engine.step(step)
        times, losses = [], []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            losses.append(engine.step(step)["loss"])
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        best = min(times)
        flops = step_flops(config, count_params(config), step)
        peak = peak_flops(device, "bfloat16")
        tokens = sum(int(s.input_ids.numel()) for s in step[0])
        text_attn = engine.family.language_model(engine.text_model).config._attn_implementation
        results.append({
            "shape": name, "batch": batch, "patches_per_image": patches,
            "params": count_params(config).vision + count_params(config).text,
            "step_s": times, "step_s_min": best, "losses": losses,
            "tokens_per_s": tokens / best, "patches_per_s": batch * patches / best,
            "model_tflops_per_s": flops / best / 1e12, "mfu": None if peak is None else flops / best / peak,
            "attn_implementation": {"vision": engine.visual.config._attn_implementation,
                                    "text": text_attn},
            "attention_kernels": attention_kernels(prof),
            "cuda_peak_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        })
        del engine
        if cuda:
            torch.cuda.empty_cache()
    return results


def versions() -> dict:
    import platform

    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    from importlib import metadata

    for dist in ("flash-attn", "deepspeed", "ray"):  # read, not imported (deepspeed's is slow)
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    a = p.parse_args(argv)
    from ray_dhp.train.launch import spawn

    backend = "cuda:nccl" if a.device == "cuda" else "gloo"
    results = spawn(_body, 1, (a.tiny, a.steps), backend=backend, threads=4, timeout_s=420)[0]
    report = {"versions": versions(), "args": vars(a), "results": results}
    for r in results:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"[step_bench] {r['shape']}: step {r['step_s_min'] * 1e3:.1f} ms, "
              f"{r['tokens_per_s']:.0f} tokens/s, {r['model_tflops_per_s']:.1f} TFLOP/s, MFU {mfu}; "
              f"attention {r['attn_implementation']} kernels {r['attention_kernels']}", flush=True)
    tag = "cpu-tiny" if a.device == "cpu" else report["versions"]["device"].replace(" ", "_")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"gpu-step-{tag}-{time.strftime('%Y-%m-%d')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"[step_bench] wrote {path}")
    return report


if __name__ == "__main__":
    main()
