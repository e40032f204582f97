"""InternVL's extra cases (its fp64 layout matrix is a row of `test_families.py`,
`family_rows.INTERNVL`): the parity batches really exercise the tile path, a sharded
``save_pretrained`` directory loads and exports, and InternVL3.5 (a Qwen3 LM) is exact.

Tolerance 1e-10 relative, as the matrix (fp64: only summation orders differ; reasons in
`family_rows.py`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.family_rows import EXACT_GRADS as TOL
from tests.distributed.family_checks import internvl3_5_config as _internvl3_5_config
from tests.distributed.family_rows import INTERNVL
from tests.distributed.parity import CFG, assert_parity, make_steps, run_engine, run_reference

FAMILY = "internvl"
CASES = INTERNVL.layouts


def test_samples_have_tiles(tmp_path):
    """The parity batches (the matrix's, `parity.make_steps`) exercise the tile path: several
    images with more than one tile."""
    steps = make_steps(tmp_path, FAMILY, CFG)
    grids = [s.image_grid_thw for st in steps for mb in st for s in mb if s.image_grid_thw is not None]
    tiles = torch.cat(grids)[:, 0]
    assert len(grids) >= 6 and int(tiles.max()) > 1 and int(tiles.min()) == 1


# -- a saved Hugging Face directory: sharded load, first step ------------------------------------

@pytest.mark.slow
def test_internvl_directory_loads_sharded_and_exports(tmp_path):
    """``save_pretrained`` of the tiny model, really sharded (100 KB files): the engine at
    collocated SP2/TP2 reads only its slices (vision parts and TP shards under their saved
    names), and its first step equals the stock ``from_pretrained`` model's (1e-10); the
    checkpoint it then writes exports a directory that ``from_pretrained`` loads with the
    trained weights, bit for bit (the vision parts under their own names)."""
    import transformers

    from ray_dhp import demo
    from ray_dhp.models import build_model
    from tests.distributed.parity import assert_export_round_trip, run_from_directory

    got, ref, ckpt = run_from_directory(tmp_path, FAMILY, CASES["collocated-sp2-tp2"][0],
                                        dataclasses.replace(CFG, num_steps=1))
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)
    seed0 = build_model(demo.tiny_model_config(FAMILY), seed=0)  # not the saved weights (seed 5)
    name = "model.vision_tower.encoder.layer.0.attention.q_proj.weight"
    assert not torch.equal(got["params0"][name].float(), dict(seed0.named_parameters())[name])
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), transformers.InternVLForConditionalGeneration,
                             got["params"])


# -- InternVL3.5: the same family with a Qwen3 language model ------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", ["collocated-sp2-tp2", "disjoint-1v-2t", "collocated-text-zero3-dp2"])
def test_internvl3_5_with_a_qwen3_lm_is_exact(case, tmp_path):
    """The q/k norms see only the local heads under TP: their gradients are summed over the TP
    group (`FamilySpec.tp_partial_grad_suffixes`); everything else as InternVL3. Slow only: the
    default run keeps InternVL at collocated SP2/TP2 (`test_families.py`'s internvl row) and per-head q/k
    norms under TP (Qwen3-VL's row of `test_parity.py`)."""
    config = _internvl3_5_config()
    assert config.text_config.model_type == "qwen3"
    steps = make_steps(tmp_path, FAMILY, CFG)
    ref = run_reference(FAMILY, CFG, steps, torch.float64, model=config)
    got = run_engine(FAMILY, CASES[case][0], CFG, steps, torch.float64, grads=True, model=config)
    assert any(n.endswith("self_attn.q_norm.weight") for n in ref["params"])
    assert_parity(got, ref, **TOL)
