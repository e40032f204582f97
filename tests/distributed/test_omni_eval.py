"""Evaluation with three modules (issues #14 and #33): the eval loss of a tiny Qwen2.5-Omni
thinker under vision SP2 / audio DP2 / text TP2 (collocated, 2 ranks), through the real
`EvalLoader` (clips routed to the audio rank that encodes them, pixels to the vision ranks),
over a validation set holding images, text-only records, clips, a record with an image and a
clip and videos, equals the stock single-process model's loss on that set, before and after a
training step.

Every module a rank hosts is in eval mode while it evaluates — the audio tower too (checked at
every sub-module forward: with the tiny models' dropout 0, no number would show a module left in
training mode) — and back in training mode afterwards.

Tolerance: fp64, 1e-10 relative, as tests/distributed/test_evaluation.py (only summation orders
differ, ~1e-14; a clip's rows at the wrong placeholders or a sample counted twice is O(1e-3)).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.demo.omni import make_omni_dataset
from ray_dhp.step.reference import ReferenceTrainer
from ray_dhp.parallel.topology import EncoderDegrees, Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.omni_cases import STEPS
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_omni"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=1,
                      max_grad_norm=0.5, weight_decay=0.1, seed=0, eval_batch_size=4)
LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
              encoders={"audio": EncoderDegrees(dp=2)})


def _sampler(path) -> StepSampler:
    s = StepSampler(read_annotations(path), demo.tiny_processor(FAMILY), resolve_data_root(path), CFG.sampler_config())
    s.allow_audio = True
    return s


@pytest.fixture(scope="module")
def omni_eval(tmp_path_factory):
    path = make_omni_dataset(tmp_path_factory.mktemp("omni_eval"), videos=2)
    s = _sampler(path)
    samples = [s.process(i) for i in range(len(s.records))]
    assert all(not isinstance(x, Exception) for x in samples)
    assert any(x.audio_lengths is not None for x in samples) and any(x.pixel_values is not None for x in samples)
    step = [[dataclasses.replace(samples[i], index=k * 4 + j) for j, i in enumerate(mb)]
            for k, mb in enumerate(STEPS[0])]  # every modality
    return path, samples, step


def _ref_eval(ref, samples) -> float:
    """The stock model's token-weighted loss on ``samples`` (one padded forward, eval mode): the
    loss `ReferenceTrainer.step` reports for one micro-batch, read before its update."""
    ref.model.eval()
    return ref.step([[dataclasses.replace(x, index=i) for i, x in enumerate(samples)]])["loss"]


def _body(rank, world, path, step):
    from ray_dhp.data.eval_loader import EvalLoader
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**LAYOUT), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, CFG.step_config(), dtype=torch.float64)
    loader = EvalLoader(_sampler(path), groups, batch_size=CFG.eval_batch(), balancer=engine.balancer())
    hosted = {**engine.shards, "text": engine.text_model}
    seen = []  # (module, sub-module, training flag) at every sub-module forward of an evaluation
    hooks = [sub.register_forward_pre_hook(lambda m, a, key=(name, sub_name): seen.append((*key, m.training)))
             for name, module in hosted.items() if module is not None
             for sub_name, sub in module.named_modules()]
    evals = [engine.evaluate(loader.batches())]
    for h in hooks:
        h.remove()
    after = {name: all(m.training for m in module.modules()) for name, module in hosted.items()
             if module is not None}
    engine.step(step)
    evals.append(engine.evaluate(loader.batches()))
    return {"evals": evals, "seen": seen, "after": after, "skipped": loader.skipped,
            "hosts": sorted(n for n, m in hosted.items() if m is not None)}


def test_omni_eval_loss_three_modules(omni_eval):
    path, samples, step = omni_eval
    ref_before = _ref_eval(ReferenceTrainer(demo.tiny_model_config(FAMILY), CFG.optim, precision=CFG.precision, dtype=torch.float64), samples)
    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), CFG.optim, precision=CFG.precision, dtype=torch.float64)
    ref.step(step)
    ref_after = _ref_eval(ref, samples)
    outs = run_on_ranks(_body, 2, args=(path, step))
    for rank, out in enumerate(outs):
        assert out["skipped"] == 0
        assert out["hosts"] == ["audio", "text", "vision"]  # collocated: every module on every rank
        assert {m for m, _, _ in out["seen"]} == {"audio", "text", "vision"}  # each one evaluated
        training = sorted({(m, s) for m, s, flag in out["seen"] if flag})
        assert not training, f"rank {rank}: evaluated in training mode: {training[:5]}"
        assert all(out["after"].values()), out["after"]
        for got, want in zip(out["evals"], (ref_before, ref_after)):
            assert got["eval_samples"] == len(samples)
            assert abs(got["eval_loss"] - want) <= 1e-10 * abs(want), (rank, got, want)
    print(f"omni eval: {outs[0]['evals'][0]['eval_loss']:.12f} vs {ref_before:.12f}, "
          f"after a step {outs[0]['evals'][1]['eval_loss']:.12f} vs {ref_after:.12f}")
