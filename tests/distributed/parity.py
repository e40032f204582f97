"""Shared parity harness: DHP engine on spawned gloo ranks vs the single-process reference.

Both sides get the same micro-batches (made once here), seed and hyper-parameters. The engine
side returns, per rank, the loss and grad-norm of every step plus the full parameters it hosts;
the reference gives the same for the unsharded model.
"""

from __future__ import annotations

import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.reference import ReferenceTrainer
from ray_dhp.topology import Topology
from ray_dhp.train_config import TrainLoopConfig
from tests.spawn import run_on_ranks


def make_steps(tmp_path, family: str, cfg: TrainLoopConfig, *, num_samples=16, text_only_every=4,
               image_sizes=((56, 56), (84, 56), (112, 84))):
    path = demo.make_dataset(tmp_path / f"data_{family}", num_samples=num_samples, seed=cfg.seed,
                             text_only_every=text_only_every, image_sizes=image_sizes)
    sampler = StepSampler(read_annotations(path), demo.tiny_processor(family),
                          resolve_data_root(path), cfg)
    return [sampler.next_step() for _ in range(cfg.num_steps)]


def _engine_body(rank, world, family, layout, cfg, steps, dtype, schedule, model=None):
    from ray_dhp.engine import DHPEngine
    from ray_dhp.mesh import build_groups
    from ray_dhp.parallel.comm import CommCounter

    topo = Topology.build(**layout)
    groups = build_groups(topo, torch.device("cpu"))
    comm = CommCounter()
    model = demo.tiny_model_config(family) if model is None else model
    engine = DHPEngine(model, groups, cfg, comm=comm, dtype=dtype, schedule=schedule)
    params0 = engine.named_full_parameters()
    history = [engine.step(mbs) for mbs in steps]
    return {"history": history, "params0": params0, "params": engine.named_full_parameters(),
            "comm": comm.as_dict()}


def run_engine(family: str, layout: dict, cfg: TrainLoopConfig, steps, dtype=torch.float32,
               schedule: str = "sequential", model=None) -> dict:
    """Run the DHP engine; merge every rank's parameters (each full tensor comes from any host).
    ``model``: a model directory or config (default: the family's tiny config)."""
    world = Topology.build(**layout).world_size
    outs = run_on_ranks(_engine_body, world, args=(family, layout, cfg, steps, dtype, schedule, model))
    params, params0 = {}, {}
    for o in outs:
        params.update(o["params"])
        params0.update(o["params0"])
    return {"history": outs[0]["history"], "params": params, "params0": params0,
            "per_rank": outs}


def run_reference(family: str, cfg: TrainLoopConfig, steps, dtype=torch.float32, model=None) -> dict:
    ref = ReferenceTrainer(demo.tiny_model_config(family) if model is None else model, cfg, dtype=dtype)
    params0 = ref.named_parameters()
    history = [ref.step(mbs) for mbs in steps]
    return {"history": history, "params": ref.named_parameters(), "params0": params0}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    den = b.double().norm()
    num = (a.double() - b.double()).norm()
    return float(num / den) if den > 0 else float(num)


def assert_parity(got: dict, ref: dict, *, loss_tol: float, param_tol: float, update_tol: float,
                  skip=()):
    """Loss and grad-norm of every step, then every parameter and its update; returns the worst
    (update error, parameter error, name). ``skip``: name suffixes left out of the tensor checks."""
    assert set(got["params"]) == set(ref["params"]), (
        set(got["params"]) ^ set(ref["params"]))
    for k, (g, r) in enumerate(zip(got["history"], ref["history"])):
        assert abs(g["loss"] - r["loss"]) <= loss_tol * abs(r["loss"]), (k, g["loss"], r["loss"])
        assert abs(g["grad_norm"] - r["grad_norm"]) <= loss_tol * r["grad_norm"], (k, g, r)
    worst = []
    for name, r in ref["params"].items():
        if name.endswith(tuple(skip)):
            continue
        g = got["params"][name]
        assert g.shape == r.shape, name
        e_param = rel_err(g, r)
        e_update = rel_err(g - got["params0"][name], r - ref["params0"][name])
        worst.append((e_update, e_param, name))
        assert e_param <= param_tol, (name, e_param)
        assert e_update <= update_tol, (name, e_update)
    return max(worst)
