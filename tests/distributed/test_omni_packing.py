"""The Qwen-Omni thinkers train on packed rows exactly as on one sample per row (issue #43).

The engine with ``packing`` (`TrainLoopConfig.packing`) against the padded single-process stock
thinker (`ray_dhp.step.reference`: ``Qwen2_5OmniThinkerForConditionalGeneration``,
``Qwen3OmniMoeThinkerForConditionalGeneration``), on the hand-composed steps of `omni_cases`
(images, audio clips, a record with an image and a clip, videos and text-only records). With
``max_tokens=340`` (samples are 30-81 tokens, the videos 335) the first micro-batch packs into
one row (an image, a clip, the image + clip record, text), so audio placeholders and image rows
(with Qwen3-Omni's deepstack rows) of several samples share a row; the videos take rows of their
own. Each sample's positions are the thinker's own ``get_rope_index`` of the sample alone, its
clips' lengths included (`qwen2_5_omni.packed_rope_index`, both thinkers' signature), then
concatenated; Qwen3-Omni places video frames at fractional times (seconds per temporal patch x
25 positions per second: 12.5, 18.75 here), kept as the stock forward keeps them.

Tolerance as test_packing.py's (fp64, 1e-10 relative on loss, grad-norm, every clipped gradient,
every parameter and update of every rank's copy): packing changes only summation orders. A
sample's audio rows at another sample's placeholders, or positions that ignore the clips, are
O(1e-3) or more on the loss; Qwen3-Omni's video positions rounded to integers are 2e-2 on the
video sample's logits (tests/unit/test_omni_packing.py). Qwen3-Omni as its matrix row
(`family_rows.OMNI3`): the loss 1e-8 (the stock router loss sums the routing probabilities in fp32
even in fp64, over the micro-batch's real tokens, which the packed rows count the same: padding
excluded), its audio key biases (an exact gradient of 0) left out and checked to be noise.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.parallel.packed_rows import pack_bins
from ray_dhp.parallel.topology import EncoderDegrees
from tests.distributed import family_checks as checks
from tests.distributed.omni_cases import AUD, BOTH, IMG, STEPS, omni_records
from tests.distributed.parity import assert_parity, run_engine, run_reference

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, seed=0, max_tokens=340)
PACKED = dataclasses.replace(CFG, packing=True)
EXACT = dict(loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
TOLS = {"qwen2_5_omni": EXACT,
        "qwen3_omni_moe": dict(EXACT, loss_tol=1e-8, skip=checks.OMNI3_ZERO_GRAD)}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """``get(family)`` -> (steps, fp64 padded reference), each family's computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"pack_{family}")
            samples = omni_records(root, CFG, family=family)
            steps = [[[dataclasses.replace(samples[i], index=n * 8 + k * 4 + j) for j, i in enumerate(mb)]
                      for k, mb in enumerate(step)] for n, step in enumerate(STEPS)]
            rows = [pack_bins([s.num_tokens for s in mb], CFG.data.max_tokens) for st in steps for mb in st]
            # meaningful: a row holds an image, a clip and the image + clip record together (the
            # rows one text replica lays out, `pack_bins`; two micro-batches reorder theirs)
            first = [STEPS[0][0][i] for i in rows[0][0]]
            assert {IMG[0], AUD[0], BOTH} <= set(first), first
            assert any(len(r) > 1 for r in rows)
            cache[family] = steps, run_reference(family, CFG, steps, torch.float64)
        return cache[family]

    return get


def _check(family, got, ref, layout=None):
    worst = assert_parity(got, ref, **TOLS[family])
    if family == "qwen3_omni_moe":
        checks.omni_audio(got, ref, None)
        if layout is not None and layout.get("text_ep", 1) > 1:
            checks.experts_really_parallel(got, ref, SimpleNamespace(layout=layout))
    return worst


def _layout(placement, vision, audio_dp, text, **extra) -> dict:
    """``vision=(sp, dp)``, audio ``dp``, ``text=(tp, dp)``."""
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp,
                encoders={"audio": EncoderDegrees(dp=audio_dp)}, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_omni_packed_collocated(omni, family):
    """Collocated: vision SP2, audio DP2, text TP2 on 2 workers (slow: ~80 s on 2 loaded cores;
    the default suite's cases are unit/test_omni_packing.py's packed-vs-padded thinker logits)."""
    steps, ref = omni(family)
    got = run_engine(family, _layout("collocated", (2, 1), 2, (2, 1)), PACKED, steps, torch.float64,
                     grads=True)
    worst = _check(family, got, ref)
    print(f"{family} packed collocated vision sp2 / audio dp2 / text tp2: worst update {worst[0]:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_omni_packed_disjoint_pipelined(omni, family):
    """Disjoint, each module on its own workers: vision SP2 (ranks 0-1), audio DP1 (rank 2),
    text TP2 (ranks 3-4), pipelined schedule."""
    steps, ref = omni(family)
    got = run_engine(family, _layout("disjoint", (2, 1), 1, (2, 1)), PACKED, steps, torch.float64,
                     "pipelined", grads=True)
    worst = _check(family, got, ref)
    print(f"{family} packed disjoint 2+1+2 pipelined: worst update {worst[0]:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("family, name, layout", [
    pytest.param("qwen2_5_omni", "text-sp", _layout("collocated", (2, 1), 2, (2, 1),
                                                    text_sequence_parallel=True), id="qwen2_5_omni-text-sp"),
    pytest.param("qwen2_5_omni", "zero3", _layout("collocated", (1, 2), 2, (1, 2), text_zero=3),
                 id="qwen2_5_omni-zero3"),
    pytest.param("qwen3_omni_moe", "zero3", _layout("collocated", (1, 2), 2, (1, 2), text_zero=3),
                 id="qwen3_omni_moe-zero3"),
    # expert parallelism over the text DP replicas (all-to-all dispatch, `ray_dhp.parallel.expert`)
    pytest.param("qwen3_omni_moe", "ep2", _layout("collocated", (1, 2), 2, (1, 2), text_ep=2),
                 id="qwen3_omni_moe-ep2"),
])
def test_omni_packed_text_sp_zero3_and_ep(omni, family, name, layout):
    """Packed thinker rows with text sequence parallelism (Qwen2.5-Omni: vision SP2, audio DP2,
    text TP2 with the sequence sharded outside attention, rows padded to a multiple of 2; the
    Qwen3-Omni thinker has no text SP plan), with text ZeRO-3 (vision DP2, audio DP2, text DP2:
    each replica packs its half of a micro-batch, FSDP2-sharded LM) and, for the Qwen3-Omni MoE
    LM, with expert parallelism EP2 over the two text DP replicas (each replica's router loss
    counts its packed rows' real tokens, all-reduced over the replicas)."""
    steps, ref = omni(family)
    got = run_engine(family, layout, PACKED, steps, torch.float64, grads=True)
    worst = _check(family, got, ref, layout)
    print(f"{family} packed {name}: worst update {worst[0]:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_omni3_videos_under_context_parallel(tmp_path, packed):
    """Qwen3-Omni's fractional video positions survive the LM's context parallelism (text CP2,
    vision SP2, no audio group: images, videos and text, 2 steps of 4): each CP rank's slice of
    the positions is the sample's own, unrounded, padded (`step.text`: per-sample positions,
    then sliced) and packed (the packed rows' positions, sliced); the tolerances above. Rounded
    to integers (as the padded CP path did): gradients 2e-2..2e-1 off (measured)."""
    from tests.distributed.omni_cases import TXT, VID

    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=1, num_steps=2,
                          max_grad_norm=0.5, weight_decay=0.1, seed=0, max_tokens=340, packing=packed)
    records = omni_records(tmp_path, cfg, family="qwen3_omni_moe")
    mbs = [(IMG[3], TXT[0], VID[1], TXT[1]), (VID[0], IMG[1], TXT[0], IMG[2])]
    steps = [[[dataclasses.replace(records[i], index=n * 4 + j) for j, i in enumerate(mb)]]
             for n, mb in enumerate(mbs)]
    ref = run_reference("qwen3_omni_moe", dataclasses.replace(cfg, packing=False), steps, torch.float64)
    layout = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=1, text_cp=2)
    got = run_engine("qwen3_omni_moe", layout, cfg, steps, torch.float64, grads=True)
    worst = assert_parity(got, ref, **dict(TOLS["qwen3_omni_moe"], skip=()))
    print(f"qwen3_omni_moe videos cp2 {'packed' if packed else 'padded'}: worst update {worst[0]:.2e}")
