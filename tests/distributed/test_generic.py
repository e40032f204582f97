"""Generic families' extra case (their fp64 layout matrix, every family a row of
`test_families.py`: collocated vision DP2 + text TP2, disjoint 1 + text TP2, text ZeRO-3 DP2;
`family_rows.py`): a sharded ``save_pretrained`` directory loads and exports. Tolerances:
`generic_cases.py` (``TOLS``, with the measurements behind them).
"""

from __future__ import annotations

import pytest

from tests.distributed.family_rows import GENERIC_LAYOUTS
from tests.distributed.generic_cases import TOL, TOLS, ZERO_GRAD
from tests.distributed.parity import CFG, assert_parity


@pytest.mark.parametrize("family", [pytest.param("gemma3"),
                                    pytest.param("glm4v", marks=pytest.mark.slow),
                                    pytest.param("glm4v_moe", marks=pytest.mark.slow),
                                    pytest.param("lfm2_vl", marks=pytest.mark.slow)])
def test_generic_directory_loads_sharded_and_exports(family, tmp_path):
    """A generic family's ``save_pretrained`` directory, really sharded (100 KB files): the engine
    at collocated vision DP2 + text TP2 reads only its slices, its first step equals the stock
    ``from_pretrained`` model's, and the checkpoint it writes exports a directory that the
    model's own class loads with the trained weights, bit for bit (transformers' names)."""
    import dataclasses

    from ray_dhp import demo
    from ray_dhp.models.generic import seam_class
    from tests.distributed.parity import assert_export_round_trip, run_from_directory

    got, ref, ckpt = run_from_directory(tmp_path, family, GENERIC_LAYOUTS["collocated-dp2-tp2"][0],
                                        dataclasses.replace(CFG, num_steps=1))
    tols = {k: v for k, v in TOLS.get(family, TOL).items() if k != "grad_tol"}
    assert_parity(got, ref, skip=ZERO_GRAD, **tols)
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), seam_class(demo.tiny_model_config(family)),
                             got["params"])
