"""The plan is measured (issue #42): per rank, the model state, the bytes saved for backward by
one micro-batch's forward and the optimizer step's peak that the engine allocates (spawned gloo
ranks, CPU, fp32 tiny models unless the row says otherwise) against what `ray-dhp plan` computes
for the same shapes and layout: within 5%, or the row's stated tolerance and reason. The rows,
the measurement and the planner calls are `benchmarks/plan_accuracy.py`; the default suite runs
one row (collocated vision SP2 / text TP2), the rest are slow."""

import pytest

from benchmarks.plan_accuracy import CASES, compare, measure, off_points
from tests.spawn import run_on_ranks


def _check(case, tmp_path):
    row = compare(case, measure(case, tmp_path, run=run_on_ranks))
    for pt, w in row["worst"].items():
        print(f"{case.name}: {pt} planned {w['planned']:.0f} B, measured {w['measured']:.0f} B "
              f"({w['ratio']:.3f})")
    assert not off_points(row, case), (case.name, row["worst"])


@pytest.mark.parametrize("case", [c for c in CASES if not c.slow], ids=lambda c: c.name)
def test_plan_matches_the_measured_bytes(case, tmp_path):
    _check(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.slow], ids=lambda c: c.name)
def test_plan_matches_the_measured_bytes_matrix(case, tmp_path):
    _check(case, tmp_path)
