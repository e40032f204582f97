"""docs/supported_models.md's generated table is current: the survey of every seam model type of
the installed transformers (`ray_dhp.models.survey`, slow: it builds each type once, on the meta
device or at small widths on CPU) and the generic families the parity tests verify."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_verified_generic_families_are_generic_in_the_doc():
    """Cheap: each generic family the parity matrix runs is listed as verified in the doc."""
    from tests.distributed.parity import GENERIC_FAMILIES

    text = (ROOT / "docs" / "supported_models.md").read_text()
    block = text.split("<!-- survey:begin -->", 1)[1].split("<!-- survey:end -->", 1)[0]
    rows = {line.split("|")[1].strip(" `"): line for line in block.splitlines()
            if line.startswith("| `")}
    for family in GENERIC_FAMILIES:
        assert "| generic |" in rows[family] and "fp64 exact" in rows[family], rows.get(family)


@pytest.mark.slow
def test_supported_models_doc_is_current():
    out = subprocess.run([sys.executable, "scripts/supported_models.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
