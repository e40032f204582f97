"""The plan's expert all-to-all bytes equal what the engine's all-to-alls pass
(`ray_dhp.planning.experts.buffer_bytes`): a tiny ``qwen3_vl_moe`` at EP2, one step of two
micro-batches; each rank's hidden-state buffers (dispatch + combine, forward and backward, and
the recomputed forward with activation checkpointing) are counted by the engine's `CommCounter`
and the tokens each rank routed by a hook on the first router. Per rank the combine buffer holds
the rows it *received* (routing-dependent), so the check is on the sum over the EP group, where
the plan's formula is exact: no tolerance (integers)."""

import dataclasses

import pytest
import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps
from tests.spawn import run_on_ranks

FAMILY = "qwen3_vl_moe"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=1)
EP2 = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1, text_ep=2)


def _body(rank, world, cfg, steps):
    from ray_dhp.parallel.comm import CommCounter
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**EP2), torch.device("cpu"))
    comm = CommCounter()
    engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, cfg.step_config(), comm=comm, dtype=torch.float64)
    router = next(m for n, m in engine.text_model.named_modules() if n.endswith("mlp.gate"))
    rows = []
    router.register_forward_hook(lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1]))
    engine.step(steps[0])
    return {"comm": comm.as_dict(), "rows": rows}


@pytest.mark.parametrize("checkpointing", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain", "activation-checkpointing"])
def test_expert_all_to_all_bytes_equal_the_plan(checkpointing, tmp_path):
    from ray_dhp.planning.experts import buffer_bytes, sparse_layer_count

    cfg = dataclasses.replace(CFG, activation_checkpointing=checkpointing)
    steps = make_steps(tmp_path, FAMILY, cfg)
    outs = run_on_ranks(_body, 2, args=(cfg, steps))
    config = demo.tiny_model_config(FAMILY)
    measured = planned = 0
    for o in outs:
        c = o["comm"]
        fwd, bwd = c["all_to_all/text.experts"], c["all_to_all/text.experts.grad"]
        measured += fwd["bytes"] + bwd["bytes"]
        # the router runs once per micro-batch forward (twice with the block recomputed)
        per_forward = o["rows"][::2] if checkpointing else o["rows"]
        assert len(per_forward) == cfg.optim.micro_batches, o["rows"]
        layers = sparse_layer_count(config)  # dispatch + combine per layer and forward pass
        forwards = cfg.optim.micro_batches * (2 if checkpointing else 1)
        assert (fwd["calls"], bwd["calls"]) == (2 * layers * forwards, 2 * layers * cfg.optim.micro_batches), c
        planned += sum(buffer_bytes(config, t, 1, checkpointing, 8) for t in per_forward)
    assert measured == planned, (measured, planned)
