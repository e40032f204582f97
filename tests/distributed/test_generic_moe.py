"""Generic families whose language model is a mixture of experts (`ray_dhp.models.generic_moe`):
the negative control of their expert-parallel rows (`test_families.py`, `family_rows.py`: EP2
collocated DP2 and disjoint 1 + DP2, experts TP-sharded; the router loss included): the engine
without the load-balancing loss fails the comparison with the stock forward, which has it.
Tolerances: `generic_cases.py` (``TOLS``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.family_rows import GENERIC_MOE_LAYOUTS
from tests.distributed.generic_cases import TOLS
from tests.distributed.parity import CFG, reference_fixture, run_engine

reference = reference_fixture("glm4v_moe")


def _drop_router_loss():
    """The negative control's bug: the engine leaves the router's load-balancing loss out."""
    from ray_dhp.models import moe

    contribution = moe.RouterLoss.contribution
    moe.RouterLoss.contribution = lambda self, mask, n: contribution(self, mask, n) * 0.0


@pytest.mark.slow
def test_generic_moe_without_its_router_loss_is_caught(reference):
    """Negative control: the same run without the load-balancing loss fails the comparison (the
    stock forward's loss has it)."""
    from tests.distributed.parity import parity_failures

    _, steps, ref = reference()
    got = run_engine("glm4v_moe", GENERIC_MOE_LAYOUTS["collocated-dp2-ep2"][0], CFG, steps, torch.float64,
                     grads=True, prepare=_drop_router_loss)
    bad = {what.split()[0] for what, *_ in parity_failures(got, ref, **TOLS["glm4v_moe"])}
    assert {"loss", "grad"} <= bad, bad
