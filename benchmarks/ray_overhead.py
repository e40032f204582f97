"""Plugin overhead: the same DHP step under `ray_dhp.DisaggregatedTrainer.fit()` vs a plain launcher.

Both run the identical loop (`_steps`): build a `DHPEngine` on the groups the launcher provides
(Ray: ``ray_dhp.get_context().groups``, built by the DisaggregatedBackend; plain: `build_groups`
in processes spawned by `benchmarks.launcher`), then time ``steps`` steps on the same synthetic
batch. Reported: per-step medians (after the first step) and the wall time from ``fit()`` /
spawn to the start of the first step. Runs plain -> Ray -> plain so that drift on a shared
machine affects both sides.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _steps(groups, opts: dict) -> dict:
    import torch

    from benchmarks import contenders as C
    from benchmarks import shapes
    from ray_dhp.step.engine import DHPEngine

    torch.set_num_threads(1)
    config = shapes.model_config(opts["shape"])
    batch = shapes.make_batch(opts["batch"], opts["length"], config)
    engine = DHPEngine(config, groups, C.train_config(opts["batch"]).step_config())
    first, times = None, []
    for _ in range(opts["steps"]):
        t0 = time.time()
        first = first or t0
        engine.step([batch])
        times.append(time.time() - t0)
    return {"first_step_wall": first, "times": times}


def _topology(world: int):
    from ray_dhp.parallel.topology import Topology

    return Topology.build(placement="collocated", vision_dp=1, vision_sp=world, text_dp=1, text_tp=world)


def _plain_body(rank, world, opts):
    import torch

    from ray_dhp.parallel.mesh import build_groups

    return _steps(build_groups(_topology(world), torch.device("cpu")), opts)


def _ray_loop(config: dict):
    import ray.train

    import ray_dhp

    ctx = ray_dhp.get_context()
    out = _steps(ctx.groups, config)
    if ctx.rank == 0:  # Ray Train V2 keeps metrics only with checkpoints: hand results over a file
        with open(config["result_file"], "w") as f:
            json.dump(out, f)
    ray.train.report({"first_step_wall": out["first_step_wall"]})


def run_plain(opts: dict) -> dict:
    from benchmarks.launcher import spawn

    t0 = time.time()
    res = spawn(_plain_body, opts["ranks"], (opts,))
    times = [max(r["times"][i] for r in res) for i in range(opts["steps"])]
    return {"times": times, "to_first_step_s": min(r["first_step_wall"] for r in res) - t0}


def run_ray(opts: dict) -> dict:
    import ray
    import ray.train

    from benchmarks import shapes
    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=os.environ.get("DHP_BENCH_RAY_LOGS") == "1",
                 runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    try:
        n, tmp = opts["ranks"], tempfile.mkdtemp(prefix="dhp_bench_")
        result_file = os.path.join(tmp, "result.json")
        trainer = DisaggregatedTrainer(
            _ray_loop, train_loop_config=dict(opts, result_file=result_file),
            dhp_config=DHPConfig(model=shapes.model_config(opts["shape"]),
                                 vision=ModuleParallel(sequence_parallel=n), text=ModuleParallel(tensor_parallel=n)),
            scaling_config=ray.train.ScalingConfig(num_workers=n, resources_per_worker={"CPU": 1}),
            run_config=ray.train.RunConfig(name=f"overhead-{int(time.time())}",
                                           storage_path=tmp))
        t0 = time.time()
        result = trainer.fit()
        if result.error is not None or not os.path.exists(result_file):
            raise RuntimeError(f"Ray run failed: error={result.error!r}")
        with open(result_file) as f:
            out = json.load(f)
        return {"times": out["times"], "to_first_step_s": out["first_step_wall"] - t0}
    finally:
        if started:
            ray.shutdown()


def measure_overhead(opts: dict) -> dict:
    """plain -> Ray -> plain; ratios of per-step medians (first step excluded)."""
    plain1 = run_plain(opts)
    ray_run = run_ray(opts)
    plain2 = run_plain(opts)
    med = lambda r: statistics.median(r["times"][1:])  # noqa: E731
    plain_med = statistics.median([med(plain1), med(plain2)])
    return {
        "config": opts, "plain": [plain1, plain2], "ray": ray_run,
        "plain_step_median_s": plain_med, "ray_step_median_s": med(ray_run),
        "step_time_ratio_ray_over_plain": med(ray_run) / plain_med,
        "ray_to_first_step_s": ray_run["to_first_step_s"],
        "plain_to_first_step_s": statistics.median([plain1["to_first_step_s"], plain2["to_first_step_s"]]),
    }
