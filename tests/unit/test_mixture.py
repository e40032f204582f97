"""Several datasets mixed with sampling ratios: exact ratios, per-dataset epochs, exact resume,
bad samples per dataset, one dataset as the mixture of it alone, and resume of states written
by the previous sampler (no process group)."""

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_dhp import demo
from ray_dhp.data.mixture import DataSource, mixture_permutation
from ray_dhp.data.sample import BadSample
from ray_dhp.data.reading import Record, read_annotations, resolve_data_root
from ray_dhp.data.sampler import OldSamplerState, StepSampler
from ray_dhp.data.sources import load_sources
from ray_dhp.config.train_loop import TrainLoopConfig, check_dataset_weights

FIXTURE = Path(__file__).parent / "fixtures" / "sampler_states_da3a5fe.json"


class _Echo:
    """Processor stand-in: a record becomes (record, root); records whose data says bad raise."""

    def process(self, record, root, *, max_tokens=None, **limits):
        if record.data.get("bad"):
            raise BadSample("marked bad", record.where)
        return SimpleNamespace(record=record, root=root, index=None)


def _records(name, n, bad=()):
    return [Record(i, {"id": f"{name}{i}", "bad": i in bad}, f"{name}.jsonl", i + 1)
            for i in range(n)]


def _mix(sizes: dict, weights: dict, seed=0, bad=None, **cfg):
    bad = bad or {}
    sources = [DataSource(n, _records(n, k, bad.get(n, ())), f"/data/{n}", weights.get(n))
               for n, k in sizes.items()]
    return StepSampler.from_sources(sources, _Echo(), TrainLoopConfig(seed=seed, **cfg).sampler_config())


def _draws(sampler, k):
    return [sampler.next_index() for _ in range(k)]


def test_measured_ratios_match_the_weights_over_any_window():
    s = _mix({"coco": 50, "ocr": 7, "vqa": 300}, {"coco": 0.5, "ocr": 0.3, "vqa": 0.2})
    names = [s.dataset_of(i) for i in _draws(s, 1000)]
    counts = Counter(names)
    for name, w in {"coco": 0.5, "ocr": 0.3, "vqa": 0.2}.items():
        assert abs(counts[name] / 1000 - w) <= 0.01, counts
    # not only on average: every prefix is within about one draw of its share
    seen = Counter()
    for n, name in enumerate(names, start=1):
        seen[name] += 1
        for d, w in {"coco": 0.5, "ocr": 0.3, "vqa": 0.2}.items():
            assert abs(seen[d] - n * w) < 1, (n, seen)
    assert s.draws == dict(counts)


def test_weights_are_ratios_not_probabilities():
    a = _mix({"a": 10, "b": 10}, {"a": 7, "b": 3})
    b = _mix({"a": 10, "b": 10}, {"a": 0.7, "b": 0.3})
    assert _draws(a, 200) == _draws(b, 200)


def test_each_dataset_epoch_visits_each_of_its_records_once_and_wraps_on_its_own():
    s = _mix({"big": 40, "small": 6}, {"big": 0.5, "small": 0.5})
    draws = _draws(s, 80)  # 40 from each: big's first epoch, small's epochs 0..5 + 4 draws
    big = [i for i in draws if s.dataset_of(i) == "big"]
    small = [i for i in draws if s.dataset_of(i) == "small"]
    assert sorted(big) == list(range(40))  # "big" sorts first: global 0..39
    for e in range(6):
        assert sorted(small[6 * e:6 * e + 6]) == list(range(40, 46))
    # different epochs of the small dataset use different orders
    assert len({tuple(small[6 * e:6 * e + 6]) for e in range(6)}) > 1
    assert s.epochs == {"big": 0, "small": 6} and s.epoch == 0
    assert [r.index for r in s.records] == list(range(46))
    assert s.root_for(3) == "/data/big" and s.root_for(45) == "/data/small"


def test_order_depends_on_seed_and_not_on_other_datasets():
    a = _mix({"x": 20, "y": 20}, {"x": 1, "y": 1}, seed=1)
    b = _mix({"x": 20, "y": 20}, {"x": 1, "y": 1}, seed=1)
    c = _mix({"x": 20, "y": 20}, {"x": 1, "y": 1}, seed=2)
    da, db, dc = _draws(a, 60), _draws(b, 60), _draws(c, 60)
    assert da == db and da != dc
    # adding a third dataset changes how often x is drawn, not the order within x
    d = _mix({"x": 20, "y": 20, "z": 5}, {"x": 1, "y": 1, "z": 1}, seed=1)
    only_x = [i for i in da if a.dataset_of(i) == "x"]
    assert [i for i in _draws(d, 90) if d.dataset_of(i) == "x"][:len(only_x)] == only_x


def test_resume_mid_epoch_continues_with_exactly_the_same_indices():
    def fresh():
        return _mix({"a": 13, "b": 5, "c": 29}, {"a": 2, "b": 1, "c": 1}, seed=7,
                    bad={"b": {2}}, global_batch_size=4, micro_batches=2)

    ref = fresh()
    for _ in range(9):  # b (5 records) is past its first epoch, a and c mid-epoch
        ref.next_step()
    state = ref.state_dict()
    expected = [[x.index for x in mb] for _ in range(6) for mb in ref.next_step()]
    assert set(state["datasets"]) == {"a", "b", "c"} and state["datasets"]["b"]["bad"] == [2]
    assert state["datasets"]["b"]["epoch"] >= 1 and 0 < state["datasets"]["a"]["pos"] < 13

    resumed = fresh()
    resumed.load_state_dict(state)
    assert resumed.skipped == 1 and resumed.epochs == {k: v["epoch"] for k, v in
                                                       state["datasets"].items()}
    assert [[x.index for x in mb] for _ in range(6) for mb in resumed.next_step()] == expected
    assert resumed.state_dict() == ref.state_dict()


def test_bad_records_of_each_dataset_are_skipped_and_counted_once():
    s = _mix({"a": 6, "b": 4}, {"a": 1, "b": 1}, bad={"a": {1, 4}, "b": {0}}, global_batch_size=5)
    for _ in range(8):  # 40 good samples: both datasets wrap several times
        step = s.next_step()
        assert sum(len(mb) for mb in step) == 5
        assert not any(x.record.data["bad"] for mb in step for x in mb)
    assert s.skipped == 3 and s.bad == {1, 4, 6}
    assert min(s.epochs.values()) >= 2


def test_a_dataset_with_no_valid_record_is_named():
    s = _mix({"good": 8, "broken": 3}, {"good": 1, "broken": 1}, bad={"broken": {0, 1, 2}})
    with pytest.raises(ValueError, match="every record of dataset 'broken' is bad"):
        for _ in range(5):
            s.next_step()


def test_a_single_dataset_is_the_mixture_of_it_alone():
    """No second order for one dataset: the same draws and state as the mixture {"train": 1}."""
    recs = _records("t", 11)
    s = StepSampler(recs, _Echo(), "/r", TrainLoopConfig(seed=5).sampler_config())
    t = StepSampler.from_sources([DataSource("train", recs, "/r")], _Echo(), TrainLoopConfig(seed=5).sampler_config())
    u = _mix({"train": 11}, {"train": 0.25}, seed=5)
    draws = _draws(s, 11 * 3)
    assert draws == _draws(t, 11 * 3) == _draws(u, 11 * 3)
    assert draws == sum((mixture_permutation(11, 5, "train", e) for e in range(3)), [])
    assert s.records == recs and s.epoch == 2 and s.draws == {"train": 33}
    assert s.state_dict() == u.state_dict() == {
        "datasets": {"train": {"epoch": 2, "pos": 11, "draws": 33, "bad": []}}}


def _fixture():
    with open(FIXTURE) as f:
        return json.load(f)


def test_mixture_checkpoint_of_the_previous_sampler_resumes_exactly():
    """A state written by the sampler before one sampling path (fixture, commit da3a5fe) continues
    with the very draws that sampler made after it."""
    old = _fixture()["mixture"]
    bad = {k: set(v) for k, v in old["bad"].items()}
    s = _mix(old["sizes"], old["weights"], seed=old["seed"], bad=bad,
             global_batch_size=old["global_batch_size"], micro_batches=old["micro_batches"])
    s.load_state_dict(old["state"])
    assert _draws(s, len(old["next_draws"])) == old["next_draws"]
    assert s.skipped == 1  # b's record 2, global 13 + 2
    fresh = _mix(old["sizes"], old["weights"], seed=old["seed"], bad=bad,
                 global_batch_size=old["global_batch_size"], micro_batches=old["micro_batches"])
    for _ in range(old["steps_taken"]):
        fresh.next_step()
    assert fresh.state_dict() == old["state"]  # and the new sampler writes that very state


def test_single_dataset_checkpoint_of_the_previous_sampler_is_a_clear_error():
    old = _fixture()["single"]
    s = StepSampler(_records("t", old["size"], set(old["bad"])), _Echo(), "/r",
                    TrainLoopConfig(seed=old["seed"], global_batch_size=old["global_batch_size"]).sampler_config())
    with pytest.raises(OldSamplerState, match=r"single-dataset form.*da3a5fe.*cannot resume "
                                              r"exactly.*ray-dhp export.*model\.path"):
        s.load_state_dict(old["state"])
    assert s.draws == {"train": 0}  # nothing was moved


def test_trainer_refuses_an_old_single_dataset_checkpoint_before_workers_start(tmp_path):
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer
    from ray_dhp.checkpointing.integrity import commit

    ckpt = tmp_path / "run" / "checkpoint_000003"
    ckpt.mkdir(parents=True)
    commit(str(ckpt), {"format_version": 2, "step": 3, "files": {},
                       "sampler": _fixture()["single"]["state"]})
    a = demo.make_dataset(tmp_path / "a", num_samples=2)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor())
    with pytest.raises(ValueError, match=r"resume_from=.*checkpoint_000003.*single-dataset form"):
        DisaggregatedTrainer(dhp_config=dhp, datasets={"train": str(a)},
                             scaling_config=ray.train.ScalingConfig(num_workers=1),
                             resume_from=str(tmp_path / "run"))


def test_dataset_weights_are_validated():
    for bad in ({}, {"a": 0}, {"a": -1.0}, {"a": float("nan")}, {"a": "0.5"}, [0.5]):
        with pytest.raises(ValueError, match="dataset_weights"):
            TrainLoopConfig(dataset_weights=bad)
    with pytest.raises(ValueError, match=r"\['ocr'\] not in datasets=.*\['coco', 'train'\]"):
        check_dataset_weights({"coco": 1, "ocr": 2}, {"train", "coco"})
    check_dataset_weights({"coco": 1}, {"coco"})


def test_path_datasets_resolve_images_against_their_own_folder(tmp_path):
    small = demo.make_dataset(tmp_path / "small", num_samples=4, bad_lines=[(1, "missing_image")])
    large = demo.make_dataset(tmp_path / "large", num_samples=9, bad_lines=[(7, "malformed_json")])
    cfg = TrainLoopConfig(global_batch_size=6, dataset_weights={"small": 1, "large": 2},
                          dataset_paths={"small": str(small), "large": str(large),
                                         "unused": str(large)})
    sources = load_sources(cfg.data)
    assert [(s.name, s.root, s.weight) for s in sources] == [
        ("large", resolve_data_root(large), 2.0), ("small", resolve_data_root(small), 1.0)]
    s = StepSampler.from_sources(sources, demo.tiny_processor(), cfg.sampler_config())
    for _ in range(4):  # 24 draws: 8 from small (2 epochs), 16 from large (~2 epochs)
        assert sum(len(mb) for mb in s.next_step()) == 6
    # large's images 004..008 exist only in its own folder: resolved per dataset, none were bad
    assert {s.dataset_of(i) for i in s.bad} == {"small", "large"} and s.skipped == 2
    assert s.root_for(0) == resolve_data_root(large) and s.root_for(9) == resolve_data_root(small)
    assert len(read_annotations(large)) + len(read_annotations(small)) == len(s.records)


def test_trainer_checks_weighted_names_before_workers_start(tmp_path):
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer

    a = demo.make_dataset(tmp_path / "a", num_samples=2)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor())

    def build(datasets, **loop):
        return DisaggregatedTrainer(dhp_config=dhp, datasets=datasets, train_loop_config=loop,
                                    scaling_config=ray.train.ScalingConfig(num_workers=1))

    with pytest.raises(ValueError, match=r"\['ocr'\] not in datasets=.*\['coco'\]"):
        build({"coco": str(a)}, dataset_weights={"coco": 1, "ocr": 1})
    with pytest.raises(ValueError, match=r"got \['coco'\]; to mix several, set .*dataset_weights"):
        build({"coco": str(a)})
    with pytest.raises(ValueError, match="finite numbers > 0"):
        build({"coco": str(a)}, dataset_weights={"coco": -1})
    t = build({"coco": str(a), "ocr": str(a)}, dataset_weights={"coco": 3, "ocr": 1})
    assert set(t.train_loop_config["dataset_paths"]) == {"coco", "ocr"}
