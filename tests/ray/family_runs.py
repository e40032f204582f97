"""Every family through the public entry points (issue #41): the layout each family trains at on
2 workers, its data and the single-process stock model's losses on the same samples, shared by
`test_generic_trainer.py` (`DisaggregatedTrainer`, fp64) and `test_cli_families.py`
(``ray-dhp train RUN.yaml``, fp32).

Layouts (collocated, 2 workers): vision DP2 + text TP2; the Omni thinkers vision SP2 + audio DP2
+ text TP2 on a set of images, clips, one record with both and text-only records
(`ray_dhp.demo.omni.make_omni_dataset`)."""

from __future__ import annotations

from ray_dhp.demo.configs import AUDIO_FAMILIES
from ray_dhp.demo.configs import FAMILIES as HAND_FAMILIES
from tests.distributed.parity import GENERIC_FAMILIES

__all__ = ["GENERIC_FAMILIES", "HAND_FAMILIES", "AUDIO_FAMILIES", "TOL", "degrees", "family_data",
           "reference_losses", "assert_losses", "family_trainer"]

#: fp64 loss tolerance per family (default 1e-10): the Gemma and Cohere rows' norm gradients are
#: ill-conditioned in fp64 (``tests/distributed/test_generic.py``)
TOL = {"gemma3": 1e-7, "paligemma": 1e-7, "shieldgemma2": 1e-7, "aya_vision": 1e-7, "cohere2_vision": 1e-7,
       "glm4v": 1e-7, "glm46v": 1e-7, "glmga": 1e-7, "glm4v_moe": 1e-7,
       # fp32 inside the stock models (SigLIP 2's position-table resize, DeepSeek-V3's router):
       # tests/distributed/generic_cases.py
       "lfm2_vl": 1e-7, "cosmos3_edge": 1e-7, "kimi_k25": 1e-7,
       # Gemma 4's tower pools in fp32 (its features depend on which images share a call): its
       # losses drift up to 2.6e-8 in test_families.py's 3-step vision DP2 runs (generic_cases.py)
       "gemma4": 1e-7,
       # fp32 routers / norms / a rotary parameter inside the stock models (generic_cases.py)
       "mistral_large4": 1e-7, "minimax_m3_vl": 1e-7, "qwen4_exp": 1e-7,
       # Qwen3-Omni's stock router loss sums the routing probabilities in fp32 even in fp64: the
       # loss tolerance of its fp64 engine rows (tests/distributed/family_rows.py, OMNI3)
       "qwen3_omni_moe": 1e-8}


def degrees(family: str) -> dict:
    """The family's module degrees on 2 collocated workers, as run-file sections (``{"vision":
    {...}, "text": {...}}``, plus ``"audio"`` for an Omni thinker)."""
    if family in AUDIO_FAMILIES:
        return {"vision": {"sequence_parallel": 2}, "audio": {"data_parallel": 2},
                "text": {"tensor_parallel": 2}}
    return {"vision": {"data_parallel": 2}, "text": {"tensor_parallel": 2}}


def family_data(tmp_path, family: str, cfg, processor=None) -> tuple:
    """``(data file, steps)``: the family's training set under ``tmp_path`` and the first
    ``cfg.optim.num_steps`` steps the loop's sampler makes of it with ``processor`` (default: the
    family's demo processor)."""
    from ray_dhp import demo
    from tests.distributed.parity import make_steps, sampler_steps

    if family not in AUDIO_FAMILIES:
        steps = make_steps(tmp_path, family, cfg, processor=processor)
        return tmp_path / f"data_{family}" / "data.jsonl", steps
    from ray_dhp.demo.omni import make_omni_dataset
    from tests.distributed.omni_cases import CLIP_SECONDS

    path = make_omni_dataset(tmp_path / f"data_{family}", seed=cfg.optim.seed,
                             clip_seconds=CLIP_SECONDS.get(family, (0.6, 1.0)))
    processor = demo.tiny_processor(family) if processor is None else processor
    steps = sampler_steps(path, processor, cfg, allow_audio=True)
    assert any(s.audio_lengths is not None for st in steps for mb in st for s in mb)
    return path, steps


def reference_losses(family: str, cfg, steps, dtype, model=None) -> list:
    """Every step's loss of the single-process stock model (`run_reference`) on ``steps``."""
    from tests.distributed.parity import run_reference

    return [h["loss"] for h in run_reference(family, cfg, steps, dtype, model=model)["history"]]


def assert_losses(history: list, ref: list, tol: float) -> None:
    """Rank 0's reported losses (``history``: the metrics lines, in any order: a checkpointing
    step's report may land after the next one's) equal ``ref`` to ``tol`` relative, step by step."""
    got = [h["loss"] for h in sorted(history, key=lambda h: h["step"])]
    assert len(got) == len(ref), (got, ref)
    errs = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    assert max(errs) < tol, (got, ref, errs)


def family_trainer(family: str, data: str, storage: str, loop: dict, model=None):
    """`DisaggregatedTrainer` of the family's tiny demo model at `degrees`, the built-in loop in
    fp64 (`tests.ray.loops.fp64_loop`); ``model``: a model directory (with its own processor) or
    another config of the family (with its demo processor) instead."""
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
    from ray_dhp.train.callbacks import MetricsHistory
    from tests.ray.loops import fp64_loop

    spec = dict(model=model) if isinstance(model, str) else dict(
        model=demo.tiny_model_config(family) if model is None else model,
        processor=demo.tiny_processor(family))
    dhp = DHPConfig(**spec, **{k: ModuleParallel(**v) for k, v in degrees(family).items()})
    assert dhp.num_workers == 2
    return DisaggregatedTrainer(
        fp64_loop(), train_loop_config=dict(loop), dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=f"family_{family}", storage_path=storage,
                                       callbacks=[MetricsHistory(loop["num_steps"])]),
        datasets={"train": data})
