"""Suite-wide setup: with ``RAY_DHP_TEST_THREADS`` set, the pytest process (where the
single-process references run) uses that many torch threads too, like the spawned ranks
(tests/spawn.py). Unset, torch's default (``OMP_NUM_THREADS`` or the core count) is kept."""

import os

import torch

from tests.spawn import THREADS_ENV, rank_threads

if os.environ.get(THREADS_ENV):
    torch.set_num_threads(rank_threads())


# the cases that start Ray (the end-to-end runs, and the docs' command blocks that train)
RAY_GROUP_IDS = ("tests/ray/", "tests/docs/test_docs.py::test_page_quick_blocks_run_in_order")


def pytest_collection_modifyitems(config, items):
    """Mark the cases of `tests.default_suite.DEMOTED` slow (see there why each may leave the
    default run). When the whole suite is collected, every entry must name a collected test."""
    import pytest

    from tests.default_suite import DEMOTED

    ids = {item.nodeid for item in items}
    for item in items:
        if item.nodeid in DEMOTED:
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(RAY_GROUP_IDS):
            # under pytest-xdist (`--dist loadgroup`, scripts/test.sh) the Ray end-to-end cases
            # share one worker: one session Ray, started once, and never two Ray-started runs
            # of ours at a time on a 2-core machine
            item.add_marker(pytest.mark.xdist_group("ray"))
    whole = [str(a) for a in config.args] in ([], ["tests"]) or config.args == [str(config.rootpath / "tests")]
    missing = sorted(set(DEMOTED) - ids)
    if whole and missing:
        raise pytest.UsageError(f"tests/default_suite.py names tests that do not exist: {missing}")
