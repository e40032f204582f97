"""The invariant, family by family: a DHP step updates every parameter exactly as one process
training the unsharded stock model (`ray_dhp.step.reference`) would, under every layout of the
family's row. The rows (layouts, default cases, tolerances with their reasons, per-family checks)
are data in `tests/distributed/family_rows.py`; one case per (family, layout), ids
``<family>-<layout>``; the default run keeps a few per family, the rest run with ``-m slow``.

Both sides get the same micro-batches (mixed image sizes and a text-only sample), seed and
hyper-parameters; every rank's copy of every tensor is compared (a drifting replica fails:
`test_parity.py::test_a_drifting_replica_is_caught`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.family_rows import cases
from tests.distributed.parity import assert_parity, run_engine, shared_reference


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``get(row)`` -> (steps, fp64 single-process reference) of the row's family, configuration
    and steps (shared with the family's own file: `parity.shared_reference`)."""
    def get(row):
        _, steps, ref = shared_reference(tmp_path_factory, row.family, row.cfg, make=row.make)
        return steps, ref

    return get


CASES = [pytest.param(c, id=f"{c.row.family}-{c.id}",
                      marks=() if c.id in c.row.default else (pytest.mark.slow,)) for c in cases()]


@pytest.mark.parametrize("case", CASES)
def test_family_is_exact(case, references):
    row = case.row
    steps, ref = references(row)
    cfg = dataclasses.replace(row.cfg, **case.changes)
    layout = dict(case.layout)
    schedule = layout.pop("schedule", "sequential")  # a disjoint row's schedule
    got = run_engine(row.family, layout, cfg, steps, torch.float64, schedule, grads=row.grads)
    worst = assert_parity(got, ref, **row.tols)
    if row.check is not None:
        row.check(got, ref, case)
    if worst is not None:
        print(f"{row.family} {case.id}: worst update error {worst[0]:.2e}, parameter {worst[1]:.2e} "
              f"({worst[2]})")
