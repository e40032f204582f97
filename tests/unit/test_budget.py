"""Token-budget micro-batches: in order, within the budget per text replica, every replica fed."""

import pytest

from ray_dhp.data.budget import cut_micro_batches
from ray_dhp.parallel.boundary import split_evenly


def _share(lengths, rng, replicas):
    part = [lengths[i] for i in rng]
    return max(sum(part[i] for i in r) for r in split_evenly(len(part), replicas))


def test_fixed_count_is_the_plain_split():
    assert cut_micro_batches([5] * 8, micro_batches=4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


@pytest.mark.parametrize("replicas, min_size", [(1, 1), (2, 2), (2, 3)])
def test_budget_cuts_cover_the_step_in_order_within_budget(replicas, min_size):
    lengths = [30, 50, 20, 70, 10, 40, 60, 25, 35, 45, 15, 55]
    cuts = cut_micro_batches(lengths, budget=100, replicas=replicas, min_size=min_size)
    assert [i for r in cuts for i in r] == list(range(len(lengths)))  # each sample once, in order
    assert all(len(r) >= min_size for r in cuts)
    assert all(_share(lengths, r, replicas) <= 100 for r in cuts)
    # greedy: the next sample would not have fitted (the last two cuts may be rebalanced so
    # that the tail keeps min_size samples)
    for r in cuts[:-2]:
        assert _share(lengths, range(r.start, r.stop + 1), replicas) > 100


def test_budget_too_small_for_one_sample_per_replica_names_the_fix():
    with pytest.raises(ValueError, match="micro_batch_tokens=50 is too small"):
        cut_micro_batches([60, 10, 10], budget=50, replicas=1, min_size=1)


def test_small_tail_keeps_min_size():
    cuts = cut_micro_batches([10, 10, 10, 10, 10], budget=40, replicas=2, min_size=2)
    assert all(len(r) >= 2 for r in cuts) and [i for r in cuts for i in r] == list(range(5))
