"""Each module on the nodes its labels select (issue #45), on a local Ray cluster of 3 labelled
raylets (`ray.cluster_utils.Cluster`): one ``accel=small`` node with 2 CPUs, two ``accel=big``
nodes with 1 CPU each, beside an unlabelled head with 1 CPU where the driver and Ray Train's
controller live (no worker can land there: every worker has a label selector).

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
* the small node is lost after the step-2 checkpoint; a new ``accel=small`` node joins; Ray Train
  restarts the worker group with the same per-worker selectors, the vision ranks land on the new
  small node, and the run finishes with every step's loss equal to the uninterrupted
  single-process run's.

All slow (a cluster start-up and 4-worker runs, ~5-8 min on 2 loaded cores); the default suite's
refusal case is `tests/unit/test_placement_groups.py` (the same driver check on Ray's node
table, without a cluster).
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time

import pytest
import ray
import ray.train
import torch

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.train.callbacks import MetricsHistory, read_history
from ray_dhp.train.labels import LabelRefusal
from tests.distributed.parity import make_steps, run_reference
from tests.ray.machine import private_cluster

FAMILY = "qwen2_5_vl"
LOOP = dict(lr=1e-3, global_batch_size=4, num_steps=4, seed=0, log_every=1,
            lr_schedule="cosine", warmup_steps=1, max_grad_norm=1.0)
LABELS = {"vision": {"accel": "small"}, "text": {"accel": "big"}}
SMALL = dict(num_cpus=2, labels={"accel": "small"})


@pytest.fixture(scope="module")
def labelled():
    """The 3-raylet labelled cluster; restores the session's Ray afterwards if one ran."""
    def add(c):
        return c.add_node(**SMALL), [c.add_node(num_cpus=1, labels={"accel": "big"}) for _ in range(2)]
    with private_cluster("rdl", add) as (c, (small, big)):
        yield c, small, big


def _recording(folder: str, pause=None):
    """`fp64_loop` (with its ``pause``), every rank first writing its DHP rank, roles, node id
    and pid to ``folder``."""
    from tests.ray.loops import fp64_loop

    inner = fp64_loop(pause=pause)

    def loop(config):
        from ray_dhp.train.backend import get_context

        ctx = get_context()
        rec = {"rank": ctx.rank, "roles": list(ctx.roles),
               "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        with open(os.path.join(folder, f"rank{ctx.rank}_{os.getpid()}.json"), "w") as f:
            json.dump(rec, f)
        return inner(config)

    return loop


def _placed(folder) -> list:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "rank*.json")))]


def _check_nodes(placed: list, small: set, big: set) -> None:
    """Vision ranks only on ``small`` nodes, text ranks only on ``big`` ones, both big used."""
    assert sorted(r["rank"] for r in placed) == [0, 1, 2, 3], placed
    for r in placed:
        want = small if r["roles"] == ["vision"] else big
        assert r["roles"] in (["vision"], ["text"]) and r["node"] in want, placed
    assert len({r["node"] for r in placed if r["roles"] == ["text"]}) == 2  # both big nodes


def _trainer(loop, data, storage: str, name: str, loop_changes=None, **run):
    loop_cfg = {**LOOP, **(loop_changes or {})}
    return DisaggregatedTrainer(
        loop, train_loop_config=loop_cfg, dhp_config=_dhp(),
        scaling_config=ray.train.ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       callbacks=[MetricsHistory(loop_cfg["num_steps"])],
                                       **run),
        datasets={"train": str(data)})


def _assert_exact(history: list, ref: list) -> float:
    """Every step's loss and grad norm (the last report of a step repeated after a restart)
    against the single-process run: rel 1e-10 (fp64; only summation orders differ)."""
    last = {h["step"]: h for h in history}
    assert sorted(last) == list(range(1, len(ref) + 1)), sorted(last)
    worst = 0.0
    for key in ("loss", "grad_norm"):
        errs = [abs(last[k + 1][key] - r[key]) / abs(r[key]) for k, r in enumerate(ref)]
        assert max(errs) < 1e-10, (key, last, ref)
        worst = max(worst, *errs)
    return worst


@pytest.fixture(scope="module")
def data_and_ref(tmp_path_factory):
    """The data and the single-process fp64 run of it (the stock model, `run_reference`)."""
    tmp = tmp_path_factory.mktemp("labels")
    steps = make_steps(tmp, FAMILY, TrainLoopConfig(**LOOP))
    ref = run_reference(FAMILY, TrainLoopConfig(**LOOP), steps, torch.float64)["history"]
    return tmp / f"data_{FAMILY}" / "data.jsonl", ref


def _dhp(labels=LABELS):
    return DHPConfig(model=demo.tiny_model_config(FAMILY), processor=demo.tiny_processor(FAMILY),
                     vision=ModuleParallel(data_parallel=2),
                     text=ModuleParallel(tensor_parallel=2),
                     placement=[["vision"], ["text"]], labels=labels)


@pytest.mark.slow
def test_vision_on_small_text_on_big_nodes_exact_against_one_process(labelled, data_and_ref,
                                                                      fast_reports, tmp_path):
    c, small, big = labelled
    data, ref = data_and_ref
    folder = tmp_path / "placed"
    folder.mkdir()
    assert _dhp().label_selectors() == [LABELS["vision"]] * 2 + [LABELS["text"]] * 2
    result = _trainer(_recording(str(folder)), data, str(tmp_path / "runs"), "labels").fit()
    _check_nodes(_placed(folder), {small.node_id}, {n.node_id for n in big})
    worst = _assert_exact(read_history(result), ref)
    print(f"labels: vision on small, text on big; worst loss/grad-norm rel err {worst:.2e}")


@pytest.mark.slow
def test_a_label_no_node_has_is_refused_fast_naming_label_and_counts(labelled, tmp_path):
    dhp = _dhp({"vision": {"accel": "tiny"}, "text": {"accel": "big"}})  # no node is "tiny"
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


def _fit_in_thread(trainer) -> dict:
    """``trainer.fit()`` in a thread (`Cluster.add_node`/`remove_node` need the main thread)."""
    out: dict = {}

    def run():
        try:
            out["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


@pytest.mark.slow
def test_small_node_lost_and_replaced_by_a_small_node_finishes_exactly(
        labelled, data_and_ref, fast_reports, tmp_path):
    """Last in the module: it replaces the cluster's small node."""
    c, small, big = labelled
    data, ref = data_and_ref
    folder, pause = tmp_path / "placed", {"step": 3, "paused": str(tmp_path / "paused"),
                                          "go": str(tmp_path / "go")}
    folder.mkdir()
    # synchronous saves: the step-2 checkpoint is registered before the ranks pause at step 3
    run = _fit_in_thread(_trainer(_recording(str(folder), pause), data, str(tmp_path / "runs"),
                                  "lost", failure_config=ray.train.FailureConfig(max_failures=1),
                                  loop_changes={"checkpoint_every": 2, "async_save": False}))
    _wait_for(lambda: len(glob.glob(pause["paused"] + ".*")) == 4 or "error" in run, 600,
              "the ranks did not reach step 3")
    assert "error" not in run, run["error"]
    first = _placed(folder)
    _check_nodes(first, {small.node_id}, {n.node_id for n in big})
    c.remove_node(small)
    open(pause["go"], "w").close()  # the survivors fail on the lost ranks; restarts do not pause
    replacement = c.add_node(**SMALL)
    run["thread"].join(timeout=900)
    assert not run["thread"].is_alive(), "fit() did not return"
    assert "error" not in run, run.get("error")
    again = [r for r in _placed(folder) if r["pid"] not in {x["pid"] for x in first}]
    _check_nodes(again, {replacement.node_id}, {n.node_id for n in big})
    assert run["result"].return_value == {"resumed_from_step": 2, "final_step": 4}
    worst = _assert_exact(read_history(run["result"]), ref)
    print(f"labels: small node lost and replaced; worst loss/grad-norm rel err {worst:.2e}")
