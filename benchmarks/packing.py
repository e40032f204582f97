"""Packing, measured (issue #43): tokens/s, padding and per-replica balance of one SFT-like length
mix trained four ways, side by side in one run on the same ranks, model and samples.

The mix, in the shape of LLaVA-style instruction data (`make_mix`): 1-3 turns, 20-1,000 text
tokens a sample (log-uniform), 0-2 images of mixed resolution (56..168 px), a quarter
text-only. The contenders, each the DHP engine collocated on ``--ranks`` ranks (vision DP =
text DP = ranks), fp32, the same steps of ``--batch`` samples:

* ``padding``: ``balance: count``: each text replica pads its contiguous share of a
  micro-batch to its longest sample, one row per sample;
* ``padded-groups``: ``balance: cost`` (the default): replicas balanced by the cost model,
  each replica's samples padded in groups of similar length;
* ``packed``: ``packing: true``: each replica's samples packed into rows of ``--max-tokens``,
  laid out first fit decreasing (`ray_dhp.parallel.packed_rows.pack_order`);
* ``packed-in-order``: the same packed rows cut in the replica's sample order, as before
  issue #43's row-tail fix (the engine's balancer without ``max_tokens``: no `pack_order`).

Per contender: median step time over the timed steps, real tokens per second (tokens of the
samples, image placeholders included), the padding fraction (1 - real / tokens the text
forward ran, rows x row length summed over replicas) and the per-replica text cost max/mean
(`ray_dhp.parallel.balance.CostModel.text` of the samples each replica ran, the worst step's
and the mean), and the CPU seconds of a step (both ranks' process CPU time summed, the median
over every round's steps: on a machine shared with other jobs their time slices count in the
wall time, not in this). Nothing here asserts.

With ``--repeat N`` the contenders run in turn N times and each reports its quickest
round (a shared machine's busy spells then hit every contender). ``--modes`` runs some of them
(comma-separated, in that order each round).

``--text wide`` widens the language model (`WIDE_TEXT`: the "Qwen3.5 tiny-wide shape", hidden 256,
4 layers in Qwen3.5's 3:1 order of Gated DeltaNet and full attention, 64-dim attention heads),
where the LM's per-token work dominates a step; the vision tower stays the demo's.

``--device cuda`` runs each rank on a GPU of its own (NCCL; ``--precision bf16_mixed`` for a GPU's
policy): `benchmarks/gpu/run_gpu.py --packing` runs the contenders that way on one GPU.

Run: ``python -m benchmarks.packing [--ranks 2] [--family qwen2_5_vl] [--text demo|wide] [--steps 4]
[--repeat 2] [--modes packed-in-order,packed] [--device cuda --precision bf16_mixed]``; writes
``benchmarks/results/packing-<family>[-wide]-<hw>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MODES = ("padding", "padded-groups", "packed-in-order", "packed")
_WORDS = ("red", "green", "blue", "yellow", "circle", "square", "triangle", "one", "two", "three",
          "shape", "image", "the", "a", "of", "and", "is", "in", "picture", "colour")
_SIZES = ((56, 56), (84, 56), (112, 84), (168, 112), (56, 112))


# The LM of "a Qwen3.5 tiny-wide shape" (issue #43): 4x the demo's width, Qwen3.5's layer order
# (three Gated DeltaNet layers, then one gated full-attention layer), 64-dim heads. Keys a text
# config lacks are skipped; a decoder without linear attention keeps its one layer kind.
WIDE_TEXT = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                 linear_key_head_dim=32, linear_value_head_dim=32)


def model_config(family: str, text: str = "demo"):
    """The demo's tiny config of ``family``, its LM widened for ``text="wide"`` (`WIDE_TEXT`)."""
    from ray_dhp import demo

    config = demo.tiny_model_config(family)
    if text == "demo":
        return config
    tc = config.text_config
    kinds = getattr(tc, "layer_types", None)
    for k, v in WIDE_TEXT.items():
        if k == "layer_types":  # a decoder without linear attention keeps its one kind
            if not kinds:
                continue
            v = v if "linear_attention" in kinds else [kinds[0]] * WIDE_TEXT["num_hidden_layers"]
        if hasattr(tc, k):
            setattr(tc, k, v)
    rope = getattr(tc, "rope_parameters", None) or {}
    if "mrope_section" in rope:  # the demo's split of the frequency pairs, scaled to the new heads
        pairs = int(WIDE_TEXT["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        old = rope["mrope_section"]
        rope["mrope_section"] = [x * pairs // sum(old) for x in old]
    config.vision_config.out_hidden_size = tc.hidden_size
    return config


def _text(rng, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def make_mix(path: str, num: int, seed: int = 0) -> str:
    """Write ``num`` LLaVA-format records of the SFT-like mix (see the module docstring) with
    their images under ``path``; returns the ``data.jsonl`` path."""
    from PIL import Image

    rng = random.Random(seed)
    os.makedirs(os.path.join(path, "images"), exist_ok=True)
    lines = []
    for i in range(num):
        total = int(math.exp(rng.uniform(math.log(20), math.log(1000))))  # text tokens (~words)
        turns = rng.randint(1, 3)
        n_images = 0 if rng.random() < 0.25 else rng.randint(1, 2)
        images = []
        for k in range(n_images):
            w, h = rng.choice(_SIZES)
            name = f"images/{i:05d}_{k}.png"
            Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3))).save(
                os.path.join(path, name))
            images.append(name)
        per_turn = max(2, total // turns)
        conv = []
        for t in range(turns):
            ask = _text(rng, per_turn // 3)
            if t == 0 and images:
                ask = "<image>\n" * len(images) + ask
            conv += [{"from": "human", "value": ask}, {"from": "gpt", "value": _text(rng, per_turn - per_turn // 3)}]
        record = {"id": i, "conversations": conv}
        if images:
            record["image"] = images if len(images) > 1 else images[0]
        lines.append(json.dumps(record))
    out = os.path.join(path, "data.jsonl")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def _config(mode: str, batch: int, max_tokens: int, precision: str = "fp32"):
    from ray_dhp.config.train_loop import TrainLoopConfig

    return TrainLoopConfig(lr=1e-4, global_batch_size=batch, num_steps=10_000, max_grad_norm=1.0,
                           seed=0, balance="count" if mode == "padding" else "cost",
                           packing=mode.startswith("packed"), max_tokens=max_tokens,
                           precision=precision)


def _body(rank, world, family, mode, data, batch, max_tokens, steps, warmup, text="demo",
          precision="fp32", on="cpu"):
    import time

    import torch
    import torch.distributed as dist

    from ray_dhp import demo
    from ray_dhp.data import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.step.microbatch import balancer_for, cost_model_of

    cfg = _config(mode, batch, max_tokens, precision)
    cuda = on == "cuda"  # one GPU per rank (`spawn(..., backend="cuda:nccl")` set this rank's)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    groups = build_groups(Topology.build(placement="collocated", vision_dp=world, vision_sp=1,
                                         text_dp=world, text_tp=1), device)
    config = model_config(family, text)
    engine = DHPEngine(config, groups, cfg.step_config())
    if mode == "packed-in-order":  # no row budget in the balancer: replicas' samples in order
        engine._balancer = balancer_for(cfg.optim.balance, config, packing=True)
    sampler = StepSampler(read_annotations(data), demo.tiny_processor(family), resolve_data_root(data), cfg.sampler_config())
    cost = cost_model_of(config)
    ran = {"tokens": 0, "cost": 0}
    inner = engine._text_batch

    def counted(samples):
        out = inner(samples)
        ran["tokens"] += int(out["input_ids"].numel())
        ran["cost"] += sum(cost.text(len(s.input_ids)) for s in samples)
        return out

    engine._text_batch = counted
    times, cpu, real, padded, imbalance = [], [], [], [], []
    for k in range(warmup + steps):
        step = sampler.next_step()
        ran.update(tokens=0, cost=0)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step(step)
        if cuda:
            torch.cuda.synchronize(device)
        spent = time.process_time() - c0  # this rank's CPU seconds (not others' jobs' time)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        per = torch.tensor([ran["tokens"], ran["cost"], spent], dtype=torch.float64, device=device)
        every = [torch.zeros_like(per) for _ in range(world)]
        dist.all_gather(every, per)
        if k < warmup:
            continue
        times.append(elapsed)
        cpu.append(sum(float(e[2]) for e in every))
        real.append(sum(len(s.input_ids) for mb in step for s in mb))
        padded.append(sum(float(e[0]) for e in every))
        costs = [float(e[1]) for e in every]
        imbalance.append(max(costs) / statistics.mean(costs))
    return {"times": times, "cpu": cpu, "real": real, "padded": padded, "imbalance": imbalance}


def run(family: str, ranks: int, batch: int, max_tokens: int, steps: int, warmup: int,
        num: int, workdir: str, repeat: int = 1, modes=MODES, text: str = "demo",
        device: str = "cpu", precision: str = "fp32", timeout_s: float = 1800.0) -> dict:
    from ray_dhp.train.launch import spawn

    data = make_mix(os.path.join(workdir, "mix"), num)
    out = {"family": family, "text": text, "device": device, "precision": precision, "ranks": ranks, "batch": batch, "max_tokens": max_tokens,
           "steps": steps, "samples": num, "repeat": repeat, "modes": {}}
    runs: dict = {mode: [] for mode in modes}
    backend = "cuda:nccl" if device == "cuda" else "gloo"
    for _ in range(repeat):  # round robin: a busy spell of a shared machine hits every contender
        for mode in modes:
            args = (family, mode, data, batch, max_tokens, steps, warmup, text, precision, device)
            runs[mode].append(spawn(_body, ranks, args, backend=backend, timeout_s=timeout_s)[0])
    for mode in modes:
        r = min(runs[mode], key=lambda x: statistics.median(x["times"]))  # the quietest round
        t = statistics.median(r["times"])
        real = statistics.mean(r["real"])
        cpu = statistics.median(c for x in runs[mode] for c in x["cpu"])  # every round's steps
        out["modes"][mode] = {
            "step_s": t, "tokens_per_s": real / t, "cpu_s_per_step": cpu,
            "padding_fraction": 1 - sum(r["real"]) / sum(r["padded"]),
            "cost_max_over_mean": max(r["imbalance"]), "cost_max_over_mean_avg": statistics.mean(r["imbalance"]),
            "raw": r, "step_s_per_round": [statistics.median(x["times"]) for x in runs[mode]],
            "cpu_s_per_round": [statistics.median(x["cpu"]) for x in runs[mode]]}
        print(f"[packing] {mode:16s} step {t:.3f}s  {real / t:8.0f} tok/s  cpu {cpu:.3f}s  padding "
              f"{out['modes'][mode]['padding_fraction']:.1%}  cost max/mean {max(r['imbalance']):.3f}",
              flush=True)
    tps = {m: v["tokens_per_s"] for m, v in out["modes"].items()}
    if "packed" in tps and "padded-groups" in tps:
        out["packed_over_padded_groups"] = tps["packed"] / tps["padded-groups"]
    if "packed" in tps and "packed-in-order" in tps:
        out["packed_over_packed_in_order"] = tps["packed"] / tps["packed-in-order"]
        out["packed_in_order_over_packed_cpu"] = (out["modes"]["packed-in-order"]["cpu_s_per_step"]
                                                  / out["modes"]["packed"]["cpu_s_per_step"])
        # per round, the two packed contenders' median steps side by side (they ran in turn)
        out["packed_in_order_over_packed_per_round"] = [
            statistics.median(a["times"]) / statistics.median(b["times"])
            for a, b in zip(runs["packed-in-order"], runs["packed"])]
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    modes = list(res["modes"])
    colors = [{"padding": "#999", "padded-groups": "#69c", "packed-in-order": "#e9a"}.get(m, "#c63")
              for m in modes]
    a.bar(modes, [res["modes"][m]["tokens_per_s"] for m in modes], color=colors)
    a.set_ylabel("real tokens / s")
    b.bar(modes, [100 * res["modes"][m]["padding_fraction"] for m in modes], color=colors)
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    b.set_ylabel("padding (% of tokens run)")
    fig.suptitle(f"packing, {res['family']} tiny{'-wide' if res.get('text') == 'wide' else ''}, {res['ranks']} ranks, batch {res['batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--text", choices=("demo", "wide"), default="demo",
                   help="the LM's shape: the demo's, or WIDE_TEXT (a Qwen3.5 tiny-wide shape)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--hw", default="cpu2")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, NCCL (benchmarks/gpu/run_gpu.py runs it on one)")
    p.add_argument("--precision", default="fp32", help="the precision policy (fp32, bf16_mixed, ...)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated contenders, run in this order each round (default: {','.join(MODES)})")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of the four contenders, in turn; each takes its quickest round")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        res = run(a.family, a.ranks, a.batch, a.max_tokens, a.steps, a.warmup, a.samples, d, a.repeat,
                  tuple(a.modes.split(",")), a.text, a.device, a.precision)
    res["date"] = datetime.date.today().isoformat()
    os.makedirs(RESULTS, exist_ok=True)
    shape = "" if a.text == "demo" else f"-{a.text}"
    stem = os.path.join(RESULTS, f"packing-{a.family}{shape}-{a.hw}-{res['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, stem + ".png")
    ratios = "; ".join(f"{k}: {res[k]:.2f}x" for k in ("packed_over_padded_groups", "packed_over_packed_in_order")
                       if k in res)
    print(f"[packing] {ratios}; wrote {stem}.json/.png")


if __name__ == "__main__":
    main()
