"""The pool planner's worked example in the docs is the code's output (issue #45 item 5):
``python -m benchmarks.pool_example --write`` makes the device table and the two reports in
docs/placement.md and the summary in docs/cluster.md."""

import pytest

from benchmarks.pool_example import POOLS, committed, device_table, fenced, report, summary


def test_the_device_table_in_the_docs_is_the_code_s():
    assert committed()[2] == device_table(), "run `python -m benchmarks.pool_example --write`"


@pytest.mark.slow  # two full pool searches of a 32B model (~1 min of CPU each)
def test_the_worked_example_in_the_docs_is_the_planner_s_output():
    reports = {name: report(path) for name, path in POOLS.items()}
    blocks, table, _ = committed()
    for name, text in reports.items():
        assert blocks[name] == fenced(name, text), "run `python -m benchmarks.pool_example --write`"
    assert table == summary(reports)
