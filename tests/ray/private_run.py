"""A training on a Ray instance of its own, as a separate program (the shared-machine tests run
it beside other Ray instances; `tests/ray/test_shared_machine.py`).

    python tests/ray/private_run.py OUT.json --data DATA.jsonl --storage DIR [--dashboard]
        [--address ADDR] [--pause-dir DIR]

Starts ``ray.init(address="local", include_dashboard=...)`` (or joins ``--address``), trains the
tiny Qwen2.5-VL collocated vision SP2 + text TP2 in fp64 (`tests.ray.loops.fp64_loop`) through
`DisaggregatedTrainer`, and writes ``{"history": [...], "error": ..., "left": {...}}`` to OUT.json:
``left`` is what the run left in its cluster after ``fit()`` returned, read from the GCS
(placement groups not removed, actors alive, by class, apart from Ray's named detached
singletons such as Ray Data's AutoscalingCoordinator, listed as ``ray_services``: they serve
every run of a cluster), before ``ray.shutdown()``. With
``--pause-dir`` every rank waits after step 2 until ``DIR/go`` exists (``DIR/paused.<rank>`` says
it got there)."""

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
    actors (class names; detached ones listed apart), read from the GCS directly."""
    import ray
    import ray._private.state as gcs_state

    pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    alive = [a for a in gcs_state.actors().values() if a["State"] != "DEAD"]
    service = [a for a in alive if a["IsDetached"] and a["Name"]]  # Ray's named singletons
    return {"placement_groups": len(pgs),
            "actors": sorted(a["ActorClassName"] for a in alive if a not in service),
            "ray_services": sorted(a["Name"] for a in service)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--data", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--name", default="private")
    p.add_argument("--dashboard", action="store_true")
    p.add_argument("--address", default="local")
    p.add_argument("--pause-dir", default=None)
    a = p.parse_args(argv)

    import ray
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
    from ray_dhp.train.callbacks import MetricsHistory, read_history
    from tests.ray.loops import fp64_loop

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.25"
    if a.address == "local":
        ray.init(address="local", num_cpus=8, include_dashboard=a.dashboard)
    else:
        ray.init(address=a.address)
    pause = None if a.pause_dir is None else {
        "step": 2, "paused": os.path.join(a.pause_dir, "paused"), "go": os.path.join(a.pause_dir, "go")}
    dhp = DHPConfig(model=demo.tiny_model_config("qwen2_5_vl"),
                    processor=demo.tiny_processor("qwen2_5_vl"),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    trainer = DisaggregatedTrainer(
        fp64_loop(pause=pause), train_loop_config=dict(LOOP), dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=a.name, storage_path=a.storage,
                                       callbacks=[MetricsHistory(LOOP["num_steps"])]),
        datasets={"train": a.data})
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
