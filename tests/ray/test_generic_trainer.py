"""Generic families (`ray_dhp.models.generic`) through the public trainer: `DisaggregatedTrainer`
with nothing written for the model (vision DP2 + text TP2 collocated on 2 workers, fp64) trains
every step's loss equal to the single-process stock model's on the same samples (rel 1e-10;
1e-7 for the Gemma and Cohere rows, whose norm gradients are ill-conditioned in fp64: see
``tests/distributed/test_generic.py``). The driver's checks (the model, the processor, the
layout) run on the generic family as on a hand-written one. Every case is ``-m slow`` (a Ray fit
each, ~30 s on 2 cores); the default run keeps their parts: the generic families' fp64 parity and
a model directory loaded sharded with its own processor through the engine
(``tests/distributed/test_generic.py``), the driver's processor checks
(``tests/unit/test_model_processor.py``, ``test_processor_fit.py``) and the trainer's own path
(``tests/ray/test_mixture.py``, ``test_fault_tolerance.py``).

`test_trainer_trains_a_model_directory_with_its_own_processor`: what a user does with a downloaded
checkpoint — ``DHPConfig(model=<directory>)`` and nothing else: the weights, and the samples made
by the model's own transformers processor in that directory (`ray_dhp.data.model_processor`:
Gemma 3's turn format, begin/end-of-image tokens and bidirectional image attention), train
exactly as the stock model from the same directory on the same processor's samples."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import GENERIC_FAMILIES as FAMILIES

DEFAULT: set = set()  # all slow: see the module docstring
TOL = {"gemma3": 1e-7, "paligemma": 1e-7, "shieldgemma2": 1e-7, "aya_vision": 1e-7, "cohere2_vision": 1e-7,
       "glm4v": 1e-7, "glm46v": 1e-7, "glmga": 1e-7, "glm4v_moe": 1e-7,
       # fp32 inside the stock models (SigLIP 2's position-table resize, DeepSeek-V3's router):
       # tests/distributed/generic_cases.py
       "lfm2_vl": 1e-7, "cosmos3_edge": 1e-7, "kimi_k25": 1e-7,
       # Gemma 4's tower pools in fp32 (its features depend on which images share a call): its
       # losses drift up to 2.6e-8 in test_families.py's 3-step vision DP2 runs (generic_cases.py)
       "gemma4": 1e-7,
       # fp32 routers / norms / a rotary parameter inside the stock models (generic_cases.py)
       "mistral_large4": 1e-7, "minimax_m3_vl": 1e-7, "qwen4_exp": 1e-7}


def _trainer(family: str, data: str, storage: str, model_dir: str = None):
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
    from ray_dhp.train.callbacks import MetricsHistory
    from tests.ray.loops import fp64_loop
    from tests.ray.private_run import LOOP

    model = dict(model=model_dir) if model_dir else dict(model=demo.tiny_model_config(family),
                                                         processor=demo.tiny_processor(family))
    dhp = DHPConfig(**model, vision=ModuleParallel(data_parallel=2),
                    text=ModuleParallel(tensor_parallel=2))
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


@pytest.mark.parametrize("family", [pytest.param("gemma3", marks=pytest.mark.slow),
                                    pytest.param("llava", marks=pytest.mark.slow)])
def test_trainer_trains_a_model_directory_with_its_own_processor(family, tmp_path, ray_start):
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.data.model_processor import ModelProcessor, run_processor
    from ray_dhp.demo.model_dirs import model_dir
    from ray_dhp.train.callbacks import read_history
    from tests.distributed.parity import make_steps, run_reference
    from tests.ray.private_run import LOOP

    path = str(tmp_path / "model")
    config = model_dir(family, path, weights=True, seed=3)
    processor = run_processor(path, path)
    assert isinstance(processor, ModelProcessor)
    steps = make_steps(tmp_path, family, TrainLoopConfig(**LOOP), processor=processor)
    assert any(int((s.mm_token_type_ids == 1).sum()) for mb in steps[0] for s in mb)
    ref = [h["loss"] for h in run_reference(family, TrainLoopConfig(**LOOP), steps, torch.float64,
                                            model=path)["history"]]
    data = tmp_path / f"data_{family}" / "data.jsonl"
    history = read_history(_trainer(family, str(data), str(tmp_path / "runs"), path).fit())
    got = [h["loss"] for h in sorted(history, key=lambda h: h["step"])]
    assert len(got) == len(ref) == LOOP["num_steps"]
    errs = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    assert max(errs) < TOL.get(family, 1e-10), (got, ref, errs)
    assert config.image_token_id != demo_image_token_id()


def demo_image_token_id() -> int:
    """The demo tokenizer's ``<|image_pad|>`` (the directory's image token is another)."""
    from ray_dhp.demo import build_tokenizer

    return build_tokenizer().convert_tokens_to_ids("<|image_pad|>")


@pytest.mark.slow
def test_cli_trains_a_model_directory_with_its_own_processor(tmp_path, ray_start, capsys):
    """``ray-dhp train RUN.yaml`` with ``model.path`` a Gemma 3 directory (weights and its own
    processor) and ``data.train`` a file: every step's loss equals the stock model's from the
    same directory on the same processor's samples (fp32, the run file's precision: 1e-5
    relative, as the README's fp32 parity)."""
    import json

    import yaml

    from ray_dhp.cli import main
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.data.model_processor import run_processor
    from ray_dhp.demo.model_dirs import model_dir
    from ray_dhp.run_file import load_run_file
    from tests.distributed.parity import make_steps, run_reference

    path = str(tmp_path / "model")
    model_dir("gemma3", path, weights=True, seed=3)
    run = {"model": {"path": path}, "vision": {"data_parallel": 2}, "text": {"tensor_parallel": 2},
           "placement": "collocated",
           "optim": {"lr": 1e-3, "global_batch_size": 4, "num_steps": 3, "log_every": 1,
                     "warmup_steps": 1, "max_grad_norm": 1.0, "seed": 0},
           "scaling": {"resources_per_worker": {"CPU": 1}},
           "run": {"name": "gemma3_dir", "storage_path": str(tmp_path / "runs")}}
    loop = TrainLoopConfig(**{**load_run_file(None).train_loop_config(), **run["optim"]})
    steps = make_steps(tmp_path, "gemma3", loop, processor=run_processor(path, path))
    run["data"] = {"train": str(tmp_path / "data_gemma3" / "data.jsonl")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    ref = [h["loss"] for h in run_reference("gemma3", loop, steps, torch.float32, model=path)["history"]]
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    lines = (tmp_path / "runs" / "gemma3_dir" / "ray_dhp_metrics.jsonl").read_text().splitlines()
    got = [m["loss"] for m in sorted((json.loads(x) for x in lines if x.strip()), key=lambda m: m["step"])]
    assert len(got) == len(ref) == 3
    errs = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    assert max(errs) < 1e-5, (got, ref, errs)
