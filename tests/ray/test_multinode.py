"""Several Ray nodes on one machine (`ray.cluster_utils.Cluster`): node-local groups, node loss.

The cluster: a head with 1 CPU and no worker slot (the driver and Ray Train's controller live
there, so worker 0 is never on the driver's node and the rendezvous must follow it) plus two
nodes with 2 CPUs and 2 ``dhp_slot`` each; every worker asks for 1 CPU and 1 slot, so each node
holds exactly 2 workers. The cluster writes its address file under a private ``RAY_TMPDIR`` so
other Ray users of the machine never see it, and only its own processes are stopped.

Each run is compared with the same layout trained without Ray (`tests.distributed.parity`
`run_engine`: spawned gloo ranks in one place, same data, seed and hyper-parameters): fp32 on
CPU, relative 1e-6 on the loss and every parameter, as in test_fault_tolerance (the multi-node
run does the same arithmetic in the same order; a wrong group or a lost optimizer / data
position after a restart is O(lr) off).

* default: collocated SP2/TP2 x DP2 on 2 nodes: every sp and tp group on one node, equal to the
  single-node run; the local storage path draws exactly one warning.
* slow: disjoint SP2 + TP2 (vision on one node, text on the other); a node lost after a
  checkpoint and replaced (the run finishes equal to the uninterrupted one); a node lost and not
  replaced (a clear error within a bounded time, not a hang).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
from ray_dhp.train.callbacks import MetricsHistory
from ray_dhp.parallel.nodes import crossing_groups
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps, rel_err, run_engine
from tests.ray.machine import private_cluster, stop_private_head

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "qwen2_5_vl"
SLOT = "dhp_slot"
NODE = dict(num_cpus=2, resources={SLOT: 2})
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=4, seed=0, log_every=2,
                      checkpoint_every=2, lr_schedule="cosine", warmup_steps=1, max_grad_norm=1.0)
COLLOCATED = dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
DISJOINT = dict(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


@pytest.fixture
def cluster():
    """A private 3-node cluster (head without slots + 2 nodes of 2 slots); restores the
    session's Ray (8 CPUs) afterwards if one was running."""
    with private_cluster("rd17", lambda c: [c.add_node(**NODE) for _ in range(2)]) as (c, nodes):
        yield c, nodes


@pytest.fixture(scope="module")
def data_and_refs(tmp_path_factory):
    """The data, and each layout trained without Ray (spawned gloo ranks, one machine)."""
    tmp = tmp_path_factory.mktemp("mn")
    steps = make_steps(tmp, FAMILY, CFG)
    refs = {}

    def ref(layout: dict):
        key = tuple(sorted(layout.items()))
        if key not in refs:
            refs[key] = run_engine(FAMILY, layout, CFG, steps)
        return refs[key]

    return tmp / f"data_{FAMILY}" / "data.jsonl", ref


def _recording_loop(spec: dict):
    """The built-in loop; every rank first records its DHP rank, Ray world rank and node. With
    ``spec["stall_at"]`` every rank stops after that step (until the test removes a node) unless
    ``spec["go"]`` exists."""

    def loop(config):
        from ray_dhp.train.backend import get_context
        from ray_dhp.train.loop import train_loop

        ctx = get_context()
        rc = ray.get_runtime_context()
        rec = {"dhp_rank": ctx.rank, "world_rank": ray.train.get_context().get_world_rank(),
               "node": rc.get_node_id(), "pid": os.getpid()}
        with open(os.path.join(spec["dir"], f"rank{ctx.rank}_{os.getpid()}.json"), "w") as f:
            json.dump(rec, f)

        def hook(event, step):
            if event == "step_end" and step == spec.get("stall_at") \
                    and not os.path.exists(spec["go"]):
                open(os.path.join(spec["dir"], f"stalled{ctx.rank}"), "w").close()
                time.sleep(600)  # the node goes away meanwhile; Ray Train kills the rest

        return train_loop(config, hook=hook)

    return loop


def _trainer(tmp_path, data, layout: dict, spec: dict, *, name: str, max_failures=0,
             placement_timeout_s=600.0, **loop_changes):
    vdp, vsp, tdp, ttp = (layout[k] for k in ("vision_dp", "vision_sp", "text_dp", "text_tp"))
    dhp = DHPConfig(model=demo.tiny_model_config(FAMILY), processor=demo.tiny_processor(FAMILY),
                    vision=ModuleParallel(sequence_parallel=vsp, data_parallel=vdp),
                    text=ModuleParallel(tensor_parallel=ttp, data_parallel=tdp),
                    placement=layout["placement"])
    cfg = {k: v for k, v in dict(CFG.to_dict(), **loop_changes).items() if v is not None}
    return DisaggregatedTrainer(
        _recording_loop(spec), train_loop_config=cfg, dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=dhp.num_workers,
                                               resources_per_worker={"CPU": 1, SLOT: 1}),
        run_config=ray.train.RunConfig(
            name=name, storage_path=str(tmp_path / "runs"),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            callbacks=[MetricsHistory(CFG.optim.num_steps)]),
        datasets={"train": str(data)}, placement_timeout_s=placement_timeout_s)


def _placements(folder) -> list:
    """Every recorded worker start: dicts with dhp_rank, world_rank, node, pid."""
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "rank*.json")))]


def _node_of(records: list, world: int) -> list:
    by_rank = {r["dhp_rank"]: r["node"] for r in records}
    assert sorted(by_rank) == list(range(world)), records
    return [by_rank[r] for r in range(world)]


def _assert_equal_to_reference(result, ref):
    from ray_dhp.checkpointing.export import read_model_tensors

    want = ref["history"][-1]["loss"]
    assert abs(result.metrics["loss"] - want) <= 1e-6 * want, (result.metrics["loss"], want)
    with result.checkpoint.as_directory() as d:
        params = read_model_tensors(d)
    assert set(params) == set(ref["params"])
    worst = max((rel_err(params[n], p), n) for n, p in ref["params"].items())
    assert worst[0] <= 1e-6, worst


def _worker_nodes(nodes) -> set:
    return {n.node_id for n in nodes}


def test_collocated_sp2_tp2_dp2_on_two_nodes_is_node_local_and_exact(
        cluster, fast_reports, tmp_path, data_and_refs, caplog):
    c, nodes = cluster
    data, ref = data_and_refs
    spec = {"dir": str(tmp_path / "placed"), "go": str(tmp_path / "go")}
    os.makedirs(spec["dir"])
    with caplog.at_level(logging.WARNING, logger="ray_dhp"):
        result = _trainer(tmp_path, data, COLLOCATED, spec, name="coll").fit()
    storage = [r for r in caplog.records if "is a local directory" in r.getMessage()]
    assert len(storage) == 1, [r.getMessage() for r in caplog.records]
    assert "3 nodes" in storage[0].getMessage()

    topo = Topology.build(**COLLOCATED)
    node_of = _node_of(_placements(spec["dir"]), topo.world_size)
    assert set(node_of) == _worker_nodes(nodes)  # both worker nodes used, never the head
    assert crossing_groups(topo, node_of) == []  # sp groups and tp groups each on one node
    _assert_equal_to_reference(result, ref(COLLOCATED))


@pytest.mark.slow
def test_disjoint_puts_vision_on_one_node_and_text_on_the_other(
        cluster, fast_reports, tmp_path, data_and_refs):
    c, nodes = cluster
    data, ref = data_and_refs
    spec = {"dir": str(tmp_path / "placed"), "go": str(tmp_path / "go")}
    os.makedirs(spec["dir"])
    result = _trainer(tmp_path, data, DISJOINT, spec, name="disj").fit()
    topo = Topology.build(**DISJOINT)
    node_of = _node_of(_placements(spec["dir"]), topo.world_size)
    vision = {node_of[r] for r in topo.vision.ranks}
    text = {node_of[r] for r in topo.text.ranks}
    assert len(vision) == 1 and len(text) == 1 and vision != text, node_of
    _assert_equal_to_reference(result, ref(DISJOINT))


def _fit_in_thread(trainer) -> dict:
    out: dict = {}

    def run():
        t0 = time.time()
        try:
            out["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e
        out["end"] = time.time()
        out["start"] = t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    out["thread"] = th
    return out


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


def _kill_node_of_rank0(c, nodes, spec, world) -> tuple:
    """Wait until every rank stalled after step 3, then remove the node hosting DHP rank 0."""
    _wait_for(lambda: len(glob.glob(os.path.join(spec["dir"], "stalled*"))) == world, 600,
              "the ranks did not reach the stall point")
    first = _placements(spec["dir"])
    rank0 = next(r for r in first if r["dhp_rank"] == 0)
    victim = next(n for n in nodes if n.node_id == rank0["node"])
    open(spec["go"], "w").close()  # the restarted ranks do not stall again
    t_kill = time.time()
    c.remove_node(victim)
    return victim, t_kill, {r["pid"] for r in first}


@pytest.mark.slow
def test_node_lost_after_checkpoint_and_replaced_finishes_exactly(
        cluster, fast_reports, tmp_path, data_and_refs):
    c, nodes = cluster
    data, ref = data_and_refs
    spec = {"dir": str(tmp_path / "placed"), "go": str(tmp_path / "go"), "stall_at": 3}
    os.makedirs(spec["dir"])
    # synchronous saves: the ranks stall right after step 3, when a background write of step 2's
    # checkpoint may or may not be registered yet (both correct; tests/ray/test_fault_tolerance.py
    # covers background writes)
    run = _fit_in_thread(_trainer(tmp_path, data, COLLOCATED, spec, name="lost",
                                  max_failures=1, async_save=False))
    victim, t_kill, first_pids = _kill_node_of_rank0(c, nodes, spec, 4)
    replacement = c.add_node(**NODE)
    run["thread"].join(timeout=900)
    assert not run["thread"].is_alive(), "fit() did not return"
    assert "error" not in run, run.get("error")
    result = run["result"]
    assert result.return_value == {"resumed_from_step": 2, "final_step": 4}
    restart = [r for r in _placements(spec["dir"]) if r["pid"] not in first_pids]
    started = min(os.path.getmtime(p) for p in glob.glob(os.path.join(spec["dir"], "rank*.json"))
                  if json.load(open(p))["pid"] not in first_pids)
    print(f"[multinode] node lost -> new worker group training after {started - t_kill:.1f} s, "
          f"run finished after {run['end'] - t_kill:.1f} s")
    node_of = _node_of(restart, 4)
    assert set(node_of) == {nodes[0].node_id, nodes[1].node_id, replacement.node_id} \
        - {victim.node_id}, node_of  # the survivor and the replacement
    assert crossing_groups(Topology.build(**COLLOCATED), node_of) == []
    _assert_equal_to_reference(result, ref(COLLOCATED))


@pytest.mark.slow
def test_node_lost_without_replacement_fails_clearly_in_bounded_time(
        cluster, fast_reports, tmp_path, data_and_refs, monkeypatch):
    c, nodes = cluster
    data, _ = data_and_refs
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    spec = {"dir": str(tmp_path / "placed"), "go": str(tmp_path / "go"), "stall_at": 3}
    os.makedirs(spec["dir"])
    run = _fit_in_thread(_trainer(tmp_path, data, COLLOCATED, spec, name="gone",
                                  max_failures=1, placement_timeout_s=20))
    _, t_kill, _ = _kill_node_of_rank0(c, nodes, spec, 4)
    run["thread"].join(timeout=600)
    assert not run["thread"].is_alive(), "fit() hung after the node was lost"
    took = run["end"] - t_kill
    print(f"[multinode] node lost, no replacement -> failed after {took:.1f} s")
    err = run.get("error")
    assert isinstance(err, ray.train.ControllerError), err
    msg = str(err)
    assert "could not place the 4 workers" in msg and "a node was lost" in msg, msg
    # 2 placement attempts of 10 s (placement_timeout_s=20) + the restart's own overheads
    assert took < 180, took


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ray", path=os.path.dirname(sys.executable)) is None,
                    reason="needs the ray CLI next to this python")
def test_cli_train_after_ray_start_joins_that_cluster(tmp_path):
    """`ray start --head` on this machine, then `ray-dhp train` without RAY_ADDRESS: it joins
    (it used to crash passing num_cpus to a running cluster). The head lives under a private
    RAY_TMPDIR (its address file too) and its process group is stopped by the test: never
    `ray stop`, which stops every Ray on the machine."""
    bindir = os.path.dirname(sys.executable)
    short = tempfile.mkdtemp(prefix="rd17", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": short, "RAY_AUTH_MODE": "disabled",
           "PATH": f"{bindir}:{os.environ['PATH']}", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}
    env.pop("RAY_ADDRESS", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = subprocess.Popen(
        [f"{bindir}/ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
         "--include-dashboard=false"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = os.path.join(short, "ray", "ray_current_cluster")
        _wait_for(lambda: head.poll() is not None or os.path.exists(address), 180,
                  "ray start --head did not come up")
        assert head.poll() is None, "ray start --head exited"
        proc = subprocess.run(
            [sys.executable, "-m", "ray_dhp", "train", str(ROOT / "examples" / "tiny.yaml"),
             "optim.num_steps=2", "optim.log_every=2", "data.demo_samples=16",
             "run.num_cpus=8", f"run.storage_path={tmp_path}", "run.name=joined"],
            env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "joining the running Ray cluster at" in out and f":{port}" in out, out[-4000:]
        assert "[ray_dhp] done: loss" in out
    finally:
        stop_private_head(head, short)
