"""Generic families (`ray_dhp.models.generic`): models with nothing written for them train
exactly as the single-process stock model under every covered layout: loss, grad-norm, every
clipped gradient, every parameter and every update of every rank's copy (fp64, 3 steps, 2
micro-batches, clipping active; the tiny configs of `ray_dhp.demo.generic`).

Tolerance 1e-10 relative, as in ``test_parity.py``: in fp64 only summation orders differ (TP
partial sums, DP reductions over images), a few ulp amplified at most ~1e3 by AdamW's
normalisation of the updates; a wrong row order, a missing partial-gradient sum (Gemma 3's
per-head ``q_norm``/``k_norm``) or a dropped forward keyword (Gemma 3's ``token_type_ids``) is
an O(1) error.

Layouts (a family is a row): collocated vision DP2 + text TP2, disjoint 1 + text TP2, and
collocated text ZeRO-3 DP2. The default run keeps one case per layout; the rest are slow.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.generic_cases import TOL, TOLS, ZERO_GRAD, matrix_cases, reference_getter
from tests.distributed.parity import (CFG, GENERIC_FAMILIES, assert_parity, dense_layout,
                                     run_engine)

FAMILIES = GENERIC_FAMILIES
LAYOUTS = {
    "collocated-dp2-tp2": dense_layout("collocated", (1, 2), (2, 1)),
    "disjoint-1v-tp2": dense_layout("disjoint", (1, 1), (2, 1)),
    "collocated-text-zero3-dp2": dict(dense_layout("collocated", (1, 2), (1, 2)), text_zero=3),
}
DEFAULT = {("gemma3", "collocated-dp2-tp2"), ("gemma3", "disjoint-1v-tp2"),  # one reference
           ("paligemma", "collocated-text-zero3-dp2")}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_getter(tmp_path_factory)


CASES = matrix_cases(FAMILIES, LAYOUTS, DEFAULT)


@pytest.mark.parametrize("family,layout", CASES)
def test_generic_family_is_exact(family, layout, references):
    steps, ref = references(family)
    got = run_engine(family, LAYOUTS[layout], CFG, steps, torch.float64, grads=True)
    assert_parity(got, ref, skip=ZERO_GRAD, **TOLS.get(family, TOL))
    for run in [ref["grads"]] + [o["grads"] for o in got["per_rank"]]:
        for grads in run:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
            noise = [float(g.norm() / norm) for n, g in grads.items() if n.endswith(ZERO_GRAD)]
            assert max(noise, default=0.0) < 1e-12, noise


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

    got, ref, ckpt = run_from_directory(tmp_path, family, LAYOUTS["collocated-dp2-tp2"],
                                        dataclasses.replace(CFG, num_steps=1))
    tols = {k: v for k, v in TOLS.get(family, TOL).items() if k != "grad_tol"}
    assert_parity(got, ref, skip=ZERO_GRAD, **tols)
    assert_export_round_trip(ckpt, str(tmp_path / "hf"), seam_class(demo.tiny_model_config(family)),
                             got["params"])
