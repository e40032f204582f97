"""``ray-dhp train``: build a `DisaggregatedTrainer` from a run file and fit it."""

from __future__ import annotations

import os
from typing import Optional, Sequence


def prepare_data(rf) -> str:
    """Absolute path of the training annotations; generates the demo set when ``data.train`` is
    unset (into ``<storage_path>/<run name>/demo_data``, reused if already there)."""
    if rf.data.train:
        if not os.path.exists(rf.data.train):
            from ray_dhp.cli.schema import ConfigError

            raise ConfigError(f"data.train: {rf.data.train} does not exist.")
        return rf.data.train
    from ray_dhp import demo

    folder = os.path.join(rf.storage_path(), rf.run_name(), "demo_data")
    path = os.path.join(folder, "data.jsonl")
    if not os.path.exists(path):
        demo.make_dataset(folder, num_samples=rf.data.demo_samples, seed=rf.optim.seed)
    return path


def build_trainer(rf, *, data_path: str, name: Optional[str] = None,
                  callbacks: Sequence = ()):
    """The `DisaggregatedTrainer` the run file describes (validated before any worker starts)."""
    import ray.train

    from ray_dhp.trainer import DisaggregatedTrainer

    dhp = rf.dhp_config()
    checkpoint = ray.train.CheckpointConfig(num_to_keep=rf.checkpoint.num_to_keep)
    run_config = ray.train.RunConfig(
        name=name or rf.run_name(), storage_path=rf.storage_path(),
        checkpoint_config=checkpoint,
        failure_config=ray.train.FailureConfig(max_failures=rf.run.max_failures),
        callbacks=list(callbacks) or None)
    scaling = ray.train.ScalingConfig(num_workers=rf.num_workers(dhp), use_gpu=rf.scaling.use_gpu,
                                      resources_per_worker=rf.scaling.resources_per_worker)
    return DisaggregatedTrainer(train_loop_config=rf.train_loop_config(), dhp_config=dhp,
                                scaling_config=scaling, run_config=run_config,
                                datasets={"train": data_path})


def local_num_cpus(rf, num_workers: int) -> int:
    """Logical CPUs for a local Ray: enough for the workers even on a 2-core machine."""
    if rf.run.num_cpus:
        return rf.run.num_cpus
    per_worker = (rf.scaling.resources_per_worker or {}).get("CPU", 1)
    return max(os.cpu_count() or 1, int(num_workers * per_worker + 0.999) + 1)


def init_ray(rf, num_workers: int) -> None:
    """Join the cluster named by ``RAY_ADDRESS`` (e.g. inside ``ray job submit``), else start a
    local Ray; does nothing if Ray is already initialised in this process."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto")
    else:
        ray.init(num_cpus=local_num_cpus(rf, num_workers))


def train(rf) -> dict:
    """Run the whole training described by ``rf``; returns the final metrics and result path."""
    from ray_dhp.callbacks import read_history

    dhp = rf.dhp_config()
    num_workers = rf.num_workers(dhp)
    print(f"[ray_dhp] layout:\n{dhp.topology().describe()}", flush=True)
    data = prepare_data(rf)
    trainer = build_trainer(rf, data_path=data)  # validates before Ray starts workers
    init_ray(rf, num_workers)
    result = trainer.fit()
    hist = read_history(result)
    metrics = dict(result.metrics or (hist[-1] if hist else {}))
    first = hist[0] if hist else metrics
    print(f"[ray_dhp] done: loss {first.get('loss', float('nan')):.4f} (step {first.get('step')}) "
          f"-> {metrics.get('loss', float('nan')):.4f} (step {metrics.get('step')}); "
          f"results under {result.path}", flush=True)
    return {"metrics": metrics, "history": hist, "path": result.path,
            "checkpoint": result.checkpoint.path if result.checkpoint else None}
