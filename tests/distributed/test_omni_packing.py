"""The Qwen2.5-Omni thinker trains on packed rows exactly as on one sample per row (issue #43).

The engine with ``packing`` (`TrainLoopConfig.packing`) against the padded single-process stock
``Qwen2_5OmniThinkerForConditionalGeneration`` (`ray_dhp.step.reference`), on the hand-composed
steps of `omni_cases` (images, audio clips, a record with an image and a clip, videos and
text-only records). With ``max_tokens=340`` (samples are 30-76 tokens, the videos 335) the first
micro-batch packs into one row (an image, a clip, the image + clip record, text), so audio
placeholders and image rows of several samples share a row; the videos take rows of their own.
Each sample's positions are the thinker's own ``get_rope_index`` of the sample alone, its clips'
lengths included (`qwen2_5_omni.packed_rope_index`), then concatenated.

Tolerance as test_packing.py's (fp64, 1e-10 relative on loss, grad-norm, every clipped gradient,
every parameter and update of every rank's copy): packing changes only summation orders. A
sample's audio rows at another sample's placeholders, or positions that ignore the clips, are
O(1e-3) or more on the loss.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.data.collate import pack_rows
from ray_dhp.parallel.topology import EncoderDegrees
from tests.distributed.omni_cases import AUD, BOTH, IMG, STEPS, omni_records
from tests.distributed.parity import assert_parity, run_engine, run_reference

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, seed=0, max_tokens=340)
PACKED = dataclasses.replace(CFG, packing=True)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    samples = omni_records(tmp_path_factory.mktemp("omni_pack"), CFG)
    steps = [[[dataclasses.replace(samples[i], index=n * 8 + k * 4 + j) for j, i in enumerate(mb)]
              for k, mb in enumerate(step)] for n, step in enumerate(STEPS)]
    rows = [pack_rows([s.num_tokens for s in mb], CFG.data.max_tokens) for st in steps for mb in st]
    # meaningful: a row holds an image, a clip and the image + clip record together
    first = [STEPS[0][0][i] for i in rows[0][0]]
    assert {IMG[0], AUD[0], BOTH} <= set(first), first
    assert any(len(r) > 1 for r in rows)
    return steps, run_reference("qwen2_5_omni", CFG, steps, torch.float64)


def _check(got, ref):
    return assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10,
                         grad_tol=1e-10)


@pytest.mark.slow
def test_omni_packed_collocated(omni):
    """Collocated: vision SP2, audio DP2, text TP2 on 2 workers (slow: ~80 s on 2 loaded cores;
    the default suite's case is unit/test_packing.py's packed-vs-padded thinker logits)."""
    steps, ref = omni
    layout = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
                  encoders={"audio": EncoderDegrees(dp=2)})
    worst = _check(run_engine("qwen2_5_omni", layout, PACKED, steps, torch.float64, grads=True), ref)
    print(f"omni packed collocated vision sp2 / audio dp2 / text tp2: worst update {worst[0]:.2e}")


@pytest.mark.slow
def test_omni_packed_disjoint_pipelined(omni):
    """Disjoint, each module on its own workers: vision SP2 (ranks 0-1), audio DP1 (rank 2),
    text TP2 (ranks 3-4), pipelined schedule."""
    steps, ref = omni
    layout = dict(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
                  encoders={"audio": EncoderDegrees(dp=1)})
    got = run_engine("qwen2_5_omni", layout, PACKED, steps, torch.float64, "pipelined", grads=True)
    worst = _check(got, ref)
    print(f"omni packed disjoint 2+1+2 pipelined: worst update {worst[0]:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [
    pytest.param("text-sp", dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
                                 text_sequence_parallel=True, encoders={"audio": EncoderDegrees(dp=2)}),
                 id="text-sp"),
    pytest.param("zero3", dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1,
                               text_zero=3, encoders={"audio": EncoderDegrees(dp=2)}), id="zero3"),
])
def test_omni_packed_text_sp_and_zero3(omni, name, layout):
    """Packed thinker rows with text sequence parallelism (vision SP2, audio DP2, text TP2 with
    the sequence sharded outside attention: rows padded to a multiple of 2) and with text ZeRO-3
    (vision DP2, audio DP2, text DP2: each replica packs its half of a micro-batch, FSDP2-sharded
    LM); the same tolerance. No Omni mixture-of-experts shape exists here (only the dense
    Qwen2.5-Omni thinker), so there is no EP case."""
    steps, ref = omni
    worst = _check(run_engine("qwen2_5_omni", layout, PACKED, steps, torch.float64, grads=True), ref)
    print(f"omni packed {name}: worst update {worst[0]:.2e}")
