"""A sharded Hugging Face directory of a tiny ``qwen3_vl_moe`` loads under expert parallelism,
each rank reading only its experts' slices, with the first step equal to the unsharded model's.

The directory is written by ``save_pretrained`` with a small ``max_shard_size`` (experts stored
fused as transformers 5 holds them, ``[E, 2I, H]`` / ``[E, H, I]``) and rewritten into the two
other forms transformers' conversion mapping reads (`ray_dhp.models.hf_convert`): the Hub's
Qwen3-VL-MoE checkpoints' transposed fused experts (``[E, H, 2I]`` / ``[E, I, H]``, the
``qwen3_vl_moe`` entry: ``Transpose(1, 2)``) and per-expert tensors
(``mlp.experts.{i}.gate_proj.weight`` ..., the ``qwen2_moe`` entry Qwen3-MoE uses). The model's
``moe_intermediate_size`` is 16 (``2I = 32 != H = 64``), so a missed transpose changes shapes.

The reference is the stock single-process model ``from_pretrained`` of the ``save_pretrained``
directory (one step: loss, every update, every rank's copy; tolerance 1e-10 as the fp64 layout
matrix, only summation orders differ; the loss 1e-8, the aux loss's fp32 sums:
tests/distributed/test_moe.py). Reads: every rank's bytes read equal its bytes held (fp32 files,
fp32 parameters): its experts' slices, not the other ranks'.
"""

import os

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import build_model
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.moe_forms import INTER, _rewrite, hub_fused, per_expert
from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference
from tests.spawn import run_on_ranks

FAMILY = "qwen3_vl_moe"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=1,
                      max_grad_norm=0.5, weight_decay=0.1)
EP2 = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1, text_ep=2)
EP2_TP2 = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=2, text_tp=2, text_ep=2)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfmoe")
    config = demo.tiny_model_config(FAMILY)
    config.text_config.moe_intermediate_size = INTER
    fused = str(root / "fused")
    build_model(config, seed=11).save_pretrained(fused, max_shard_size="100KB")
    assert len([n for n in os.listdir(fused) if n.startswith("model-")]) > 3  # really sharded
    return {"fused": fused, "hub": _rewrite(fused, str(root / "hub"), hub_fused),
            "per_expert": _rewrite(fused, str(root / "per_expert"), per_expert)}


@pytest.fixture(scope="module")
def moe_steps_ref(moe_dirs, tmp_path_factory):
    steps = make_steps(tmp_path_factory.mktemp("moedata"), FAMILY, CFG)
    return steps, run_reference(FAMILY, CFG, steps, torch.float64, model=moe_dirs["fused"])


CASES = [pytest.param("per_expert", EP2, id="per-expert-ep2"),  # the default-run case
         pytest.param("hub", EP2, id="hub-fused-ep2", marks=pytest.mark.slow),
         pytest.param("fused", EP2_TP2, id="fused-disjoint-tp2-ep2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("form, layout", CASES)
def test_sharded_moe_directory_first_step_parity_fp64(form, layout, moe_dirs, moe_steps_ref):
    steps, ref = moe_steps_ref
    got = run_engine(FAMILY, layout, CFG, steps, torch.float64, model=moe_dirs[form])
    assert_parity(got, ref, loss_tol=1e-8, param_tol=1e-10, update_tol=1e-10)


def _reads_body(rank, world, layout, model):
    from tests.distributed.shard_reads import _holdings_body

    return _holdings_body(rank, world, layout, model)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["per_expert", "hub"])
def test_each_ep_rank_reads_only_its_experts(form, moe_dirs):
    outs = run_on_ranks(_reads_body, 2, args=(EP2, moe_dirs[form]))
    full = dict(build_model(moe_dirs["fused"]).named_parameters())
    for rank, o in enumerate(outs):
        experts = [n for n in o["held"] if ".mlp.experts." in n]
        assert experts
        for n, (t, shape, placements, _) in o["held"].items():
            want = full[n].detach()
            if n in experts:  # Shard(0) over EP2: this rank's half of the experts
                assert placements == [0] and t.shape[0] * 2 == want.shape[0], n
                want = want[rank * t.shape[0]:(rank + 1) * t.shape[0]]
            assert torch.equal(t, want), (rank, n)
        read = sum(n for *_, n in o["reads"])
        assert read == o["bytes"], (rank, read, o["bytes"])
