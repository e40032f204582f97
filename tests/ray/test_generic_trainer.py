"""Generic families (`ray_dhp.models.generic`) through the public trainer: `DisaggregatedTrainer`
with nothing written for the model (vision DP2 + text TP2 collocated on 2 workers, fp64) trains
every step's loss equal to the single-process stock model's on the same samples (rel 1e-10;
1e-7 for the Gemma and Cohere rows, whose norm gradients are ill-conditioned in fp64: see
``tests/distributed/test_generic.py``). The driver's checks (the model, the processor, the
layout) run on the generic family as on a hand-written one. One family by default, the others
with ``-m slow``."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import GENERIC_FAMILIES as FAMILIES

DEFAULT = {"llava"}
TOL = {"gemma3": 1e-7, "paligemma": 1e-7, "aya_vision": 1e-7, "cohere2_vision": 1e-7,
       "glm4v": 1e-7, "glm46v": 1e-7, "glmga": 1e-7}


def _trainer(family: str, data: str, storage: str):
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
    from ray_dhp.train.callbacks import MetricsHistory
    from tests.ray.loops import fp64_loop
    from tests.ray.private_run import LOOP

    dhp = DHPConfig(model=demo.tiny_model_config(family), processor=demo.tiny_processor(family),
                    vision=ModuleParallel(data_parallel=2), text=ModuleParallel(tensor_parallel=2))
    return DisaggregatedTrainer(
        fp64_loop(), train_loop_config=dict(LOOP), dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=f"generic_{family}", storage_path=storage,
                                       callbacks=[MetricsHistory(LOOP["num_steps"])]),
        datasets={"train": data})


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in DEFAULT else (pytest.mark.slow,))
                                    for f in FAMILIES])
def test_trainer_trains_a_generic_family_exactly(family, tmp_path, ray_start):
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.train.callbacks import read_history
    from tests.distributed.parity import make_steps, run_reference
    from tests.ray.private_run import LOOP

    steps = make_steps(tmp_path, family, TrainLoopConfig(**LOOP))
    ref = [h["loss"] for h in run_reference(family, TrainLoopConfig(**LOOP), steps,
                                            torch.float64)["history"]]
    data = tmp_path / f"data_{family}" / "data.jsonl"
    history = read_history(_trainer(family, str(data), str(tmp_path / "runs")).fit())
    got = [h["loss"] for h in sorted(history, key=lambda h: h["step"])]  # a checkpointing
    # step's report may land after the next one's
    assert len(got) == len(ref) == LOOP["num_steps"]
    errs = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    assert max(errs) < TOL.get(family, 1e-10), (got, ref, errs)
