"""Token-budget micro-batches (``micro_batch_tokens``) change how a step is cut, never the update.

The loss is normalised by the step's target count and gradients are summed over micro-batches, so
any cut of the same samples gives the same update. Checked in fp64 (1e-10, the parity matrix's
tolerance, see test_parity.py) against the single-process reference fed each step as one
micro-batch, on a layout with 2 text replicas (every micro-batch must feed both) and the pipelined
schedule (the number of micro-batches varies from step to step).
"""

from dataclasses import replace

import torch

from ray_dhp.data.budget import cut_micro_batches
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=1, num_steps=3, max_grad_norm=0.5,
                      seed=0, lr_schedule="cosine", warmup_steps=1, weight_decay=0.1)
LAYOUT = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=2, text_tp=1)


def test_token_budget_cut_gives_the_reference_update(tmp_path):
    steps = make_steps(tmp_path, "qwen2_5_vl", CFG)  # one micro-batch of 8 samples per step
    ref = run_reference("qwen2_5_vl", CFG, steps, torch.float64)
    longest = max(s.num_tokens for (mb,) in steps for s in mb)
    budget = 2 * longest  # every replica: about two samples per micro-batch
    cut_steps = []
    for (mb,) in steps:
        cuts = cut_micro_batches([s.num_tokens for s in mb], budget=budget, replicas=2, min_size=2)
        cut_steps.append([mb[r.start:r.stop] for r in cuts])
    counts = [len(s) for s in cut_steps]
    assert all(c >= 2 for c in counts), counts  # the budget really cuts the steps
    cfg = replace(CFG, micro_batch_tokens=budget)
    got = run_engine("qwen2_5_vl", LAYOUT, cfg, cut_steps, torch.float64, schedule="pipelined")
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
