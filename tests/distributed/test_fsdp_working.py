"""ZeRO-3's working set with gradient accumulation (issue #42): over a step of two micro-batches,
the most FSDP2 holds unsharded on a rank (`benchmarks.fsdp_sampling`: gathered weights,
prefetched all-gathers, unsharded and accumulated gradients, reduce-scatter inputs in flight)
equals what the plan counts (`ray_dhp.planning.fsdp_working.fsdp_working_bytes`): the unsharded
gradients every ZeRO-3 module keeps between micro-batches (fp32 here; under ``bf16_mixed`` in
the fp32 reduce dtype, beside the fresh bf16 ones) plus one unit's working set. A single
micro-batch's working set is a point of the plan-accuracy rows at ZeRO-3
(`tests/distributed/test_plan_accuracy.py`)."""

import dataclasses

import pytest

from benchmarks import plan_accuracy as pa
from tests.spawn import run_on_ranks


def _rank(rank, world, case, steps):
    import torch

    from benchmarks.fsdp_sampling import fsdp_groups, sampling
    from ray_dhp import demo
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.planning.fsdp_working import fsdp_working_bytes
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.step.precision import POLICIES

    topo = Topology.build(**case.layout)
    engine = DHPEngine(demo.tiny_model_config(case.family), build_groups(topo, torch.device("cpu")),
                       pa.train_config(case).step_config())
    engine.step(steps[0])
    modules = list(engine.shards.values()) + [engine.text_model]
    with sampling(fsdp_groups(modules)) as samples:
        engine.forward_backward(steps[1], last=True)
    counts = count_params(demo.tiny_model_config(case.family))
    policy = POLICIES[case.precision]
    return {"measured": max(samples), "planned": fsdp_working_bytes(counts, topo, rank, policy, 2),
            "one": fsdp_working_bytes(counts, topo, rank, policy, 1)}


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16_mixed", marks=pytest.mark.slow)])
def test_accumulating_zero3_holds_what_the_plan_counts(precision, tmp_path):
    case = dataclasses.replace(pa.case_named("demo ZeRO-3 DP2"), samples=4, micro_batches=2,
                               precision=precision)
    steps = pa.make_steps(tmp_path, case)  # 4 samples a step: 2 micro-batches of one per replica
    for r, got in enumerate(run_on_ranks(_rank, 2, (case, steps))):
        print(f"rank {r}: measured {got['measured']} B, planned {got['planned']} B "
              f"(one micro-batch: {got['one']} B)")
        assert got["planned"] == pytest.approx(got["measured"], rel=0.01), (r, got)
        assert got["measured"] > 1.5 * got["one"]  # the kept gradients: this is not a small term
