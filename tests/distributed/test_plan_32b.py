"""The 32B preset at TP=8 (examples/qwen2_5_vl_32b_8gpu.yaml): what rank 0 holds, measured on
the meta device with the real TP plan applied, equals `ray-dhp plan`'s per-rank state.

One spawned process replaces its gloo world by an 8-rank *fake* process group
(``torch.testing``'s FakeStore), so ``parallelize_module`` builds rank 0's DTensor shards of
the meta-device model without 8 processes or any memory; the ViT's ZeRO-1 share comes from the
engine's own partition (`zero1_owners`) over the module's parameters.
"""

from __future__ import annotations

import os

from tests.spawn import run_on_ranks

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "qwen2_5_vl_32b_8gpu.yaml")


def _meta_rank0_body(rank, world, path, policies):
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ray_dhp.models import family_of
    from ray_dhp.parallel.zero import owners as zero1_owners
    from ray_dhp.parallel.tensor import apply_tp_plan, local
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.run_file import load_run_file

    rf = load_run_file(path)
    topo = rf.dhp_config().topology()
    config = rf.dhp_config().model_config()
    family = family_of(config)
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=topo.world_size)
    with torch.device("meta"):
        model = getattr(transformers, family.model_class)._from_config(config, dtype=torch.float32)
    sizes = [p.numel() for _, p in family.visual(model).named_parameters()]
    owners = zero1_owners(sizes, topo.vision.size)
    vision_held = sum(sizes)
    vision_updated = sum(n for n, o in zip(sizes, owners) if o == 0)
    model.model.visual = None
    apply_tp_plan(model, init_device_mesh("cpu", (topo.text.inner,)),
                  family.text_tp_plan(config.text_config))
    text_local = sum(local(p).numel() for p in model.parameters())
    out = {}
    for name in policies:
        p = POLICIES[name]
        held, updated = vision_held + text_local, vision_updated + text_local
        moment = torch.empty((), dtype=p.moment_dtype).element_size()
        out[name] = {"weights": held * p.weight_bytes(), "grads": held * p.grad_bytes(),
                     "masters": 4 * updated if p.master else 0, "optimizer": 2 * moment * updated}
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1)  # what the spawn helper tears down
    return out


POLICIES_CHECKED = ("bf16_autocast", "bf16_mixed", "bf16")


def test_32b_tp8_rank_state_matches_plan():
    from ray_dhp.cli.plan import plan_text
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.run_file import load_run_file

    measured = run_on_ranks(_meta_rank0_body, 1, args=(EXAMPLE, POLICIES_CHECKED))[0]
    for precision in POLICIES_CHECKED:
        rf = load_run_file(EXAMPLE, [f"precision.policy={precision}"])
        dhp = rf.dhp_config()
        want = rank_state(count_params(dhp.model_config()), dhp.topology(), 0,
                          POLICIES[precision])
        for key in ("weights", "grads", "masters", "optimizer"):
            got, plan = measured[precision][key], getattr(want, key)
            assert abs(got - plan) <= 0.02 * max(plan, 1), (precision, key, got, plan)
        text = plan_text(rf, vision_tokens=[1024], text_tokens=512)
        assert f"precision (precision.policy): {precision}" in text
        assert f"state {want.total / 2**30:7.2f} GiB" in text and "start-up peak" in text
