"""The first thing to run on a lent GPU: the engine on NCCL under a precision policy, at a real width.

One rank, a 1-rank process group with the CUDA backend only (``cuda:nccl``: a CPU tensor sent over
it fails), every collective checked by `ray_dhp.parallel.devcheck.CollectiveDeviceCheck` (a tensor
on another device than the GPU raises). The model is a Qwen2.5-VL with the 7B text width (hidden
3584, 28/4 heads, intermediate 18944, vocab 152064, 2 layers) and the real ViT width (1280, 16
heads, 8 blocks). For each policy: build the engine, run two steps, and record CUDA peak memory
after construction and after the steps next to what `ray-dhp plan` computes (`rank_state`):
model state, start-up peak. Writes ``precision-<device>-<date>.json`` under benchmarks/results/.

    python -m benchmarks.gpu.precision_check                     # on the GPU (~1-2 min)
    python -m benchmarks.gpu.precision_check --device cpu --tiny # gloo dry run, tiny shape
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

REAL_WIDTH = dict(
    vision=dict(depth=8, hidden_size=1280, num_heads=16, intermediate_size=3456, out_hidden_size=3584,
                fullatt_block_indexes=[3, 7], window_size=112, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2),
    text=dict(hidden_size=3584, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
              intermediate_size=18944, vocab_size=152064),
)


def model_config(tiny: bool):
    """The vitheavy benchmark shape (tiny) or the real-width one above."""
    from benchmarks import shapes

    if tiny:
        return shapes.model_config("vitheavy")
    shapes.SHAPES.setdefault("real-width-7b", REAL_WIDTH)
    return shapes.model_config("real-width-7b")


def _peak_bytes(device) -> int:
    import resource

    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _body(rank, world, policy, tiny, patches, batch):
    import torch

    from benchmarks import shapes
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.step_peak import step_peak
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.devcheck import CollectiveDeviceCheck
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
    groups = build_groups(topo, device)
    config = model_config(tiny)
    cfg = TrainLoopConfig(lr=1e-5, global_batch_size=batch, num_steps=2, max_grad_norm=1.0,
                          precision=policy, prefetch=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    engine = DHPEngine(config, groups, cfg.step_config())
    construct_s = time.perf_counter() - t0
    startup_peak = _peak_bytes(device)
    samples = shapes.make_batch(batch, patches, config)
    losses, times = [], []
    with CollectiveDeviceCheck(device, host_groups=[groups.data]) as check:
        for _ in range(2):
            t0 = time.perf_counter()
            losses.append(engine.step([samples])["loss"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    plan = rank_state(count_params(config), topo, 0, POLICIES[policy])
    # the optimizer phase's model-state peak (`ray_dhp.planning.step_peak`): fused AdamW on CUDA
    peak_plan = step_peak(plan, POLICIES[policy], count_params(config).largest,
                          fused_adamw=device.type == "cuda")
    return {
        "policy": policy, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": plan.params, "largest_tensor_elems": count_params(config).largest,
        "plan": {"weights": plan.weights, "grads": plan.grads, "masters": plan.masters,
                 "optimizer": plan.optimizer, "state": plan.total, "startup_peak": plan.startup_peak,
                 "step_peak_state": peak_plan},
        "measured": {**engine.state_bytes(), "startup_peak": startup_peak,
                     "step_peak": _peak_bytes(device)},
        "peak_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
        "construct_s": construct_s, "step_s": times, "losses": losses,
        "checked_collectives": check.calls, "patches_per_sample": patches, "batch": batch,
    }


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the small vitheavy shape")
    p.add_argument("--policies", default="bf16_mixed", help="comma list of precision policies")
    p.add_argument("--patches", type=int, default=None, help="patches per image (default 1024; tiny 256)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    a = p.parse_args(argv)
    from ray_dhp.train.launch import spawn

    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("precision_check: no CUDA device visible; use --device cpu --tiny")
    # CUDA backend only: NCCL refuses a CPU tensor (no gloo twin to hide it); gloo on CPU.
    backend = "cuda:nccl" if a.device == "cuda" else "gloo"
    patches = a.patches or (256 if a.tiny else 1024)
    results = []
    for policy in [x.strip() for x in a.policies.split(",") if x.strip()]:
        r = spawn(_body, 1, (policy, a.tiny, patches, a.batch), backend=backend, threads=4,
                  timeout_s=540)[0]
        results.append(r)
        m, pl = r["measured"], r["plan"]
        print(f"[precision_check] {policy} on {r['device_name']}: state measured "
              f"{m['total'] / 2**30:.3f} GiB vs plan {pl['state'] / 2**30:.3f} GiB; start-up peak "
              f"{m['startup_peak'] / 2**30:.3f} GiB (plan {pl['startup_peak'] / 2**30:.3f}); step peak "
              f"{m['step_peak'] / 2**30:.3f} GiB (plan: state peak {pl['step_peak_state'] / 2**30:.3f} "
              f"GiB + activations); losses {r['losses']}; "
              f"{r['checked_collectives']} collectives checked", flush=True)
    tag = "cpu-tiny" if a.device == "cpu" else results[0]["device_name"].replace(" ", "_")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"precision-{tag}-{time.strftime('%Y-%m-%d')}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(a), "results": results}, f, indent=1)
    print(f"[precision_check] wrote {path}")
    return results


if __name__ == "__main__":
    main()
