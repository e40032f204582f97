"""Start-up memory per rank: every rank builds the whole model (old) vs meta + local shards (new).

Model: Qwen2.5-VL at 7B text width (hidden 3584, vocab 152064, 28 heads / 4 KV heads, MLP
18944) with 2 text layers and 8 ViT blocks (hidden 1280) — 1.76 B parameters. Layouts:
collocated SP=2 / TP=2 (2 ranks) and disjoint 1 vision + 2 text ranks (TP=2). Sources: random
init from a config, and a saved Hugging Face directory (``save_pretrained`` in 1 GB shards).

Per rank: the runtime base (RSS after imports, process group and groups, before the engine), the
peak RSS after `DHPEngine` construction (``ru_maxrss``), the parameter bytes the rank keeps, and
the goal ``1.25 × kept + largest tensor + base``. The *old* path is the engine's former model
building (``build_model(...).to(device)`` on every rank, then keep the shard; reproduced here from
git history as the "before" contender); the *new* path is `DHPEngine` itself.

Weights are bfloat16 by default (``--dtype float32`` for fp32): the old path needs the whole model
on every rank at once (~7.9 GiB per rank in fp32), which a shared 24 GiB machine without swap
cannot give two or three ranks at a time. Configurations run one after another.

    python -m benchmarks.startup_memory [--dtype bfloat16] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import tempfile

RESULTS = os.path.join(os.path.dirname(__file__), "results")
GIB = 1024 ** 3
LAYOUTS = {
    "collocated SP2/TP2": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2),
    "disjoint 1v+2t (TP2)": dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2),
}


def model_config():
    """7B text width, 2 text layers, 8 ViT blocks (the issue's measurement model)."""
    from ray_dhp.cli.models import config_from_dims
    from ray_dhp.cli.presets import preset_dims

    dims = preset_dims("qwen2_5_vl", "7b")
    dims["text_config"]["num_hidden_layers"] = 2
    dims["vision_config"].update(depth=8, fullatt_block_indexes=[3, 7])
    return config_from_dims(dims, "qwen2_5_vl")


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _old_build(model, groups, cfg, dtype):
    """The former `DHPEngine.__init__` model building: the whole model on every rank, then keep."""
    from ray_dhp.models import build_model, family_of, load_model_config
    from ray_dhp.parallel.tensor import apply_tp_plan

    config = load_model_config(model)
    family = family_of(config)
    full = build_model(model, seed=cfg.optim.seed, dtype=dtype).to(groups.device)
    visual = text = None
    if groups.is_vision:
        visual = family.visual(full)
    if groups.is_text:
        full.model.visual = None
        text = full
        if groups.topology.text.inner > 1:
            apply_tp_plan(full, groups.text_mesh["tp"], family.text_tp_plan(config.text_config))
    return visual, text


def _rank_body(rank, world, layout, model, path_name, dtype_name):
    import torch

    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.models.loading import local_parameter_bytes
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.config.train_loop import TrainLoopConfig

    dtype = getattr(torch, dtype_name)
    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    cfg = TrainLoopConfig(global_batch_size=2, seed=0)
    base = _rss_now()
    if path_name == "old":
        visual, text = _old_build(model, groups, cfg, dtype)
    else:
        engine = DHPEngine(model, groups, cfg.step_config(), dtype=dtype)
        visual, text = engine.visual, engine.text_model
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kept = local_parameter_bytes(visual, text)
    return {"rank": rank, "base": base, "peak": peak, "kept": kept, "after": _rss_now(),
            "roles": ("vision " if groups.is_vision else "") + ("text" if groups.is_text else "")}


def _largest_tensor_bytes(config, dtype) -> int:
    from ray_dhp.models.loading import build_meta_model

    meta = build_meta_model(config, dtype=dtype)
    return max(p.numel() * p.element_size() for p in meta.module.parameters())


def _save_body(rank, world, config, dtype_name, path):
    """Write the model's tensors (uninitialised values: only their sizes matter here) as a
    sharded HF directory, without spending minutes on random init."""
    import torch

    from ray_dhp.models.loading import build_meta_model

    module = build_meta_model(config, dtype=getattr(torch, dtype_name)).module
    module.to_empty(device="cpu")
    module.save_pretrained(path, max_shard_size="1GB")


def _save_directory(config, dtype_name, root) -> str:
    """Save the model once, in a process of its own (its memory is returned when it exits)."""
    from ray_dhp.train.launch import spawn

    path = os.path.join(root, "qwen2_5_vl_7bwidth")
    spawn(_save_body, 1, (config, dtype_name, path))
    return path


# Most telling first (the run is long on a shared 2-core machine; results are written as they come).
ORDER = [("config", "collocated SP2/TP2", "new"), ("directory", "collocated SP2/TP2", "new"),
         ("directory", "collocated SP2/TP2", "old"), ("directory", "disjoint 1v+2t (TP2)", "new"),
         ("directory", "disjoint 1v+2t (TP2)", "old"), ("config", "disjoint 1v+2t (TP2)", "new"),
         ("config", "collocated SP2/TP2", "old")]
# Not run: ("config", "disjoint 1v+2t (TP2)", "old") — three ranks each building the whole model at
# once (~11 GiB together) exceed what a shared 24 GiB machine without swap can give.


def run(dtype_name: str, out_dir: str, order=ORDER) -> dict:
    import torch

    from ray_dhp.train.launch import spawn

    dtype = getattr(torch, dtype_name)
    config = model_config()
    date = datetime.date.today().isoformat()
    result = {"date": date, "dtype": dtype_name, "params": sum(p.numel() for p in _meta_params(config)),
              "largest_tensor_bytes": _largest_tensor_bytes(config, dtype),
              "machine": "cpu2 (2 cores, 24 GiB, shared with other jobs)", "rows": []}
    name = f"startup-memory-7bwidth-{dtype_name}-cpu2-{date}"
    os.makedirs(out_dir, exist_ok=True)
    done_path = os.path.join(out_dir, name + ".json")
    if os.path.isfile(done_path):  # continue an interrupted run of the same day
        with open(done_path) as f:
            result["rows"] = json.load(f)["rows"]
    done = {(r["source"], r["layout"], r["path"]) for r in result["rows"]}
    order = [c for c in order if c not in done]
    tmp = tempfile.mkdtemp(prefix="startup_memory_")
    sources = {"config": config}
    try:
        for source, lname, path_name in order:
            if source == "directory" and "directory" not in sources:
                sources["directory"] = _save_directory(config, dtype_name, tmp)
            layout = LAYOUTS[lname]
            world = 2 if layout["placement"] == "collocated" else 3
            for o in spawn(_rank_body, world, (layout, sources[source], path_name, dtype_name)):
                goal = 1.25 * o["kept"] + result["largest_tensor_bytes"] + o["base"]
                result["rows"].append({"source": source, "layout": lname, "path": path_name, **o,
                                       "goal": goal, "meets_goal": o["peak"] <= goal})
                print(_fmt(result["rows"][-1]), flush=True)
            with open(os.path.join(out_dir, name + ".json"), "w") as f:
                json.dump(result, f, indent=1)
            _plot(result, os.path.join(out_dir, name + ".png"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(result))
    return result


def _meta_params(config):
    from ray_dhp.models.loading import build_meta_model

    return list(build_meta_model(config).module.parameters())


def _fmt(r: dict) -> str:
    return (f"{r['source']:9s} {r['layout']:22s} {r['path']:3s} rank {r['rank']} ({r['roles']}): "
            f"base {r['base'] / GIB:.2f}  peak {r['peak'] / GIB:.2f}  kept {r['kept'] / GIB:.2f} GiB  "
            f"peak/kept {r['peak'] / r['kept']:.2f}  goal {r['goal'] / GIB:.2f} {'ok' if r['meets_goal'] else 'MISSED'}")


def table(result: dict) -> str:
    """The README table: per rank, old vs new side by side."""
    lines = ["| source | layout | rank (role) | kept GiB | old peak GiB (× kept) | new peak GiB (× kept) "
             "| base GiB | goal GiB | new ≤ goal |", "|---|---|---|---|---|---|---|---|---|"]
    old = {(r["source"], r["layout"], r["rank"]): r for r in result["rows"] if r["path"] == "old"}
    for r in (r for r in result["rows"] if r["path"] == "new"):
        o = old.get((r["source"], r["layout"], r["rank"]))
        old_cell = f"{o['peak'] / GIB:.2f} ({o['peak'] / o['kept']:.2f}×)" if o else "not run"
        lines.append(f"| {r['source']} | {r['layout']} | {r['rank']} ({r['roles']}) | {r['kept'] / GIB:.2f} | "
                     f"{old_cell} | "
                     f"{r['peak'] / GIB:.2f} ({r['peak'] / r['kept']:.2f}×) | {r['base'] / GIB:.2f} | "
                     f"{r['goal'] / GIB:.2f} | {'yes' if r['meets_goal'] else 'no'} |")
    return "\n".join(lines)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    new = [r for r in result["rows"] if r["path"] == "new"]
    old = {(r["source"], r["layout"], r["rank"]): r for r in result["rows"] if r["path"] == "old"}
    labels = [f"{r['source']}\n{r['layout'].split(' ')[0]} r{r['rank']}" for r in new]
    x = range(len(new))
    fig, ax = plt.subplots(figsize=(max(8, len(new) * 1.1), 4.5))
    w = 0.27
    ax.bar([i - w for i in x], [old[(r["source"], r["layout"], r["rank"])]["peak"] / GIB
                                if (r["source"], r["layout"], r["rank"]) in old else 0 for r in new], w,
           label="old: peak RSS (0 = not run)")
    ax.bar(list(x), [r["peak"] / GIB for r in new], w, label="new: peak RSS")
    ax.bar([i + w for i in x], [r["kept"] / GIB for r in new], w, label="parameters kept")
    ax.scatter(list(x), [r["goal"] / GIB for r in new], marker="_", s=400, color="k",
               label="goal: 1.25×kept + largest tensor + base", zorder=3)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"Start-up memory per rank, Qwen2.5-VL 7B text width, {result['dtype']} weights")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    run(a.dtype, a.out)


if __name__ == "__main__":
    main()
