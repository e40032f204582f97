"""`ray-dhp plan` on every run file in ``examples/`` (issue #42): each GPU example keeps at least
8% of its device's memory free after the device margin, on the device it names
(``scaling.accelerator``). ``benchmarks/plan_headroom.py`` makes the rows."""

import pytest

from benchmarks.plan_headroom import MIN_HEADROOM, example_row, examples


@pytest.fixture(scope="module")
def rows():
    return [example_row(name) for name in examples()]


def test_every_gpu_example_keeps_its_headroom(rows):
    gpu = [r for r in rows if "memory" in r]
    assert len(gpu) >= 7 and {r["example"] for r in rows} == set(examples())
    low = [(r["example"], r["headroom"]) for r in gpu if r["headroom"] < 100 * MIN_HEADROOM]
    assert not low, f"examples below {MIN_HEADROOM:.0%} headroom after the margin: {low}"

