"""Node-aware layout and the driver's multi-node checks, as plain data (no Ray cluster)."""

import itertools
import random
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_dhp.train import cluster
from ray_dhp.parallel.nodes import crossing_groups, node_local_order, nodes_by_rank
from ray_dhp.parallel.topology import Topology

ROOT = Path(__file__).resolve().parents[2]


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
            k = rng.randint(0, min(3, t.world_size - 1))
            cuts = sorted(rng.sample(range(1, t.world_size), k))
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


# -- driver checks ------------------------------------------------------------------------------

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


# -- the CLI joins a running cluster ------------------------------------------------------------

def _rf(num_cpus=None):
    return SimpleNamespace(run=SimpleNamespace(num_cpus=num_cpus, ray_address=None),
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


# -- plan --nodes and the cost model ------------------------------------------------------------

def test_plan_nodes_view_marks_what_crosses_the_boundary(capsys, monkeypatch):
    import ray

    from ray_dhp.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("plan must not start Ray"))
    tiny = str(ROOT / "examples" / "tiny.yaml")  # collocated SP2/TP2 on 2 workers
    assert main(["plan", tiny, "--nodes", "1", "--gpus-per-node", "2"]) == 0
    one = capsys.readouterr().out
    assert "node 0: ranks 0, 1" in one and "CROSSES" not in one
    assert main(["plan", tiny, "--nodes", "2", "--gpus-per-node", "1"]) == 0
    two = capsys.readouterr().out
    assert "node 1: ranks 1" in two
    for name in ("vision sp all-to-all", "text tp all-reduce", "vision gradients"):
        assert any(line.strip().startswith(name) and "CROSSES nodes 0|1" in line
                   for line in two.splitlines()), name
    assert main(["plan", tiny, "--nodes", "1", "--gpus-per-node", "1"]) == 2
    assert "1 node(s) x 1 GPU(s) hold 1" in capsys.readouterr().err


def test_cost_model_charges_the_network_only_where_groups_cross():
    from ray_dhp import demo
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Hardware, Layout, Workload, phase_times
    from ray_dhp.planning.traffic import collective_bytes

    config = demo.tiny_model_config()
    counts = count_params(config)
    w = Workload(1024, 64, 4)
    lay = Layout("collocated", "sequential", 2, 2, 2, 2)  # sp2 x dp2, tp2 x dp2
    fast, slow = Hardware(gpus_per_node=2), Hardware(gpus_per_node=1)
    p_fast = phase_times(config, counts, lay, w, fast)
    p_slow = phase_times(config, counts, lay, w, slow)
    assert p_slow.text_comm > p_fast.text_comm and p_slow.vision_comm > p_fast.vision_comm
    vol = collective_bytes(config, counts, lay, w)
    # the TP part of the text time is exactly (volume / bandwidth + latency) per all-reduce
    n_ar = config.text_config.num_hidden_layers * 4 + 1
    assert p_fast.text_comm == pytest.approx(vol["text tp all-reduce"] / fast.link_bw
                                             + n_ar * fast.latency_s)
    assert p_slow.text_comm == pytest.approx(vol["text tp all-reduce"] / slow.internode_bw
                                             + n_ar * slow.latency_s)
    # a disjoint split whose text group only fits if permuted: vision sp2 + text tp4 on 4 + 2
    lay = Layout("disjoint", "sequential", 2, 1, 4, 1)
    # (ranks 0-3 | 4-5: text 2-5 would cross; the backend's order puts text on the 4-GPU node)
    hw = Hardware(gpus_per_node=4)
    p = phase_times(config, counts, lay, w, hw)
    tp_bytes = collective_bytes(config, counts, lay, w)["text tp all-reduce"]
    assert p.text_comm == pytest.approx(tp_bytes / hw.link_bw + n_ar * hw.latency_s)


# -- the backend's on_start with a fake worker group --------------------------------------------

class _FakeGroup:
    """Workers on given nodes; records what each worker was told."""

    def __init__(self, nodes):
        self.workers = [SimpleNamespace(metadata=SimpleNamespace(
            node_ip="10.0.0.1", node_id=f"{n}" * 12)) for n in nodes]
        self.env = {}

    def __len__(self):
        return len(self.workers)

    def get_workers(self):
        return self.workers

    def execute_single(self, w, fn, *args):
        return (f"addr-of-worker-{w}", 1234)

    def execute_single_async(self, w, fn, *args):
        self.env[w] = args
        return w


def _on_start(monkeypatch, nodes, node_local="warn", **layout):
    import ray

    from ray_dhp import DHPConfig, ModuleParallel, demo
    from ray_dhp.train.backend import DisaggregatedBackend

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=layout["sp"],
                                          data_parallel=layout["vdp"]),
                    text=ModuleParallel(tensor_parallel=layout["tp"], data_parallel=layout["tdp"]),
                    placement=layout["placement"], node_local=node_local)
    group = _FakeGroup(nodes)
    DisaggregatedBackend().on_start(group, dhp)
    return group


def test_backend_orders_ranks_by_node_and_rendezvous_at_dhp_rank_0(monkeypatch, caplog):
    # disjoint vision sp2 + text tp4 on nodes of 4 (a) and 2 (b): text goes to a, vision to b
    g = _on_start(monkeypatch, "aaaabb", placement="disjoint", sp=2, vdp=1, tp=4, tdp=1)
    ranks = {w: args[2] for w, args in g.env.items()}
    assert ranks == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert {args[0] for args in g.env.values()} == {"addr-of-worker-4"}  # DHP rank 0's worker
    assert all(args[3] == "" for args in g.env.values())
    assert "cross a node boundary" not in caplog.text


def test_backend_warns_or_refuses_a_group_across_nodes(monkeypatch, caplog):
    import logging

    # one worker per node: the sp2 and tp2 groups of a collocated SP2/TP2 cannot be node-local
    layout = dict(placement="collocated", sp=2, vdp=1, tp=2, tdp=1)
    with caplog.at_level(logging.WARNING, logger="ray_dhp"):
        g = _on_start(monkeypatch, "ab", **layout)
    assert "vision sp group 0 (ranks [0, 1]) spans nodes 10.0.0.1/aaaaaaaa, 10.0.0.1/bbbbbbbb" \
        in caplog.text and "text tp group 0 (ranks [0, 1])" in caplog.text
    assert "{10.0.0.1/aaaaaaaa: 1, 10.0.0.1/bbbbbbbb: 1}" in caplog.text
    assert all(args[3] == "" for args in g.env.values())
    caplog.clear()
    g = _on_start(monkeypatch, "ab", "strict", **layout)
    assert all("text tp group 0" in args[3] for args in g.env.values())  # the workers raise it
    assert "cross a node boundary" not in caplog.text  # an error then, not a warning
