"""Placement groups and node labels per group (issue #45), as plain data (no Ray cluster): the
grouping and its refusals, the rank blocks per group, the per-worker label selectors, the DHP
rank order under Ray Train's node-sorted world ranks, and the driver's refusal of a cluster
without enough labelled nodes."""

import itertools
import random
import time
from types import SimpleNamespace

import pytest

from ray_dhp import DHPConfig, ModuleParallel, demo
from ray_dhp.cli.schema import ConfigError
from ray_dhp.parallel.nodes import crossing_groups, node_local_order, nodes_by_rank
from ray_dhp.parallel.topology import EncoderDegrees, Topology, placement_groups
from ray_dhp.run_file import run_file_from_dict
from ray_dhp.train import cluster
from ray_dhp.train.labels import LabelRefusal, selector_matches

NAMES = ("vision", "audio", "text")


def _cfg(placement="collocated", sp=2, tp=2, **kw):
    return DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                     vision=ModuleParallel(sequence_parallel=sp),
                     text=ModuleParallel(tensor_parallel=tp), placement=placement, **kw)


def test_groupings_are_put_in_module_order_and_the_shorthands_are_the_extremes():
    assert placement_groups("collocated", NAMES) == (NAMES,)
    assert placement_groups("disjoint", NAMES) == (("vision",), ("audio",), ("text",))
    assert placement_groups([["audio"], ["text", "vision"]], NAMES) == (
        ("vision", "text"), ("audio",))
    # a grouping that is a shorthand is stored as that shorthand
    assert _cfg([["vision", "text"]]).placement == "collocated"
    assert _cfg([["text"], ["vision"]], tp=1).placement == "disjoint"


@pytest.mark.parametrize("placement, match", [
    ([["vision", "text"], ["vision"]], r"module 'vision' is in group 0 and group 1"),
    ([["vision"]], r"module\(s\) \['text'\] are in no group"),
    ([["vision"], ["text", "audio"]], r"placement\[1\]: unknown module 'audio'"),
    ([["vision"], []], r"placement\[1\]=\[\]: each group is a non-empty list"),
    ("mixed", r"placement='mixed' is not known"),
])
def test_bad_groupings_are_refused_naming_the_key(placement, match):
    with pytest.raises(ValueError, match=match):
        _cfg(placement)


def test_a_group_whose_modules_differ_in_size_is_refused():
    # vision 2 workers, text 1: they cannot share a group's workers
    with pytest.raises(ValueError, match=r"collocated placement needs every module group to "
                                         r"span the same workers, but vision uses 1x2=2 and "
                                         r"text 1x1=1"):
        _cfg([["vision", "text"]], tp=1)
    with pytest.raises(ValueError, match=r"the placement group \['vision', 'text'\] needs"):
        Topology.build(placement=[["vision", "text"], ["audio"]], vision_dp=1, vision_sp=2,
                       text_dp=1, text_tp=1, encoders={"audio": EncoderDegrees(dp=1)})


def test_a_mixed_grouping_gives_each_group_its_own_block_of_ranks():
    # vision sp2 + text tp2 share ranks 0-1; audio dp3 has ranks 2-4
    t = Topology.build(placement=[["vision", "text"], ["audio"]], vision_dp=1, vision_sp=2,
                       text_dp=1, text_tp=2, encoders={"audio": EncoderDegrees(dp=3)})
    assert (t.world_size, t.placement) == (5, "grouped")
    assert [(g.names, g.ranks) for g in t.placement_groups()] == [
        (("vision", "text"), [0, 1]), (("audio",), [2, 3, 4])]
    assert [t.roles(r) for r in range(5)] == [("vision", "text")] * 2 + [("audio",)] * 3
    assert "placement=vision+text | audio world_size=5" in t.describe()
    # audio + text collocated, vision alone: vision first (its group's first module comes first)
    t = Topology.build(placement=[["audio", "text"], ["vision"]], vision_dp=1, vision_sp=2,
                       text_dp=1, text_tp=2, encoders={"audio": EncoderDegrees(dp=2)})
    assert [(g.names, g.ranks) for g in t.placement_groups()] == [
        (("vision",), [0, 1]), (("audio", "text"), [2, 3])]


def test_labels_become_one_selector_per_rank_in_rank_order():
    cfg = _cfg("disjoint", sp=1, labels={"vision": {"accel": "small"}, "text": {"accel": "big"}})
    assert cfg.label_selectors() == [{"accel": "small"}, {"accel": "big"}, {"accel": "big"}]
    assert cfg.schedule == "pipelined"
    assert _cfg(labels={"text": {"accel": "big"}}).label_selectors() == [{"accel": "big"}] * 2
    assert _cfg().label_selectors() is None
    with pytest.raises(ValueError, match=r"labels.vision.accel='a' and labels.text.accel='b': "
                                         r"vision and text share workers"):
        _cfg(labels={"vision": {"accel": "a"}, "text": {"accel": "b"}})
    with pytest.raises(ValueError, match=r"labels.audio: unknown module"):
        _cfg(labels={"audio": {"accel": "a"}})
    with pytest.raises(ValueError, match=r"labels.text: .*Invalid label selector value"):
        _cfg(labels={"text": {"accel": "-x"}})


def test_the_run_file_takes_the_grouping_and_labels_and_names_its_keys():
    raw = {"vision": {"sequence_parallel": 1}, "text": {"tensor_parallel": 2},
           "placement": {"mode": [["text"], ["vision"]],
                         "labels": {"vision": {"accel": "small"}, "text": {"accel": "big"}}}}
    cfg = run_file_from_dict(raw).dhp_config()
    assert cfg.placement == "disjoint" and cfg.label_selectors()[0] == {"accel": "small"}
    over = run_file_from_dict({}, ["placement=[[vision], [text]]", "vision.sequence_parallel=1"])
    assert over.dhp_config().placement == "disjoint"
    with pytest.raises(ConfigError, match=r"placement.labels.vision.accel='a'"):
        run_file_from_dict({"placement": {"labels": {"vision": {"accel": "a"},
                                                     "text": {"accel": "b"}}}}).dhp_config()


def test_trainer_hands_ray_train_the_selectors_and_refuses_two_sources():
    import ray.train

    from ray_dhp.train.trainer import _with_label_selectors

    cfg = _cfg("disjoint", sp=1, labels={"vision": {"accel": "small"}})
    sc = _with_label_selectors(ray.train.ScalingConfig(num_workers=3), cfg)
    assert sc.label_selector == [{"accel": "small"}, {}, {}]
    with pytest.raises(ValueError, match=r"set the labels in DHPConfig only"):
        _with_label_selectors(ray.train.ScalingConfig(num_workers=3,
                                                      label_selector={"a": "b"}), cfg)


def test_ray_selector_syntax_is_matched():
    node = {"accel": "big", "zone": "a"}
    assert selector_matches(node, {"accel": "big"}) and not selector_matches(node, {"accel": "small"})
    assert selector_matches(node, {"accel": "!small"}) and not selector_matches(node, {"accel": "!big"})
    assert selector_matches(node, {"accel": "in(big, huge)", "zone": "a"})
    assert not selector_matches(node, {"accel": "!in(big, huge)"})
    assert not selector_matches({}, {"accel": "big"}) and selector_matches({}, {"accel": "!big"})


# -- Ray Train's world ranks vs the bundles placed for each group --------------------------------

def test_each_worker_keeps_a_rank_of_the_group_its_bundle_was_placed_for(seed=0):
    """Ray Train numbers workers by node (first appearance in bundle order), not by bundle: with
    labels, every worker's DHP rank stays in its bundle's placement group, and the order packs
    each group's sp/tp groups into nodes where the bundle order does not."""
    rng = random.Random(seed)
    layouts = [dict(placement=[["vision", "text"], ["audio"]], vision_dp=2 // s, vision_sp=s,
                    text_dp=2 // p, text_tp=p, encoders={"audio": EncoderDegrees(dp=a)})
               for s, p, a in itertools.product((1, 2), (1, 2), (1, 2, 3))]
    layouts += [dict(placement="disjoint", vision_dp=1, vision_sp=s, text_dp=d, text_tp=p)
                for s, d, p in itertools.product((1, 2), (1, 2), (1, 2, 4))]
    for lay in layouts:
        t = Topology.build(**lay)
        groups = t.placement_groups()
        for _ in range(10):
            # each group's bundles on nodes of its own label, sizes at random
            node_of_bundle = []
            for k, g in enumerate(groups):
                cuts = sorted(rng.sample(range(1, g.size), rng.randint(0, g.size - 1)))
                sizes = [b - a for a, b in zip([0] + cuts, cuts + [g.size])]
                node_of_bundle += [f"g{k}n{j}" for j, n in enumerate(sizes) for _ in range(n)]
            rng.shuffle(node_of_bundle)  # which bundle lands where within a label is Ray's pick
            node_of_bundle.sort(key=lambda n: n[:2])
            # Ray Train: workers grouped by node, nodes by first appearance in bundle order
            seen = list(dict.fromkeys(node_of_bundle))
            bundles = sorted(range(t.world_size), key=lambda b: seen.index(node_of_bundle[b]))
            nodes = [node_of_bundle[b] for b in bundles]
            order = node_local_order(t, nodes, bundles)
            assert sorted(order) == list(range(t.world_size))
            for w, r in enumerate(order):
                assert t.roles(r) == t.roles(bundles[w]), (lay, nodes, bundles, order)
            by_bundle = nodes_by_rank(bundles, nodes)
            assert len(crossing_groups(t, nodes_by_rank(order, nodes))) <= len(
                crossing_groups(t, by_bundle))


def test_a_reordered_worker_goes_back_to_its_group():
    # vision (small) on ranks 0-1, text (big) on 2-3; bundle 1 (vision) and bundle 2 (text)
    # landed on nodes Ray sorted the other way round
    t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    nodes, bundles = ["big1", "big1", "small", "small"], [2, 3, 0, 1]
    assert node_local_order(t, nodes, bundles) == [2, 3, 0, 1]
    assert node_local_order(t, nodes) == [0, 1, 2, 3]  # without labels: Ray's order is fine
    # tests/ray/test_labels.py's cluster: vision DP2 on the small node (2 workers), text TP2 on
    # two big nodes (1 each). Unpinned, packing would put the text TP group on the small node.
    t = Topology.build(placement="disjoint", vision_dp=2, vision_sp=1, text_dp=1, text_tp=2)
    nodes = ["small", "small", "big1", "big2"]
    assert node_local_order(t, nodes) == [2, 3, 0, 1]  # text on small: against the labels
    assert node_local_order(t, nodes, [0, 1, 2, 3]) == [0, 1, 2, 3]


# -- the driver's refusal of a cluster without the labelled nodes -------------------------------

def _nodes(*spec):
    return [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeID": f"{k:08x}ffff",
             "Resources": {"CPU": cpus}, "Labels": labels} for k, (labels, cpus) in enumerate(spec)]


def test_fit_refuses_missing_labels_in_the_driver_naming_label_and_counts(monkeypatch):
    import ray
    import ray.train

    cfg = _cfg("disjoint", sp=2, tp=2,
               labels={"vision": {"accel": "small"}, "text": {"accel": "big"}})
    scaling = ray.train.ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    run = ray.train.RunConfig(storage_path="s3://b/x")
    # two big nodes, one small node with room for one worker: vision needs 2
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(({"accel": "big"}, 2), ({"accel": "big"}, 2),
                                                     ({"accel": "small"}, 1)))
    t0 = time.monotonic()
    with pytest.raises(LabelRefusal) as e:
        cluster.preflight(cfg, scaling, run)
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert ("the placement group(s) vision need 2 worker(s) of {'CPU': 1} on nodes labelled "
            "accel=small (labels.vision), but the cluster has 1 alive node(s) with that label, "
            "with room for 1 such worker(s)") in msg
    # no small node at all: found 0, and the values the cluster has are named
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(({"accel": "big"}, 4)))
    with pytest.raises(LabelRefusal, match=r"has 0 alive node\(s\) with that label, with room "
                                           r"for 0 .*Values of these label keys on the "
                                           r"cluster's nodes: \['accel=big'\]"):
        cluster.preflight(cfg, scaling, run)
    # enough of both: no refusal
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(({"accel": "big"}, 2), ({"accel": "small"}, 2)))
    assert cluster.preflight(cfg, scaling, run) == []


def test_groups_with_the_same_labels_are_counted_together():
    from ray_dhp.train.labels import check_labelled_nodes

    t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    labels = {"vision": {"accel": "big"}, "text": {"accel": "big"}}
    with pytest.raises(LabelRefusal, match=r"vision and text need 4 worker"):
        check_labelled_nodes(t, labels, _nodes(({"accel": "big"}, 3)), {"CPU": 1})
    check_labelled_nodes(t, labels, _nodes(({"accel": "big"}, 3), ({"accel": "big"}, 1)),
                         {"CPU": 1})


def test_backend_places_ranks_by_bundle_when_labels_are_set(monkeypatch):
    """`DisaggregatedBackend.on_start` reads each worker's bundle: rank r runs where bundle r's
    labels put it, whatever order Ray Train numbered the workers in."""
    import ray

    from ray_dhp.train.backend import DisaggregatedBackend

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    cfg = _cfg("disjoint", sp=1, tp=2,
               labels={"vision": {"accel": "small"}, "text": {"accel": "big"}})
    # world order (by node): the big node's two text bundles first, then the small node
    workers = [SimpleNamespace(metadata=SimpleNamespace(node_ip="10.0.0.1", node_id=n * 12),
                               placement_group_bundle_index=b)
               for n, b in (("b", 1), ("b", 2), ("s", 0))]
    env = {}

    class Group:
        def __len__(self):
            return len(workers)

        def get_workers(self):
            return workers

        def execute_single(self, w, fn, *args):
            return ("addr", 1)

        def execute_single_async(self, w, fn, *args):
            env[w] = args

    DisaggregatedBackend().on_start(Group(), cfg)
    assert {w: a[2] for w, a in env.items()} == {0: 1, 1: 2, 2: 0}
