"""The local spawner reports results by rank and names a rank that dies without reporting."""

import os

import pytest

from ray_dhp.train.launch import spawn


def _rank_times_world(rank, world):
    return rank * world


def _second_rank_dies(rank, world):
    if rank == 1:
        os._exit(9)
    return rank


def test_results_come_back_by_rank():
    assert spawn(_rank_times_world, 3) == [0, 3, 6]


def test_a_dead_rank_is_named_not_waited_for():
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 9"):
        spawn(_second_rank_dies, 2, timeout_s=120)
