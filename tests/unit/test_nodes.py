"""Node-aware layout and the driver's multi-node checks, as plain data (no Ray cluster)."""

import itertools
import random
import socket
from types import SimpleNamespace

import pytest

from ray_dhp import cluster
from ray_dhp.topology import Topology, crossing_groups, node_local_order, nodes_by_rank


def _crossings(topo, nodes, order):
    return crossing_groups(topo, nodes_by_rank(order, nodes))


def test_rays_node_grouped_order_is_kept_when_it_is_already_node_local():
    t = Topology.build(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
    assert node_local_order(t, list("aabb")) == [0, 1, 2, 3]
    assert crossing_groups(t, list("aabb")) == []
    assert [g[0] for g in crossing_groups(t, list("abab"))] == [
        "vision sp group 0", "vision sp group 1", "text tp group 0", "text tp group 1"]


def test_disjoint_groups_of_different_sizes_are_permuted_into_nodes():
    # 4 workers on a, 2 on b: Ray's order puts vision (2) on a and splits text (4) over a and b.
    t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=4)
    nodes = list("aaaabb")
    assert [g[0] for g in crossing_groups(t, nodes)] == ["text tp group 0"]
    order = node_local_order(t, nodes)
    assert order == [2, 3, 4, 5, 0, 1]  # text on a, vision on b
    assert _crossings(t, nodes, order) == []


def test_unavoidable_crossings_are_minimised_and_reported_with_their_nodes():
    t = Topology.build(placement="collocated", vision_dp=4, vision_sp=2, text_dp=2, text_tp=4)
    nodes = list("aabbbbcc")  # identity: both tp groups cross; b can hold one whole
    assert len(crossing_groups(t, nodes)) == 2
    left = _crossings(t, nodes, node_local_order(t, nodes))
    assert [(label, n) for label, _, n in left] == [("text tp group 1", ["a", "c"])]
    # 3 + 3 workers: one tp2 group of the disjoint text side must cross, whatever the order
    t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=2, text_tp=2)
    assert len(_crossings(t, list("aaabbb"), node_local_order(t, list("aaabbb")))) == 1


def test_order_is_a_permutation_and_never_worse_than_rays(seed=0):
    rng = random.Random(seed)
    layouts = [dict(placement="collocated", vision_dp=4 // s, vision_sp=s, text_dp=4 // p,
                    text_tp=p) for s, p in itertools.product((1, 2, 4), repeat=2)]
    layouts += [dict(placement="disjoint", vision_dp=d, vision_sp=s, text_dp=e, text_tp=p)
                for d, s, e, p in itertools.product((1, 2), (1, 2, 4), (1, 2), (1, 2, 4))]
    for lay in layouts:
        t = Topology.build(**lay)
        for _ in range(10):
            cuts = sorted(rng.sample(range(1, t.world_size), rng.randint(0, min(3, t.world_size - 1))))
            sizes = [b - a for a, b in zip([0] + cuts, cuts + [t.world_size])]
            nodes = [f"n{k}" for k, size in enumerate(sizes) for _ in range(size)]
            order = node_local_order(t, nodes)
            assert sorted(order) == list(range(t.world_size))
            assert len(_crossings(t, nodes, order)) <= len(crossing_groups(t, nodes))
            inner = max(t.vision.inner, t.text.inner)
            if t.placement == "collocated" and all(s % inner == 0 for s in sizes):
                assert _crossings(t, nodes, order) == [], (lay, sizes)


def test_worker_count_must_match():
    t = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    with pytest.raises(ValueError, match="3 workers for a layout of 2"):
        node_local_order(t, list("aab"))


# -- driver checks --------------------------------------------------------------------------------

def test_shared_storage_is_a_uri_or_a_network_mount(tmp_path):
    assert cluster.is_shared_storage("s3://bucket/runs") and cluster.is_shared_storage("gs://b/x")
    assert not cluster.is_shared_storage("file:///tmp/x")
    assert not cluster.is_shared_storage(None)  # Ray's default ~/ray_results
    assert not cluster.is_shared_storage(str(tmp_path))  # a local disk on this machine


def test_storage_warning_only_with_several_nodes_and_local_storage(tmp_path):
    assert cluster._storage_warning(str(tmp_path), 1) is None
    assert cluster._storage_warning("s3://bucket/x", 3) is None
    m = cluster._storage_warning(str(tmp_path), 2)
    assert "2 nodes" in m and "local directory" in m and "shared file system" in m


def test_placement_retries_are_bounded_by_the_timeout(monkeypatch):
    import ray.train

    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    fc = cluster.bound_placement_retries(ray.train.FailureConfig(max_failures=2), 600)
    assert fc.controller_failure_limit == 9 and fc.max_failures == 2  # 10 tries of 60 s
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    assert cluster.bound_placement_retries(None, 25).controller_failure_limit == 2  # 3 x 10 s
    assert cluster.bound_placement_retries(None, None).controller_failure_limit == -1
    mine = ray.train.FailureConfig(controller_failure_limit=5)
    assert cluster.bound_placement_retries(mine, 25).controller_failure_limit == 5


def _fake_nodes(*cpus):
    return [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeID": f"{k:08x}ffff",
             "Resources": {"CPU": c}} for k, c in enumerate(cpus)]


def _preflight(monkeypatch, nodes, *, tp=4, strategy="PACK", strict=False, storage=None):
    import ray
    import ray.train

    from ray_dhp import DHPConfig, ModuleParallel, demo

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2, data_parallel=tp // 2),
                    text=ModuleParallel(tensor_parallel=tp),
                    node_local="strict" if strict else "warn")
    scaling = ray.train.ScalingConfig(num_workers=tp, resources_per_worker={"CPU": 1},
                                      placement_strategy=strategy)
    return cluster.preflight(dhp, scaling, ray.train.RunConfig(storage_path=storage))


def test_preflight_warns_when_nodes_cannot_hold_a_whole_group(monkeypatch, tmp_path):
    msgs = _preflight(monkeypatch, _fake_nodes(2, 2), storage="s3://b/x")
    assert len(msgs) == 1 and "text tp group 0 needs 4 workers on one node" in msgs[0]
    assert _preflight(monkeypatch, _fake_nodes(4, 2), storage="s3://b/x") == []
    with pytest.raises(ValueError, match="node_local=strict"):
        _preflight(monkeypatch, _fake_nodes(2, 2), strict=True, storage="s3://b/x")
    msgs = _preflight(monkeypatch, _fake_nodes(4, 4), strategy="SPREAD", storage=str(tmp_path))
    assert any("SPREAD" in m for m in msgs) and any("local directory" in m for m in msgs)
    assert _preflight(monkeypatch, _fake_nodes(8), storage=str(tmp_path)) == []  # one node


# -- the CLI joins a running cluster --------------------------------------------------------------

def _rf(num_cpus=None):
    return SimpleNamespace(run=SimpleNamespace(num_cpus=num_cpus),
                           scaling=SimpleNamespace(resources_per_worker=None))


def test_init_ray_joins_a_running_cluster_else_starts_a_local_one(monkeypatch, tmp_path):
    import ray

    from ray_dhp.cli import train

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    (tmp_path / "ray").mkdir()
    address_file = tmp_path / "ray" / "ray_current_cluster"

    train.init_ray(_rf(), 2)  # no cluster at all
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] >= 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address_file.write_text(f"127.0.0.1:{port}")  # stale: nothing listens there
    train.init_ray(_rf(), 2)
    assert calls[-1]["address"] == "local"
    with socket.socket() as s:  # a "GCS" that answers: join it, without num_cpus
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = f"127.0.0.1:{s.getsockname()[1]}"
        address_file.write_text(addr)
        train.init_ray(_rf(num_cpus=4), 2)
    assert calls[-1] == {"address": addr}
