"""The bf16_mixed step's measured peak of model-state bytes equals `ray-dhp plan`'s
(`ray_dhp.planning.memory.rank_state(...).step_peak`) within 5%, on every rank.

Measured, not assumed: torch's profiler records every CPU allocation and free (``profile_memory``);
the live bytes at the start of step 2 (weights, fp32 masters, AdamW moments: no gradient yet)
are measured from the engine's tensors, and the running sum of the allocations since then,
taken over the optimizer phase (``record_function`` marks it), gives the peak of that phase:
the bf16 gradients still held, the all-reduce bucket, the fp32 master gradients of one chunk.
AdamW is the CPU's single-tensor loop (two temporaries of one parameter at a time).
"""

from __future__ import annotations


import torch

from ray_dhp import demo
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=2, seed=0, weight_decay=0.1,
                      max_grad_norm=1.0, precision="bf16_mixed")
SP2_TP2 = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
# small chunks and buckets, so that the model has several of each (real defaults: 64 / 32 MiB)
CHUNK = 1 << 18  # 256 KiB of fp32 master gradient per update chunk (the largest tensor)
BUCKET = 1 << 19  # 512 KiB of bf16 gradient per all-reduce bucket


def _config():
    """The tiny model with a 8x wider text MLP: a state of ~4 MB per
    rank, so that the few tens of KB the step's bookkeeping allocates stay far below 5%."""
    config = demo.tiny_model_config(FAMILY)
    config.text_config.intermediate_size = 1024
    return config
MARK = "ray_dhp.test.optimizer_step"


def _live_state(engine) -> int:
    st = engine.state_bytes()
    return st["weights"] + st["masters"] + st["optimizer"]


def _optimizer_peak(prof, base: int) -> int:
    """``base`` + the highest running sum of allocations inside the `MARK` region."""
    events = list(prof.profiler.kineto_results.events())
    (mark,) = [e for e in events if e.name() == MARK]
    t0, t1 = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur, peak = 0, None
    for e in mem:
        cur += e.nbytes()
        if t0 <= e.start_ns() <= t1:
            peak = cur if peak is None else max(peak, cur)
    return base + peak


def _body(rank, world, steps):
    from torch.profiler import ProfilerActivity, profile, record_function

    from ray_dhp.parallel import data_parallel as dp
    from ray_dhp.step import precision
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    precision.CHUNK_BYTES, dp._BUCKET_BYTES = CHUNK, BUCKET
    groups = build_groups(Topology.build(**SP2_TP2), torch.device("cpu"))
    engine = DHPEngine(_config(), groups, CFG.step_config())
    engine.step(steps[0])  # AdamW moments exist from here on
    base = _live_state(engine)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.forward_backward(steps[1])
        with record_function(MARK):
            engine.optimizer_step()
    largest = max(m.numel() for ms in (engine.vision_masters, engine.text_masters) if ms
                  for _, m in ms.pairs)
    # elements this rank all-reduces over replicas: the ViT over the SP group (text: TP1 x DP1)
    reduced = sum(p.numel() for p in engine.vision_params)
    # the vocab-parallel embedding's gradient comes back whole (Replicate) from backward and is
    # held whole while this rank's shard is copied out of it
    replicated = engine.text_model.get_input_embeddings().weight.numel()
    return {"measured": _optimizer_peak(prof, base), "state": engine.state_bytes(),
            "largest": largest, "reduced": reduced, "replicated": replicated}


def test_bf16_mixed_step_peak_equals_the_plan(tmp_path):
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.step_peak import step_peak
    from ray_dhp.step.precision import POLICIES

    steps = make_steps(tmp_path, FAMILY, CFG)
    topo = Topology.build(**SP2_TP2)
    outs = run_on_ranks(_body, topo.world_size, args=(steps,))
    counts = count_params(_config())
    for rank, got in enumerate(outs):
        state = rank_state(counts, topo, rank, POLICIES["bf16_mixed"])
        plan = step_peak(state, POLICIES["bf16_mixed"], got["largest"], got["reduced"], got["replicated"],
                         chunk_bytes=CHUNK, bucket_bytes=BUCKET, fused_adamw=False)
        err = abs(got["measured"] - plan) / plan
        print(f"rank {rank}: measured step peak {got['measured']} B, plan {plan} B ({err:.2%})")
        assert err <= 0.05, (rank, got, plan)
        # no second fp32 copy of the gradients: the accumulated fp32 gradients are the masters'
        assert got["measured"] < state.total + state.masters, (rank, got, plan)
