"""Ranks -> roles and module groups (pure data, no process group)."""

import pytest
import torch

from ray_dhp.parallel.boundary import plan_boundary, split_evenly
from ray_dhp.parallel.topology import Topology


def test_collocated_meshes_span_all_workers():
    t = Topology.build(placement="collocated", vision_dp=2, vision_sp=2, text_dp=1, text_tp=4)
    assert t.world_size == 4
    assert all(t.roles(r) == ("vision", "text") for r in range(4))
    assert t.vision.mesh() == [[0, 1], [2, 3]]          # ("dp", "sp"), sp innermost
    assert t.vision.dp_groups() == [[0, 2], [1, 3]]
    assert t.text.mesh() == [[0, 1, 2, 3]]              # ("dp", "tp")
    assert t.vision.coord(3) == (1, 1) and t.text.coord(3) == (0, 3)


def test_disjoint_groups_partition_workers_and_may_differ_in_size():
    t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=3, text_tp=2)
    assert t.world_size == 8
    assert [t.roles(r) for r in range(8)] == [("vision",)] * 2 + [("text",)] * 6
    assert t.text.mesh() == [[2, 3], [4, 5], [6, 7]]
    assert t.text.dp_groups() == [[2, 4, 6], [3, 5, 7]]
    assert t.vision.coord(2) is None and t.text.coord(1) is None
    assert "rank 7: text(dp=2, tp=1)" in t.describe()


@pytest.mark.parametrize("kwargs, match", [
    (dict(placement="diagonal", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1), "placement"),
    (dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=4), "products match"),
    (dict(placement="disjoint", vision_dp=0, vision_sp=2, text_dp=1, text_tp=1), "positive integer"),
])
def test_bad_layouts_fail_with_a_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology.build(**kwargs)


def test_split_evenly_is_contiguous_and_balanced():
    assert [list(r) for r in split_evenly(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in split_evenly(7, 3)] == [3, 2, 2]


def _boundary_roundtrip(topo, held, needed):
    """Simulate the all-to-all with the plans of every rank; return (forward rows, grads)."""
    W = topo.world_size
    plans = [plan_boundary(topo, r, held, needed) for r in range(W)]
    # forward: each rank's received ids, in its text order
    out = {}
    for r in range(W):
        if r not in needed:
            continue
        chunks = [held[s][plans[s].send_pos[r]] for s in range(W) if s in held]
        recv = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)
        assert [c.numel() for c in chunks] == [plans[r].recv_counts[s] for s in range(W) if s in held]
        out[r] = recv[plans[r].recv_perm]
    return plans, out


def test_boundary_plan_delivers_rows_in_the_order_a_text_rank_needs_them():
    """A packing replica needs its rows in its samples' packed order (`pack_order`), not
    ascending: the plan receives them in that order, and the gradients go back row by row."""
    topo = Topology.build(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1)
    held = {0: torch.tensor([0, 1, 2, 3, 4]), 1: torch.tensor([5, 6, 7, 8, 9])}
    needed = {0: torch.tensor([7, 8, 0, 1, 5]), 1: torch.tensor([4, 2, 3, 9, 6])}
    plans, out = _boundary_roundtrip(topo, held, needed)
    assert out[0].tolist() == [7, 8, 0, 1, 5] and out[1].tolist() == [4, 2, 3, 9, 6]
    for r in (0, 1):  # the gradient of each received row lands back on that row
        g = torch.zeros(10, dtype=torch.long)
        grad = needed[r] * 10  # a row's gradient: ten times its id
        back = torch.empty_like(grad)
        back[plans[r].recv_perm] = grad
        off = 0
        for src in range(2):
            n = plans[r].recv_counts[src]
            g[held[src][plans[src].send_pos[r]]] += back[off:off + n]
            off += n
        assert g[needed[r]].tolist() == (needed[r] * 10).tolist()


def test_boundary_plan_delivers_each_text_rank_its_rows_and_one_gradient_per_row():
    topo = Topology.build(placement="disjoint", vision_dp=2, vision_sp=2, text_dp=1, text_tp=2)
    # vision replica 0 holds rows 0..5 (window-permuted), replica 1 rows 6..9; text needs all.
    held = {0: torch.tensor([2, 0, 1]), 1: torch.tensor([5, 3, 4]),
            2: torch.tensor([7, 6]), 3: torch.tensor([9, 8])}
    needed = {4: range(0, 10), 5: range(0, 10)}
    plans, out = _boundary_roundtrip(topo, held, needed)
    for r in (4, 5):
        assert out[r].tolist() == list(range(10))           # replicated over TP, in order
    assert plans[4].returns_grad and not plans[5].returns_grad
    for v in range(4):  # each vision row gets its gradient from exactly one rank (text tp 0)
        srcs = [d for d in range(6) if plans[v].grad_sources[d]]
        assert srcs == [4]
        assert sorted(plans[v].send_pos[4].tolist()) == list(range(len(held[v])))
