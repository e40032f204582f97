"""Generic families whose language model is a mixture of experts (`ray_dhp.models.generic_moe`,
nothing written for the family): the DHP step equals the stock single-process model, its own
load-balancing loss included (the stock forward's ``output_router_logits=True`` loss in the
reference), under text TP (experts replicated over TP ranks, the shared experts TP-sharded),
disjoint placement, text ZeRO-3 and expert parallelism over text DP replicas.

Each case: 3 steps of 2 micro-batches, clipping active; loss, grad-norm, every clipped gradient
of every step (the routers ``mlp.gate.weight`` and the fused experts among them), every rank's
copy of every parameter and update (fp64, the tiny configs of `ray_dhp.demo.generic`: 4
experts, top-2, one dense and one sparse layer).

Tolerances: GLM-4V's tower is held to `generic_cases.GLM` wherever its images are split over
two vision replicas (its interpolated position table sums many images' gradients in another
order, measured 1.1e-7 of the updates; `tests/distributed/generic_cases.py`). Elsewhere the
updates and gradients are held to 1e-10 as the dense fp64 matrix; the loss to 1e-8 as in
``test_moe.py``: the stock aux loss sums the routing probabilities in fp32 even in an fp64
model, and a DP split sums them in another order (~1e-7 of the aux term, which weighs
``coef * aux / loss`` ~ 1e-4 of the loss).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.generic_cases import TOLS
from tests.distributed.parity import (CFG, assert_parity, make_steps, moe_layout, run_engine,
                                      run_reference)

LAYOUTS = {
    "collocated-dp2-tp2": moe_layout("collocated", (1, 2), (2, 1)),
    "disjoint-1v-tp2": moe_layout("disjoint", (1, 1), (2, 1)),
    "collocated-text-zero3-dp2": dict(moe_layout("collocated", (1, 2), (1, 2)), text_zero=3),
    "collocated-dp2-ep2": moe_layout("collocated", (1, 2), (1, 2), ep=2),
}
FAMILIES = ("glm4v_moe",)
DEFAULT = {("glm4v_moe", "collocated-dp2-ep2")}
LOSS_TOL = 1e-8


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            steps = make_steps(tmp_path_factory.mktemp(family), family, CFG)
            cache[family] = steps, run_reference(family, CFG, steps, torch.float64)
        return cache[family]
    return get


CASES = [pytest.param(f, lay, id=f"{f}-{lay}",
                      marks=() if (f, lay) in DEFAULT else (pytest.mark.slow,))
         for f in FAMILIES for lay in LAYOUTS]


@pytest.mark.parametrize("family,layout", CASES)
def test_generic_moe_family_is_exact(family, layout, references):
    steps, ref = references(family)
    lay = LAYOUTS[layout]
    got = run_engine(family, lay, CFG, steps, torch.float64, grads=True)
    grads = ref["grads"][0]
    assert any(n.endswith("mlp.gate.weight") for n in grads)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in grads)
    tols = dict(TOLS.get(family, dict(param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)))
    if lay["vision_dp"] == 1:  # the tower whole on one rank: only the text side's orders differ
        tols.update(param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
    tols["loss_tol"] = max(tols.get("loss_tol", 0.0), LOSS_TOL)
    assert_parity(got, ref, **tols)
    if lay.get("text_ep", 1) > 1:  # EP really on: every text rank dispatched every sparse layer
        calls = {o["comm"].get("all_to_all/text.experts", {}).get("calls", 0) for o in got["per_rank"]}
        assert min(calls) > 0, calls
