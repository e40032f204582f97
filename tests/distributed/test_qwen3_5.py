"""Qwen3.5's extra cases (its fp64 layout matrix is a row of `test_families.py`,
`family_rows.QWEN3_5`; tolerances, with the fp32-computed norms' reasons, in
`family_checks.py`): a sharded ``save_pretrained`` directory loads and exports, and PEFT LoRA
at collocated SP2/TP2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.family_checks import assert_qwen3_5_parity
from tests.distributed.family_rows import QWEN3_5
from tests.distributed.parity import CFG, assert_parity, reference_fixture, run_engine, run_reference

FAMILY = "qwen3_5"
CASES = QWEN3_5.layouts


reference = reference_fixture(FAMILY)


# -- a saved Hugging Face directory: sharded load, first step, export round trip ----------------

@pytest.mark.slow
def test_qwen3_5_directory_loads_sharded_and_exports(tmp_path):
    """``save_pretrained`` of the tiny model, really sharded (100 KB files): the engine at
    collocated SP2/TP2 reads only its slices, and its first step equals the stock
    ``from_pretrained`` model's (1e-10 / the fp32-norm tolerance of `family_checks.py`); the checkpoint it then
    writes exports a directory that ``from_pretrained`` loads with the trained weights, bit for bit."""
    import transformers

    from tests.distributed.parity import assert_export_round_trip, run_from_directory

    got, ref, ckpt = run_from_directory(tmp_path, FAMILY, CASES["collocated-sp2-tp2"][0],
                                        dataclasses.replace(CFG, num_steps=1))
    assert_qwen3_5_parity(got, ref)
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), transformers.Qwen3_5ForConditionalGeneration,
                             got["params"])


@pytest.mark.slow
def test_qwen3_5_lora_at_sp2_tp2(reference):
    """PEFT LoRA with the default targets (the gated attention's q/k/v/o and every MLP; the
    Gated DeltaNet projections are not targets) at collocated SP2/TP2 against the single-process
    PEFT model (fp64, 1e-10: the frozen base holds the fp32-norm weights, which get no gradient);
    the base weights of the language model stay bit-identical, the adapters move."""
    _, steps, _ = reference()
    cfg = dataclasses.replace(CFG, modules={"llm": {"lora": {"r": 4, "alpha": 8}}})
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, CASES["collocated-sp2-tp2"][0], cfg, steps, torch.float64)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
    lora = {n for n in ref["params"] if ".lora_B." in n}
    assert any(".mlp." in n for n in lora) and any(".self_attn." in n for n in lora)
    assert all(ref["params0"][n].abs().max() == 0 < ref["params"][n].abs().max() for n in lora)
    for out in got["per_rank"]:
        for name in out["params"]:
            if name.startswith("model.language_model.") and ".lora_" not in name:
                assert torch.equal(out["params"][name], out["params0"][name]), name
