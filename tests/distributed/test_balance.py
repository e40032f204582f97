"""Balanced work is exact: with mixed resolutions (16..1024 patches per image, 64x, plus text-only
samples) the cost-balanced plan — samples per vision replica, per text replica (run as several
padded groups) and per micro-batch, none of them contiguous — gives the same loss, grad-norm,
parameters and parameter updates as the single-process reference (fp64, every parameter;
tolerance 1e-10 as in test_parity.py: only summation orders differ, a sample computed twice or
not at all is O(1)).

The reference trains each step as ONE micro-batch, so the test also proves that the balanced
cut into micro-batches does not change the update (the loss is normalised by the step's target
count)."""

import itertools

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.step.engine import layout_micro_batch
from ray_dhp.parallel.balance import contiguous
from ray_dhp.step.microbatch import balancer_for
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import assert_parity, run_engine, run_reference

FAMILY = "qwen2_5_vl"
SIZES = ((56, 56), (448, 448), (112, 112), (56, 56), (224, 224))  # 16, 1024, 64, 16, 256 patches
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=12, micro_batches=2, num_steps=2,
                      max_grad_norm=0.5, weight_decay=0.1, balance="cost")


def _mixed_steps(tmp_path, cfg):
    path = demo.make_dataset(tmp_path / "mixed", num_samples=24, seed=3, text_only_every=4,
                             image_sizes=SIZES)
    sampler = StepSampler(read_annotations(path), demo.tiny_processor(FAMILY, max_side=448),
                          resolve_data_root(path), cfg.sampler_config())
    sampler.balancer = balancer_for(cfg.optim.balance, demo.tiny_model_config(FAMILY))
    return [sampler.next_step() for _ in range(cfg.optim.num_steps)], sampler.balancer


LAYOUTS = [
    ("collocated-dp2-dp2", dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2,
                                text_tp=1), "sequential"),  # the default case: 2 ranks
    pytest.param("collocated-sp2dp2-tp2dp2", dict(placement="collocated", vision_dp=2,
                                                  vision_sp=2, text_dp=2, text_tp=2),
                 "sequential", marks=pytest.mark.slow),
    pytest.param("collocated-sp2dp2-tp2dp2-text-sp", dict(placement="collocated", vision_dp=2,
                                                          vision_sp=2, text_dp=2, text_tp=2,
                                                          text_sequence_parallel=True),
                 "sequential", marks=pytest.mark.slow),
    pytest.param("disjoint-dp2-dp2-pipelined", dict(placement="disjoint", vision_dp=2, vision_sp=1,
                                                    text_dp=2, text_tp=1), "pipelined",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, layout, schedule", LAYOUTS)
def test_balanced_plan_is_exact_with_mixed_resolutions_fp64(tmp_path, name, layout, schedule):
    steps, bal = _mixed_steps(tmp_path, CFG)
    # the data really is mixed, and the plan really is not the contiguous one
    patches = {int(s.image_grid_thw.prod()) for st in steps for mb in st for s in mb
               if s.image_grid_thw is not None}
    assert max(patches) >= 16 * min(patches), patches
    assert any(s.image_grid_thw is None for st in steps for mb in st for s in mb)
    topo = Topology.build(**layout)
    vc = demo.tiny_model_config(FAMILY).vision_config
    lays = [layout_micro_batch(mb, topo, FAMILY, vc, bal) for st in steps for mb in st]
    assert any(lay.vision_samples != contiguous(len(lay.row_offsets) - 1, topo.vision.dp)
               or lay.text_samples != contiguous(len(lay.row_offsets) - 1, topo.text.dp)
               for lay in lays)
    # and some text replica runs its samples as several padded groups (the 276-token sample
    # alone, the short ones together): their feature rows are taken apart and put back
    assert any(len(groups) > 1 for lay in lays for groups in lay.text_groups)
    got = run_engine(FAMILY, layout, CFG, steps, torch.float64, schedule=schedule)
    whole = [[list(itertools.chain(*st))] for st in steps]  # each step as one micro-batch
    ref = run_reference(FAMILY, CFG, whole, torch.float64)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)


@pytest.mark.slow
def test_count_and_cost_balance_give_the_same_update_fp64(tmp_path):
    """Same steps, engine by count vs by cost (2 ranks, vision DP=2 / text DP=2): the same
    update, so switching `balance` never changes what is learned."""
    from dataclasses import replace

    steps, _ = _mixed_steps(tmp_path, CFG)
    layout = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1)
    a = run_engine(FAMILY, layout, CFG, steps, torch.float64)
    b = run_engine(FAMILY, layout, replace(CFG, balance="count"), steps, torch.float64)
    assert_parity(a, b, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
