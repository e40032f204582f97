"""Micro-batch schedules are permutations of the same phases, with dependencies respected."""

import pytest

from ray_dhp.parallel.zero import owners as zero1_owners
from ray_dhp.step.schedule import order_for, pipelined_order, sequential_order


@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_pipelined_respects_dependencies_and_bounds_in_flight(m):
    order = pipelined_order(m)
    assert sorted(order) == sorted(sequential_order(m))
    pos = {x: i for i, x in enumerate(order)}
    in_flight, worst = 0, 0
    for k in range(m):
        assert pos[("vision_fwd", k)] < pos[("send_features", k)] < pos[("text_fwd_bwd", k)] \
            < pos[("return_grads", k)]
    for phase, _ in order:  # vision activations alive between vision_fwd and return_grads
        in_flight += {"vision_fwd": 1, "return_grads": -1}.get(phase, 0)
        worst = max(worst, in_flight)
    assert worst <= 2
    if m > 1:  # text work of k is scheduled before the vision forward of k + 1 is waited for
        assert pos[("text_fwd_bwd", 0)] < pos[("vision_fwd", 1)]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="use one of"):
        order_for("zigzag", 2)


def test_zero1_partition_is_balanced_and_deterministic():
    sizes = [100, 10, 10, 50, 40, 1, 1]
    owners = zero1_owners(sizes, 2)
    assert owners == zero1_owners(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert max(load) - min(load) <= 10 and set(owners) == {0, 1}
