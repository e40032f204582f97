"""Host optimizer offload (`ray_dhp.step.offload`) is exact: fp64 parity with the single-process
reference (loss, grad-norm, every clipped gradient, every update, every rank's copy) with both
modules' masters and moments on the host, over ZeRO stages 1 and 2; the planner's host/device
split equals the measured bytes; bad combinations fail naming the key.

Tolerance 1e-10 relative (tests/distributed/test_zero.py's): in fp64 the host copies and the
update are the same arithmetic as on the device (torch's AdamW; DeepSpeedCPUAdam has no fp64),
so only the reduction orders of ZeRO differ (~1e-14). DeepSpeedCPUAdam (fp32 masters) is
compared with torch's AdamW in `test_deepspeed_cpu_adam_matches_torch_adamw` (slow: DeepSpeed
compiles its CPU op on first use, minutes).
"""

import pytest
import torch

from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference
from tests.distributed.zero_cases import CFG, COLLOCATED, FAMILY, TOL

LAYOUT = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1)


def test_offload_fp64_parity_stages_1_and_2(tmp_path):
    """Vision stage 2 + text stage 1 at DP2, both offloaded, 2 micro-batches, clipping, cosine
    schedule: equal to the reference; and the planner's host bytes equal the measured ones."""
    from ray_dhp import demo
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.parallel.topology import Topology

    steps = make_steps(tmp_path, FAMILY, CFG)
    ref = run_reference(FAMILY, CFG, steps, torch.float64)
    layout = dict(LAYOUT, vision_zero=2, text_zero=1, vision_offload=True, text_offload=True)
    got = run_engine(FAMILY, layout, CFG, steps, torch.float64, grads=True)
    assert_parity(got, ref, **TOL)
    topo = Topology.build(**layout)
    counts = count_params(demo.tiny_model_config(FAMILY))
    for rank, out in enumerate(got["per_rank"]):
        # the fp64 runs use the fp32 policy in fp64: every planned 4-byte entry holds 8 bytes
        want = rank_state(counts, topo, rank, POLICIES["fp32"])
        held = out["state"]
        assert held["host"] == 2 * want.host > 0, (rank, held, want)
        assert (held["masters"], held["optimizer"]) == (2 * want.masters, 2 * want.optimizer)
        assert held["host"] == held["masters"] + held["optimizer"]
        # the device keeps weights and gradients only
        assert want.device_total == want.weights + want.grads


def test_plan_moves_the_optimizer_to_the_host():
    """bf16_mixed, text DP2 stage 1: offload moves masters + moments (12 B per updated
    parameter) to the host and nothing else."""
    from ray_dhp import demo
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.parallel.topology import Topology

    counts = count_params(demo.tiny_model_config(FAMILY))
    pol = POLICIES["bf16_mixed"]
    on = rank_state(counts, Topology.build(**LAYOUT, text_offload=True), 0, pol)
    off = rank_state(counts, Topology.build(**LAYOUT), 0, pol)
    assert on.total == off.total and off.host == 0
    text_updated = on.updated - counts.vision_updated_by(0, 2, 1)
    assert on.host == 12 * text_updated
    assert on.device_total == off.total - on.host


@pytest.mark.parametrize("kw, key", [
    (dict(COLLOCATED, text_zero=3, text_offload=True), "text.optimizer_offload"),
    (dict(COLLOCATED, text_offload=True), "text.optimizer_offload"),  # TP2: DTensor shards
    (dict(LAYOUT, vision_offload="yes"), "vision.optimizer_offload"),
])
def test_bad_offload_names_the_key(kw, key):
    from ray_dhp.parallel.topology import Topology

    with pytest.raises(ValueError, match=key):
        Topology.build(**kw)


@pytest.mark.slow
def test_deepspeed_cpu_adam_matches_torch_adamw():
    """The host engine for fp32 masters: DeepSpeedCPUAdam (AdamW mode) against torch's AdamW,
    10 steps, decay and no-decay groups, lr changed between steps. fp32-only kernel: agreement
    to 1e-5 relative (its vectorised fp32 arithmetic orders the update's operations differently;
    measured after these 10 steps: max difference 1.7e-7 of the largest weight, 1.1e-4 of the
    largest total update)."""
    from ray_dhp.step.offload import host_adamw
    from ray_dhp.config.train_loop import TrainLoopConfig

    cfg = TrainLoopConfig(lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(10)]
    runs = []
    for make in (host_adamw, lambda groups, c: torch.optim.AdamW(
            groups, lr=c.lr, betas=c.betas, eps=c.eps, foreach=False)):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make([{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}], cfg.optim)
        for i, gs in enumerate(grads):
            for group in opt.param_groups:
                group["lr"] = cfg.optim.lr * (1 - i / 10)
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        runs.append(ps)
    assert type(host_adamw([{"params": [torch.nn.Parameter(init[1].clone())]}], cfg.optim)).__name__ \
        == "DeepSpeedCPUAdam"
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


OFFLOADED = dict(LAYOUT, vision_zero=2, text_zero=1, vision_offload=True, text_offload=True)
ON_DEVICE = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(OFFLOADED, ON_DEVICE), (ON_DEVICE, OFFLOADED)],
                         ids=["offloaded-dp2-to-device-tp2", "device-tp2-to-offloaded-dp2"])
def test_resume_between_offload_and_device_is_exact(before, after, tmp_path, tmp_path_factory):
    """3 steps + save + load at the other layout + 3 steps == 6 reference steps (fp64, torch's
    AdamW on the host: its state is keyed and typed like the device optimizer's)."""
    from tests.distributed.checkpoint_cases import assert_resume_is_exact

    assert_resume_is_exact(before, after, tmp_path, tmp_path_factory)
