"""A mixture-of-experts checkpoint resumes exactly at another expert-parallel degree:
3 steps at EP2 + save + load at EP1 + 3 steps == 6 uninterrupted single-process steps (DCP
reshards the experts' ``Shard(0)`` DTensors like any TP shard), also with the experts' optimizer
state partitioned over their EDP replicas when saved (each moment saved once, by its owner). Tolerances as tests/distributed/
test_moe.py: parameters 1e-10, the loss 1e-8 (the stock aux loss's fp32 sums)."""

import os

import pytest
import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import copy_errors, merge_ranks
from tests.spawn import run_on_ranks

FAMILY = "qwen3_vl_moe"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=6, max_grad_norm=1.0,
                      seed=0, lr_schedule="cosine", warmup_steps=2, weight_decay=0.1)
EP2 = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1, text_ep=2)
EP1 = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=2, text_tp=1)
# the experts' AdamW moments partitioned over their 2 EDP replicas (parallel/expert.py)
EP2_EDP2 = dict(placement="collocated", vision_dp=4, vision_sp=1, text_dp=4, text_tp=1, text_ep=2)


def _sampler(data, cfg=CFG):
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler

    return StepSampler(read_annotations(data), demo.tiny_processor(FAMILY), resolve_data_root(data), cfg.sampler_config())


def _body(rank, world, layout, data, root, resume, stop, cfg=CFG):
    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, cfg.step_config(), dtype=torch.float64,
                       init="checkpoint" if resume else "source")
    sampler = _sampler(data, cfg)
    first = checkpoint.load(os.path.join(root, "ckpt"), engine, sampler) if resume else 0
    history = [engine.step(sampler.next_step()) for _ in range(first, stop)]
    if not resume:
        checkpoint.save(os.path.join(root, "ckpt"), engine, sampler)
    return {"history": history, "params": engine.named_full_parameters(), "params0": {}}


@pytest.mark.slow
@pytest.mark.parametrize("first", [EP2, EP2_EDP2], ids=["ep2", "ep2-edp2-partitioned"])
def test_resume_at_another_expert_parallel_degree(first, tmp_path):
    import dataclasses

    from ray_dhp.step.reference import ReferenceTrainer
    from ray_dhp.parallel.topology import Topology

    # a micro-batch feeds every text replica (4 of them in the partitioned case)
    cfg = dataclasses.replace(CFG, global_batch_size=2 * CFG.optim.micro_batches * first["text_dp"] // 2)
    data = str(demo.make_dataset(tmp_path / "data", num_samples=16, seed=0, text_only_every=4))
    sampler = _sampler(data, cfg)
    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), cfg.optim, precision=cfg.precision, dtype=torch.float64)
    ref_history = [ref.step(sampler.next_step()) for _ in range(cfg.optim.num_steps)]
    root = str(tmp_path)
    a = run_on_ranks(_body, Topology.build(**first).world_size,
                     args=(first, data, root, False, 3, cfg))
    b = run_on_ranks(_body, Topology.build(**EP1).world_size, args=(EP1, data, root, True, 6, cfg))
    history = a[0]["history"] + b[0]["history"]
    for k, (g, r) in enumerate(zip(history, ref_history, strict=True)):
        assert abs(g["loss"] - r["loss"]) <= 1e-8 * r["loss"], (k, g["loss"], r["loss"])
    errs = copy_errors(merge_ranks(b)["per_rank"], ref.named_parameters())
    assert errs and max(errs)[0] <= 1e-10, max(errs)
