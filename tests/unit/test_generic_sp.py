"""Which generic families' towers split over vision SP ranks (`ray_dhp.models.vision_generic_sp`)
is read from each tower's code: the parity rows (`tests.distributed.generic_cases.VISION_SP`) run
vision SP2 exactly where the family admits it, and DP2 where it refuses, with its reason."""

from __future__ import annotations

import pytest

from ray_dhp import demo
from ray_dhp.models import family_of
from tests.distributed.generic_cases import VISION_SP
from tests.distributed.parity import GENERIC_FAMILIES


@pytest.mark.slow
def test_the_sp_rows_are_the_families_whose_tower_splits():
    admitted = {f for f in GENERIC_FAMILIES if not family_of(demo.tiny_model_config(f)).vision_sp_refusal}
    assert admitted == set(VISION_SP)

