"""fp64 parity of a tiny Qwen2.5-Omni thinker with three modules (issue #33): the audio tower, the
ViT and the LM each in its own group with its own parallelism, against the stock single-process
``Qwen2_5OmniThinkerForConditionalGeneration`` (`ray_dhp.step.reference`).

The steps are composed by hand so every empty-modality case occurs: step 1 holds images, audio
clips, a record with both and text-only records; step 2 has no audio at all (the audio module
gets no gradient: the stock AdamW leaves its parameters and moments untouched, weight decay
included, and so must the engine); step 3 has no image or video (the same for the vision side).
Videos enter the ViT as Qwen2.5-VL's do, their seconds per temporal patch under the thinker's
own keyword (``video_second_per_grid``).

Tolerance as in test_parity.py's fp64 matrix (1e-10 relative: only summation orders differ; a
wrong seam — audio rows at the wrong placeholders, a clip's rows from another replica, an
optimizer step on a module that had no input — is O(1e-3) or more). Every rank's copy of every
parameter, every update, the loss and grad-norm of every step and the clipped gradients of
every step are compared.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.parallel.topology import EncoderDegrees
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.omni_cases import BOTH, STEPS, VID, omni_records
from tests.distributed.parity import assert_parity, run_engine, run_reference

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, seed=0)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    samples = omni_records(tmp_path_factory.mktemp("omni"), CFG)
    assert samples[BOTH].audio_lengths is not None and samples[BOTH].image_grid_thw is not None
    assert all(samples[i].modalities.tolist() == [2] for i in VID)  # videos
    steps = [[[dataclasses.replace(samples[i], index=n * 8 + k * 4 + j) for j, i in enumerate(mb)]
              for k, mb in enumerate(step)] for n, step in enumerate(STEPS)]
    return steps, run_reference("qwen2_5_omni", CFG, steps, torch.float64)


def _check(got, ref, cfg=CFG):
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10,
                          grad_tol=1e-10)
    audio = [n for n in ref["params"] if n.startswith("model.audio_tower.")]
    assert audio
    held = [o for o in got["per_rank"] if any(n in o["params"] for n in audio)]
    assert held, "no rank holds the audio tower"
    return worst


def test_omni_three_modules_collocated(omni):
    """Collocated: vision SP2, audio DP2, text TP2 on 2 workers."""
    steps, ref = omni
    layout = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
                  encoders={"audio": EncoderDegrees(dp=2)})
    worst = _check(run_engine("qwen2_5_omni", layout, CFG, steps, torch.float64, grads=True), ref)
    print(f"omni collocated vision sp2 / audio dp2 / text tp2: worst update {worst[0]:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["pipelined", "sequential"])
def test_omni_three_modules_disjoint(omni, schedule):
    """Disjoint, each module on its own workers, unequal sizes: vision SP2 (ranks 0-1), audio
    DP1 (rank 2), text TP2 (ranks 3-4); pipelined (the encoders on micro-batch k+1 while the LM
    works on k) and sequential."""
    steps, ref = omni
    layout = dict(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
                  encoders={"audio": EncoderDegrees(dp=1)})
    got = run_engine("qwen2_5_omni", layout, CFG, steps, torch.float64, schedule, grads=True)
    worst = _check(got, ref)
    print(f"omni disjoint 2+1+2 {schedule}: worst update {worst[0]:.2e}")


def test_omni_mixed_grouping_audio_on_its_own_workers(omni):
    """Placement groups (issue #45): vision SP2 and text TP2 collocated on ranks 0-1, the audio
    encoder on a worker of its own (rank 2): features of two encoders, one of them across
    workers, one inside each process, reach the LM at their placeholders."""
    steps, ref = omni
    layout = dict(placement=[["vision", "text"], ["audio"]], vision_dp=1, vision_sp=2,
                  text_dp=1, text_tp=2, encoders={"audio": EncoderDegrees(dp=1)})
    got = run_engine("qwen2_5_omni", layout, CFG, steps, torch.float64, "pipelined", grads=True)
    worst = _check(got, ref)
    print(f"omni vision+text | audio (2 + 1), pipelined: worst update {worst[0]:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("placement, degrees, schedule", [
    # the mixed grouping, sequential schedule
    ([["vision", "text"], ["audio"]], (2, 1, 2, 1), "sequential"),
    # audio and text collocated (2 ranks), vision alone (2 ranks)
    ([["audio", "text"], ["vision"]], (2, 2, 2, 1), "pipelined"),
    # every module alone, unequal sizes: vision 1, audio 2, text 2 (the grouping spelt out)
    ([["vision"], ["audio"], ["text"]], (1, 2, 2, 1), "pipelined"),
])
def test_omni_placement_groups(omni, placement, degrees, schedule):
    """More groupings of the three modules; ``degrees`` = (vision sp, audio dp, text tp, text dp)."""
    steps, ref = omni
    sp, adp, tp, tdp = degrees
    layout = dict(placement=placement, vision_dp=1, vision_sp=sp, text_dp=tdp, text_tp=tp,
                  encoders={"audio": EncoderDegrees(dp=adp)})
    got = run_engine("qwen2_5_omni", layout, CFG, steps, torch.float64, schedule, grads=True)
    worst = _check(got, ref)
    print(f"omni {placement} {degrees} {schedule}: worst update {worst[0]:.2e}")


@pytest.mark.slow
def test_omni_frozen_audio_encoder(omni):
    """``modules: {audio: {train: false}}``: the audio rows still reach the LM, no gradient goes
    back, the tower stays bit-identical on every rank that holds it (as in the reference)."""
    steps, _ = omni
    cfg = dataclasses.replace(CFG, modules={"audio": {"train": False}})
    ref = run_reference("qwen2_5_omni", cfg, steps, torch.float64)
    layout = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=1, text_tp=2,
                  encoders={"audio": EncoderDegrees(dp=2)})
    got = run_engine("qwen2_5_omni", layout, cfg, steps, torch.float64, grads=True)
    _check(got, ref, cfg)
    audio = [n for n in ref["params"] if n.startswith("model.audio_tower.")]
    assert all(torch.equal(ref["params"][n], ref["params0"][n]) for n in audio)
    assert all(torch.equal(o["params"][n], o["params0"][n]) for o in got["per_rank"]
               for n in audio if n in o["params"])


def _resume_body(rank, world, layout, cfg, steps, ckpt, first):
    """Train ``steps[first:]`` at ``layout``; with ``first`` > 0 load ``ckpt`` first, else
    save it after the steps. Returns the losses and the full parameters."""
    import types

    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config("qwen2_5_omni"), groups, cfg.step_config(), dtype=torch.float64,
                       init="checkpoint" if first else "source")
    if first:
        assert checkpoint.load(ckpt, engine) == first
    losses = [engine.step(mb)["loss"] for mb in steps[first:]]
    if not first:
        checkpoint.save(ckpt, engine, types.SimpleNamespace(state_dict=lambda: {}))
    return {"losses": losses, "params": engine.named_full_parameters()}


@pytest.mark.slow
def test_omni_resume_at_another_layout(omni, tmp_path):
    """1 step collocated (vision SP2, audio DP2, text TP2), save, load disjoint (vision 1,
    audio 2, text 1), 2 more steps == 3 uninterrupted reference steps: every loss and every
    rank's copy of every parameter (the audio tower's AdamW moments and step counts included,
    which the no-audio second step must leave as they were)."""
    a = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
             encoders={"audio": EncoderDegrees(dp=2)})
    b = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1,
             encoders={"audio": EncoderDegrees(dp=2)})
    _resume_between(omni, str(tmp_path / "ckpt"), a, b)


@pytest.mark.slow
def test_omni_resume_at_another_grouping(omni, tmp_path):
    """Placement groups (issue #45): 1 step at vision+text | audio (vision SP2 + text TP2 on
    ranks 0-1, audio on rank 2), save, load at vision | audio+text (vision on rank 0, audio DP2
    + text TP2 on ranks 1-2), 2 more steps == 3 uninterrupted reference steps."""
    a = dict(placement=[["vision", "text"], ["audio"]], vision_dp=1, vision_sp=2, text_dp=1,
             text_tp=2, encoders={"audio": EncoderDegrees(dp=1)})
    b = dict(placement=[["vision"], ["audio", "text"]], vision_dp=1, vision_sp=1, text_dp=1,
             text_tp=2, encoders={"audio": EncoderDegrees(dp=2)})
    _resume_between(omni, str(tmp_path / "ckpt"), a, b)


def _resume_between(omni, ckpt: str, a: dict, b: dict) -> None:
    """Step 1 at layout ``a``, saved to ``ckpt``; steps 2-3 at layout ``b`` from it: every loss
    and every rank's copy of every parameter against the reference (rel 1e-10)."""
    from ray_dhp.parallel.topology import Topology
    from tests.distributed.parity import copy_errors
    from tests.spawn import run_on_ranks

    steps, ref = omni
    first = run_on_ranks(_resume_body, Topology.build(**a).world_size,
                         args=(a, CFG, steps[:1], ckpt, 0))
    rest = run_on_ranks(_resume_body, Topology.build(**b).world_size,
                        args=(b, CFG, steps, ckpt, 1))
    losses = first[0]["losses"] + rest[0]["losses"]
    want = [h["loss"] for h in ref["history"]]
    assert len(losses) == len(want) == 3
    assert all(abs(g - w) <= 1e-10 * w for g, w in zip(losses, want)), (losses, want)
    errs = copy_errors(rest, ref["params"])
    assert errs and max(errs)[0] <= 1e-10, max(errs)


def _loader_body(rank, world, path, layout, cfg):
    """Two steps from a `StepLoader` over the mixed set, each trained by the engine: which
    samples carry pixels / audio features on this rank, and the step losses."""
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config("qwen2_5_omni"), groups, cfg.step_config(), dtype=torch.float64)
    sampler = StepSampler(read_annotations(path), demo.tiny_processor("qwen2_5_omni"),
                          resolve_data_root(path), cfg.sampler_config())
    loader = StepLoader(sampler, groups, prefetch=False, balancer=engine.balancer())
    seen, losses = [], []
    for _ in range(2):
        mbs = loader.next()
        seen.append([[(s.index, s.pixel_values is not None, s.audio_features is not None,
                       None if s.audio_features is None else float(s.audio_features.sum()))
                      for s in mb] for mb in mbs])
        losses.append(engine.step(mbs)["loss"])
    loader.close()
    return {"seen": seen, "losses": losses}


@pytest.mark.slow
def test_loader_routes_audio_to_the_audio_ranks_only(tmp_path):
    """The loader sends each clip's features from its decoding rank to the audio rank that
    computes it and to no other rank (the vision and text ranks never hold them), pixels to
    the vision rank only; the engine trains on what it routed."""
    from ray_dhp.models import encoder_operations
    from ray_dhp.step.microbatch import balancer_for
    from ray_dhp.step.microbatch import encoder_replicas
    from tests.spawn import run_on_ranks

    samples = omni_records(tmp_path, CFG)
    path = str(tmp_path / "mixed.jsonl")
    cfg = dataclasses.replace(CFG, balance="cost", num_steps=2)
    layout = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1,
                  encoders={"audio": EncoderDegrees(dp=2)})
    out = run_on_ranks(_loader_body, 4, args=(path, layout, cfg))
    ops = encoder_operations("audio")
    balancer = balancer_for("cost", demo.tiny_model_config("qwen2_5_omni"))
    n_audio = 0
    for step in range(2):
        for k, mb in enumerate(out[0]["seen"][step]):
            for r in (1, 2):  # the audio ranks' micro-batches are the same samples, in order
                assert [x[0] for x in out[r]["seen"][step][k]] == [x[0] for x in mb]
            audio_rank = {}
            for rep, idx in enumerate(encoder_replicas(2, [samples[x[0]] for x in mb], ops, balancer)):
                audio_rank.update({i: 1 + rep for i in idx})
            for i, (index, _, _, _) in enumerate(mb):
                clip = samples[index].audio_features
                for r in range(4):
                    _, has_px, has_audio, total = out[r]["seen"][step][k][i]
                    assert has_px == (r == 0 and samples[index].pixel_values is not None)
                    assert has_audio == (clip is not None and r == audio_rank[i]), (r, index)
                    if has_audio:
                        n_audio += 1
                        assert total == float(clip.sum())
    assert n_audio > 0
    assert all(o["losses"] == out[0]["losses"] for o in out)
