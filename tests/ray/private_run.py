"""A training on a Ray instance of its own, as a separate program (the shared-machine tests run
it beside other Ray instances; `tests/ray/test_shared_machine.py`).

    python tests/ray/private_run.py OUT.json --data DATA.jsonl --storage DIR [--dashboard]
        [--address ADDR] [--pause-dir DIR] [--lrs LR,LR,...]

Starts ``ray.init(address="local", include_dashboard=...)`` (or joins ``--address``), trains the
tiny Qwen2.5-VL collocated vision SP2 + text TP2 in fp64 (`tests.ray.loops.fp64_loop`) through
`DisaggregatedTrainer`, and writes ``{"history": [...], "error": ..., "left": {...}}`` to OUT.json:
``left`` is what the run left in its cluster after ``fit()`` returned, read from the GCS
(placement groups not removed, actors alive, by class, apart from Ray's named detached
singletons such as Ray Data's AutoscalingCoordinator, listed as ``ray_services``: they serve
every run of a cluster), before ``ray.shutdown()``. With
``--pause-dir`` every rank waits after step 2 until ``DIR/go`` exists (``DIR/paused.<rank>`` says
it got there). With ``--lrs`` it runs a Ray Tune sweep instead: one trial per learning rate, all at
once (``max_concurrent_trials`` = their number), each a function trainable that fits the same
trainer (lr replaced, run name ``<name>_lr<lr>``) with `ray_dhp.tune.metric_report_callback`;
OUT.json then holds ``{"trials": {lr: {"history": [...], "final": ...}}, "error", "left"}``, ``left``
read once Tune's own actors have exited (bounded wait)."""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
LOOP = dict(lr=1e-3, global_batch_size=4, num_steps=4, seed=0, log_every=1, checkpoint_every=2,
            lr_schedule="cosine", warmup_steps=1, max_grad_norm=1.0)


def cluster_leftovers() -> dict:
    """What is still held in the connected cluster: placement groups not REMOVED and alive
    actors (class names; Ray's named detached singletons listed apart, with their process ids:
    the first run that needs one starts it, in that run's environment, and it serves the
    cluster after the run), read from the GCS directly."""
    import ray
    import ray._private.state as gcs_state

    pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    alive = [a for a in gcs_state.actors().values() if a["State"] != "DEAD"]
    service = [a for a in alive if a["IsDetached"] and a["Name"]]  # Ray's named singletons
    return {"placement_groups": len(pgs),
            "actors": sorted(a["ActorClassName"] for a in alive if a not in service),
            "ray_services": sorted(a["Name"] for a in service),
            "ray_service_pids": sorted(a["Pid"] for a in service if a.get("Pid"))}


def make_trainer(data: str, storage: str, name: str, *, lr=None, pause=None, callbacks=()):
    """The run: the tiny Qwen2.5-VL, vision SP2 + text TP2 collocated on 2 workers, fp64."""
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
    from ray_dhp.train.callbacks import MetricsHistory
    from tests.ray.loops import fp64_loop

    dhp = DHPConfig(model=demo.tiny_model_config("qwen2_5_vl"),
                    processor=demo.tiny_processor("qwen2_5_vl"),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    loop = dict(LOOP) if lr is None else {**LOOP, "lr": lr}
    return DisaggregatedTrainer(
        fp64_loop(pause=pause), train_loop_config=loop, dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage,
            callbacks=[MetricsHistory(LOOP["num_steps"]), *callbacks]),
        datasets={"train": data})


def wait_cluster_clean(timeout_s: float = 60.0) -> dict:
    """`cluster_leftovers` once nothing is left, or at ``timeout_s`` (Tune stops its trial actors
    after ``Tuner.fit()`` has returned)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = cluster_leftovers()
        if (not left["placement_groups"] and not left["actors"]) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _sweep(a, lrs: list) -> int:
    """A Tune sweep over ``lrs``, every trial at once; writes OUT.json (see the module doc)."""
    import ray
    from ray import tune

    data, storage, name = a.data, a.storage, a.name

    def trial(params):
        import time

        from ray_dhp.tune import metric_report_callback

        start = time.time()
        make_trainer(data, storage, f"{name}_lr{params['lr']}", lr=params["lr"],
                     callbacks=[metric_report_callback()]).fit()
        with open(os.path.join(storage, f"{name}_lr{params['lr']}.span"), "w") as f:
            json.dump([start, time.time()], f)  # when fit() ran: the trials overlapped

    from ray_dhp.train.callbacks import read_history

    out = {"trials": {}, "error": None}
    try:
        grid = tune.Tuner(
            tune.with_resources(trial, {"CPU": 0.5}), param_space={"lr": tune.grid_search(lrs)},
            tune_config=tune.TuneConfig(metric="loss", mode="min",
                                        max_concurrent_trials=len(lrs)),
            run_config=tune.RunConfig(name=f"{name}_tune", storage_path=storage)).fit()
        out["error"] = [repr(r.error) for r in grid if r.error is not None] or None
        for r in grid:
            lr = r.config["lr"]
            hist = read_history(os.path.join(storage, f"{name}_lr{lr}"))
            out["trials"][str(lr)] = {
                "history": [{"step": h["step"], "loss": h["loss"]} for h in hist if "loss" in h],
                "final": (r.metrics or {}).get("loss"),
                "span": json.load(open(os.path.join(storage, f"{name}_lr{lr}.span")))}
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["left"] = wait_cluster_clean()
    with open(a.out, "w") as f:
        json.dump(out, f)
    ray.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--data", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--name", default="private")
    p.add_argument("--dashboard", action="store_true")
    p.add_argument("--address", default="local")
    p.add_argument("--pause-dir", default=None)
    p.add_argument("--lrs", default=None, help="comma-separated learning rates: a Tune sweep")
    a = p.parse_args(argv)

    import ray

    from ray_dhp.train.callbacks import read_history

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.25"
    if a.address == "local":
        ray.init(address="local", num_cpus=8, include_dashboard=a.dashboard)
    else:
        ray.init(address=a.address)
    if a.lrs:
        return _sweep(a, [float(x) for x in a.lrs.split(",")])
    pause = None if a.pause_dir is None else {
        "step": 2, "paused": os.path.join(a.pause_dir, "paused"), "go": os.path.join(a.pause_dir, "go")}
    trainer = make_trainer(a.data, a.storage, a.name, pause=pause)
    out = {"history": [], "error": None}
    try:
        result = trainer.fit()
        out["history"] = [{"step": h["step"], "loss": h["loss"]} for h in read_history(result)]
        out["error"] = None if result.error is None else repr(result.error)
    except Exception as e:  # the test reads the error from the JSON
        out["error"] = f"{type(e).__name__}: {e}"
    out["left"] = cluster_leftovers()  # fit() waits for its actors: nothing may be left now
    with open(a.out, "w") as f:
        json.dump(out, f)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
