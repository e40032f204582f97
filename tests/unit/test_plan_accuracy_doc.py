"""docs/plan_accuracy.md shows the measured-vs-planned matrix of the newest
``benchmarks/results/plan-accuracy-cpu2-*.json`` (``python -m benchmarks.plan_accuracy --slow
--write`` makes both)."""

import json

from benchmarks.plan_accuracy import CASES, committed_table, newest_results, table


def test_the_doc_table_is_the_newest_results():
    path = newest_results()
    assert path is not None, "run `python -m benchmarks.plan_accuracy --slow --write`"
    rows = json.loads(path.read_text())["rows"]
    assert committed_table() == table(rows), "run `python -m benchmarks.plan_accuracy --slow --write`"
    assert [r["name"] for r in rows] == [c.name for c in CASES], "the results miss rows of CASES"
