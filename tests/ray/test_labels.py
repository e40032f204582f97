"""Each module on the nodes its labels select (issue #45), on a local Ray cluster of 3 labelled
raylets (`ray.cluster_utils.Cluster`): the head ``accel=small`` with 2 CPUs, two ``accel=big``
nodes with 1 CPU each.

* vision (DP2) on ``small``, text (TP2) on ``big``: every worker records its DHP rank and node
  id, vision ranks ran only on the small node and text ranks only on big nodes. Without the
  bundle pinning the backend's node-local packing would have moved the text TP group onto the
  small node (2 workers there, while each big node holds 1: the text group would then be
  node-local; `tests/unit/test_placement_groups.py` checks that order). Every step's loss and
  grad norm equal the single-process stock model's on the same samples (fp64 engine,
  `tests.ray.loops.fp64_loop`: rel 1e-10, only summation orders differ; a rank on the wrong
  module or a wrong boundary is O(1e-3) off).
* a label no node carries is refused by ``fit()`` in the driver, naming label and counts, in
  well under 30 s (nothing waits for resources).

Both slow (a cluster start-up and a 4-worker run, ~1-2 min on 2 cores); the default suite's
refusal case is `tests/unit/test_placement_groups.py` (the same driver check on Ray's node
table, without a cluster).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time

import pytest
import ray
import ray.train
import torch
from ray.cluster_utils import Cluster

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.train.callbacks import MetricsHistory, read_history
from ray_dhp.train.labels import LabelRefusal
from tests.distributed.parity import make_steps, run_reference

FAMILY = "qwen2_5_vl"
LOOP = dict(lr=1e-3, global_batch_size=4, num_steps=4, seed=0, log_every=1,
            lr_schedule="cosine", warmup_steps=1, max_grad_norm=1.0)
LABELS = {"vision": {"accel": "small"}, "text": {"accel": "big"}}


@pytest.fixture(scope="module")
def labelled():
    """The 3-raylet labelled cluster; restores the session's Ray afterwards if one ran."""
    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    short = tempfile.mkdtemp(prefix="rdl", dir="/tmp")  # Ray's socket paths must stay short
    old_tmp = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = short  # other Ray users of the machine never see this cluster
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "labels": {"accel": "small"}, "include_dashboard": False})
        small = c.head_node
        big = [c.add_node(num_cpus=1, labels={"accel": "big"}) for _ in range(2)]
        ray.init(address=c.address)
        c.wait_for_nodes()
        yield {small.node_id}, {n.node_id for n in big}
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        if old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmp
        shutil.rmtree(short, ignore_errors=True)
        if was_running:
            ray.init(address="local", num_cpus=8)


def _recording(folder: str):
    """`fp64_loop`, every rank first writing its DHP rank, roles and node id to ``folder``."""
    from tests.ray.loops import fp64_loop

    inner = fp64_loop()

    def loop(config):
        from ray_dhp.train.backend import get_context

        ctx = get_context()
        rec = {"rank": ctx.rank, "roles": list(ctx.roles),
               "node": ray.get_runtime_context().get_node_id()}
        with open(os.path.join(folder, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(rec, f)
        return inner(config)

    return loop


def _dhp(labels=LABELS):
    return DHPConfig(model=demo.tiny_model_config(FAMILY), processor=demo.tiny_processor(FAMILY),
                     vision=ModuleParallel(data_parallel=2),
                     text=ModuleParallel(tensor_parallel=2),
                     placement=[["vision"], ["text"]], labels=labels)


@pytest.mark.slow
def test_vision_on_small_text_on_big_nodes_exact_against_one_process(labelled, fast_reports,
                                                                      tmp_path):
    small, big = labelled
    steps = make_steps(tmp_path, FAMILY, TrainLoopConfig(**LOOP))
    ref = run_reference(FAMILY, TrainLoopConfig(**LOOP), steps, torch.float64)["history"]
    folder = tmp_path / "placed"
    folder.mkdir()
    dhp = _dhp()
    assert dhp.label_selectors() == [LABELS["vision"]] * 2 + [LABELS["text"]] * 2
    trainer = DisaggregatedTrainer(
        _recording(str(folder)), train_loop_config=dict(LOOP), dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="labels", storage_path=str(tmp_path / "runs"),
                                       callbacks=[MetricsHistory(LOOP["num_steps"])]),
        datasets={"train": str(tmp_path / f"data_{FAMILY}" / "data.jsonl")})
    history = sorted(read_history(trainer.fit()), key=lambda h: h["step"])
    placed = [json.load(open(p)) for p in sorted(glob.glob(str(folder / "rank*.json")))]
    assert sorted(r["rank"] for r in placed) == [0, 1, 2, 3]
    for r in placed:
        want = small if r["roles"] == ["vision"] else big
        assert r["roles"] in (["vision"], ["text"]) and r["node"] in want, placed
    assert len({r["node"] for r in placed if r["roles"] == ["text"]}) == 2  # both big nodes
    assert len(history) == len(ref) == LOOP["num_steps"]
    for key in ("loss", "grad_norm"):
        errs = [abs(h[key] - r[key]) / abs(r[key]) for h, r in zip(history, ref)]
        assert max(errs) < 1e-10, (key, history, ref)
    print(f"labels: vision on small, text on big; worst loss rel err "
          f"{max(abs(h['loss'] - r['loss']) / r['loss'] for h, r in zip(history, ref)):.2e}")


@pytest.mark.slow
def test_a_label_no_node_has_is_refused_fast_naming_label_and_counts(labelled, tmp_path):
    dhp = _dhp({"vision": {"accel": "tiny"}, "text": {"accel": "big"}})
    trainer = DisaggregatedTrainer(
        train_loop_config=dict(LOOP), dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="refused", storage_path=str(tmp_path / "runs")),
        datasets={"train": str(demo.make_dataset(tmp_path / "d", num_samples=4, seed=0))})
    t0 = time.monotonic()
    with pytest.raises(LabelRefusal) as e:
        trainer.fit()
    took = time.monotonic() - t0
    assert took < 30, took
    assert ("need 2 worker(s) of {'CPU': 1} on nodes labelled accel=tiny (labels.vision), but "
            "the cluster has 0 alive node(s) with that label") in str(e.value)
    assert "['accel=big', 'accel=small']" in str(e.value)
    print(f"refused in {took:.2f} s: {e.value}")
