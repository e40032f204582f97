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


def test_the_tables_in_docs_are_the_scripts_output(rows):
    from benchmarks.plan_headroom import committed_tables, device_table, table

    devices, headroom = committed_tables()
    assert devices == device_table(), "run `python -m benchmarks.plan_headroom --write`"
    assert headroom == table(rows), "run `python -m benchmarks.plan_headroom --write`"
