"""fp64 parity of a tiny Qwen2.5-Omni thinker through today's two-module engine (issue #33
groundwork): image and text-only samples, the ViT under Ulysses SP2 and the Qwen2 LM under TP2,
collocated, against the stock single-process ``Qwen2_5OmniThinkerForConditionalGeneration``
(`ray_dhp.step.reference`). The audio tower is held by the text ranks and receives no gradient on
either side (no sample has audio: those are refused, `test_audio.py`), so its parameters must
stay bit-identical to their initial values on both sides, which the parameter check covers.

Tolerance as in test_parity.py's fp64 matrix (1e-10 relative: only summation orders differ; a
real bug, e.g. the thinker's feature seam missed or positions built without the image grids, is
O(1)). Every rank's copy of every parameter, every update, the loss and grad-norm of every step
and the clipped gradients of every step are compared.
"""

import torch

from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=2,
                      max_grad_norm=0.5, weight_decay=0.1, seed=0)
LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


def test_omni_thinker_parity_fp64(tmp_path):
    steps = make_steps(tmp_path, "qwen2_5_omni", CFG, num_samples=8)
    ref = run_reference("qwen2_5_omni", CFG, steps, torch.float64)
    got = run_engine("qwen2_5_omni", LAYOUT, CFG, steps, torch.float64, grads=True)
    worst = assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10,
                          grad_tol=1e-10)
    audio = [n for n in ref["params"] if n.startswith("model.audio_tower.")]
    assert audio and all(torch.equal(ref["params"][n], ref["params0"][n]) for n in audio)
    assert all(torch.equal(o["params"][n], o["params0"][n]) for o in got["per_rank"]
               for n in audio if n in o["params"])
    print(f"qwen2_5_omni collocated sp2/tp2: worst update error {worst[0]:.2e}, "
          f"parameter {worst[1]:.2e} ({worst[2]})")
