"""The in-rank benchmark bodies: the contender sweep and the 1/SP activation check.

`sweep_body` builds every contender once in one world (same seed, so the same initial model),
then for each vision length runs, interleaved: warm-up steps, one *measured* step per contender
(saved activations, collectives; untimed because the hooks cost time), and ``steps`` timed steps
in rotating contender order with a barrier before each, so machine noise hits every contender
alike. Each rank returns its own numbers; `run.py` merges them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from benchmarks import contenders as C
from benchmarks import measure, shapes


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _peak_cuda(device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def sweep_body(rank, world, opts: dict):
    device = _device(opts["backend"])
    coll, acts = measure.CollectiveCounter(), measure.ActivationCounter()
    rss = measure.RssSampler()
    out = {"rank": rank, "errors": {}, "build_s": {}, "state": {}, "runs": {}}
    with coll.installed():  # before any contender exists: DeepSpeed captures dist functions at init
        config = shapes.model_config(opts["shape"])
        cfg = C.train_config(opts["batch"], opts.get("autocast"))
        built = {}
        for name in opts["contenders"]:
            t0 = time.perf_counter()
            try:
                built[name] = C.build(name, config, cfg, device)
            except Exception as e:  # noqa: BLE001 - recorded, the others still run
                out["errors"][name] = f"{type(e).__name__}: {e}"
            _sync(device)
            out["build_s"][name] = time.perf_counter() - t0
        failed = [n for n in opts["contenders"] if n in out["errors"]]
        ok = {n: c for n, c in built.items() if n not in failed}
        for c in ok.values():
            if c.vision is not None:
                acts.watch_vision(c.vision)
        for length in opts["lengths"]:
            batch = shapes.make_batch(opts["batch"], length, config)
            runs = {n: {"losses": [], "times": []} for n in ok}
            for _ in range(opts["warmup"]):
                for n, c in ok.items():
                    runs[n]["losses"].append(c.step(batch))
            for n, c in ok.items():
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                with acts.count(), coll.counting(), rss.region(f"{n}/{length}"):
                    runs[n]["losses"].append(c.step(batch))
                runs[n]["activations"] = acts.as_dict()
                runs[n]["collectives"] = coll.as_dict()
                runs[n]["cuda_peak"] = _peak_cuda(device)
            names = list(ok)
            for i in range(opts["steps"]):
                for n in names[i % len(names):] + names[:i % len(names)]:
                    _sync(device)
                    t0 = time.perf_counter()
                    with rss.region(f"{n}/{length}"):
                        runs[n]["losses"].append(ok[n].step(batch))
                        _sync(device)
                    runs[n]["times"].append(time.perf_counter() - t0)
            for n in ok:
                runs[n]["peak_rss"] = rss.peak[f"{n}/{length}"]
            out["runs"][length] = runs
        out["state"] = {n: c.state() for n, c in ok.items()}
    rss.close()
    return out


def text_only_sample(index: int, config):
    s = shapes.make_sample(index, 64, config)
    keep = s.mm_token_type_ids == 0
    s.input_ids, s.labels, s.mm_token_type_ids = s.input_ids[keep], s.labels[keep], s.mm_token_type_ids[keep]
    s.pixel_values = s.image_grid_thw = None
    return s


def sp_scaling_body(rank, world, opts: dict):
    """Vision activation bytes of the DHP engine per rank for SP = 1, 2, ..., world on ONE image
    (the other samples of the batch are text-only): the per-rank share of a long image."""
    device = _device(opts["backend"])
    config = shapes.model_config(opts["shape"])
    batch = [shapes.make_sample(0, opts["length"], config)] + [text_only_sample(i, config) for i in range(1, world)]
    cfg = C.train_config(len(batch), opts.get("autocast"))
    out = {}
    sp = 1
    while sp <= world:
        c = C.DHP(config, cfg, device, sp=sp, tp=world)
        acts = measure.ActivationCounter()
        acts.watch_vision(c.vision)
        with acts.count():
            c.step(batch)
        out[sp] = acts.as_dict()
        del c
        sp *= 2
    return out
