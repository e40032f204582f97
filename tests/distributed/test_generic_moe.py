"""Generic families whose language model is a mixture of experts (`ray_dhp.models.generic_moe`,
nothing written for the family) under expert parallelism: the DHP step equals the stock
single-process model, its own load-balancing loss included (the stock forward's
``output_router_logits=True`` loss in the reference). The same families' rows of
``test_generic.py`` (they are in `GENERIC_FAMILIES`) cover text TP2 (experts replicated over the
TP ranks, the shared experts TP-sharded), disjoint 1+2 and text ZeRO-3 DP2.

Each case: 3 steps of 2 micro-batches, clipping active; loss, grad-norm, every clipped gradient
of every step (the routers ``mlp.gate.weight`` and the fused experts among them), every rank's
copy of every parameter and update (fp64, the tiny configs of `ray_dhp.demo.generic`: 4
experts, top-2, one dense and one sparse layer).

Tolerances: `tests/distributed/generic_cases.py` (``TOLS``: GLM-4.5V's router computes its
logits in fp32, so its gradient is an fp32 sum that text DP2 splits; measured there). The loss
1e-7 covers the stock aux loss's fp32 sums of the routing probabilities, which a DP split takes
in another order (~1e-7 of the aux term, which weighs ``coef * aux / loss`` ~ 4e-5 of the loss).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.generic_cases import TOLS, matrix_cases, reference_getter
from tests.distributed.parity import (CFG, GENERIC_MOE_FAMILIES, assert_parity,
                                      moe_layout, run_engine)

LAYOUTS = {
    "collocated-dp2-ep2": moe_layout("collocated", (1, 2), (1, 2), ep=2),
    "disjoint-1v-dp2-ep2": moe_layout("disjoint", (1, 1), (1, 2), ep=2),
    # the experts' intermediate dim over the TP ranks instead (`ray_dhp.parallel.expert_tp`)
    "collocated-dp2-tp2-experts-tp": dict(moe_layout("collocated", (1, 2), (2, 1)),
                                          text_expert_tp=True),
}
FAMILIES = GENERIC_MOE_FAMILIES
DEFAULT = {("glm4v_moe", "collocated-dp2-ep2")}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_getter(tmp_path_factory)


CASES = matrix_cases(FAMILIES, LAYOUTS, DEFAULT)


@pytest.mark.parametrize("family,layout", CASES)
def test_generic_moe_family_is_exact(family, layout, references):
    steps, ref = references(family)
    lay = LAYOUTS[layout]
    got = run_engine(family, lay, CFG, steps, torch.float64, grads=True)
    grads = ref["grads"][0]
    assert any(n.endswith("mlp.gate.weight") for n in grads)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in grads)
    assert_parity(got, ref, **TOLS[family])
    # EP (experts TP) really on: every text rank dispatched (all-reduced) every sparse layer
    key = "all_reduce/text.experts_tp" if lay.get("text_expert_tp") else "all_to_all/text.experts"
    calls = [o["comm"].get(key, {}).get("calls", 0) for o in got["per_rank"]
             if any("language_model" in n for n in o["params"])]
    assert calls and min(calls) > 0, calls


def _drop_router_loss():
    """The negative control's bug: the engine leaves the router's load-balancing loss out."""
    from ray_dhp.models import moe

    contribution = moe.RouterLoss.contribution
    moe.RouterLoss.contribution = lambda self, mask, n: contribution(self, mask, n) * 0.0


@pytest.mark.slow
def test_generic_moe_without_its_router_loss_is_caught(references):
    """Negative control: the same run without the load-balancing loss fails the comparison (the
    stock forward's loss has it)."""
    from tests.distributed.parity import parity_failures

    steps, ref = references("glm4v_moe")
    got = run_engine("glm4v_moe", LAYOUTS["collocated-dp2-ep2"], CFG, steps, torch.float64,
                     grads=True, prepare=_drop_router_loss)
    bad = {what.split()[0] for what, *_ in parity_failures(got, ref, **TOLS["glm4v_moe"])}
    assert {"loss", "grad"} <= bad, bad
