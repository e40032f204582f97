"""Qwen3.5-MoE's extra cases (its fp64 layout matrix is a row of `test_families.py`,
`family_rows.QWEN3_5_MOE`; tolerances, with the fp32-computed norms' and the aux loss's reasons,
in `family_checks.py`): PEFT LoRA at collocated SP2/TP2 and a sharded ``save_pretrained``
directory (per-expert names) read at EP2 and exported.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.family_checks import QWEN3_5_MOE_FP32_NORMS as FP32_NORMS
from tests.distributed.family_checks import QWEN3_5_MOE_FP32_TOL as FP32_TOL
from tests.distributed.family_checks import QWEN3_5_MOE_TOL as TOL
from tests.distributed.family_rows import QWEN3_5_MOE
from tests.distributed.parity import (CFG, assert_parity, copy_errors, reference_fixture, run_engine,
                                      run_reference)

FAMILY = "qwen3_5_moe"
CASES = QWEN3_5_MOE.layouts


reference = reference_fixture(FAMILY)


@pytest.mark.slow
def test_qwen3_5_moe_lora_at_sp2_tp2(reference):
    """PEFT LoRA with the default targets at collocated SP2/TP2: the gated attention's q/k/v/o
    and the shared expert's gate/up/down (TP-sharded, their adapters get the dense MLP's plan);
    the router, the fused experts and ``shared_expert_gate`` stay frozen (`ray_dhp.models.lora`).
    Against the single-process PEFT model, fp64, 1e-10 (the frozen base holds the fp32-norm
    weights, which get no gradient; the loss 1e-8: the aux loss's fp32 sums). Every base weight
    of the language model stays bit-identical on every rank; the adapters move."""
    _, steps, _ = reference()
    cfg = dataclasses.replace(CFG, modules={"llm": {"lora": {"r": 4, "alpha": 8}}})
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, CASES["collocated-sp2-tp2"][0], cfg, steps, torch.float64)
    assert_parity(got, ref, loss_tol=1e-8, param_tol=1e-10, update_tol=1e-10)
    lora = {n for n in ref["params"] if ".lora_B." in n}
    assert any(".mlp.shared_expert." in n for n in lora) and any(".self_attn." in n for n in lora)
    assert not any(".experts." in n or "shared_expert_gate" in n or ".mlp.gate." in n for n in lora)
    assert all(ref["params0"][n].abs().max() == 0 < ref["params"][n].abs().max() for n in lora)
    for out in got["per_rank"]:
        for name in out["params"]:
            if name.startswith("model.language_model.") and ".lora_" not in name:
                assert torch.equal(out["params"][name], out["params0"][name]), name


@pytest.mark.slow
def test_qwen3_5_moe_directory_loads_sharded_at_ep2_and_exports(tmp_path):
    """``save_pretrained`` of the tiny model (per-expert tensor names, 100 KB files) read at
    collocated DP2 x EP2, each rank taking its experts' slices through transformers' conversion
    mapping (`ray_dhp.models.hf_convert`): the first step equals the stock ``from_pretrained``
    model's (loss 1e-8, the aux loss's fp32 sums; every rank's parameters and updates 1e-10, the
    fp32 norms 1e-5: `family_checks.py`); the checkpoint it writes exports a directory that
    ``from_pretrained`` loads with the trained weights, bit for bit."""
    import transformers

    from tests.distributed.parity import assert_export_round_trip, run_from_directory

    got, ref, ckpt = run_from_directory(tmp_path, FAMILY, CASES["collocated-dp2-ep2"][0],
                                        dataclasses.replace(CFG, num_steps=1))
    assert_parity(got, ref, loss_tol=1e-8)
    per_rank = got["per_rank"]
    errs = copy_errors(per_rank, ref["params"]) + copy_errors(per_rank, ref["params"], base="params0",
                                                              ref_base=ref["params0"])
    bad = [e for e in errs if e[0] > (FP32_TOL if e[2].endswith(FP32_NORMS) else TOL)]
    assert errs and not bad, bad[:20]
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), transformers.Qwen3_5MoeForConditionalGeneration,
                             got["params"])
