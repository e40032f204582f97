"""Ray Tune sweeps over run-file keys (the Ray Train V2 pattern).

``Tuner(trainer)`` is Ray Train V1 only. In V2 a Tune trial is a *function trainable* that builds
the trainer and calls ``fit()``; a ``TuneReportCallback`` in the trainer's ``RunConfig`` forwards
rank 0's reports to Tune. Each trial gets its own ``RunConfig(name)``; the trial driver asks for
a fraction of a CPU only (its workers have their own placement group), and at most as many
trials run at once as the cluster has CPUs for their workers, so worker groups are not starved.

Example:
    >>> from ray import tune
    >>> from ray_dhp.tune import sweep
    >>> grid = sweep("examples/tiny.yaml",
    ...              {"optim.lr": tune.grid_search([1e-4, 1e-3]),
    ...               "vision": tune.grid_search([{"sequence_parallel": 2},
    ...                                           {"sequence_parallel": 1, "data_parallel": 2}])},
    ...              overrides=["optim.num_steps=5"])  # doctest: +SKIP
    >>> grid.get_best_result().config  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from ray_dhp.cli.schema import ConfigError, leaf_keys, set_dotted
from ray_dhp.run_file import SHORTHANDS, RunFile, load_run_file, run_file_from_dict

__all__ = ["sweep", "trial_run_file", "dhp_trainable", "metric_report_callback"]


def metric_report_callback(metric: Optional[str] = None):
    """A ``TuneReportCallback`` (for the trainer's ``RunConfig(callbacks=...)`` inside a Tune
    trial) that forwards only the reports carrying ``metric`` (None: every report).

    Tune checks that *every* result it gets holds its ``metric``; ``eval_loss`` is in the reports
    of evaluation steps only (every ``eval_every`` steps and the last one), so with
    ``TuneConfig(metric="eval_loss")`` forward only those: Tune's schedulers and
    ``get_best_result()`` then see the evaluations, in order.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class _MetricReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metric is None or (metrics and metric in metrics[0]):
                super().after_report(run_context, metrics, checkpoint)

    return _MetricReportCallback()


def trial_run_file(base: dict, params: dict) -> RunFile:
    """The trial's `RunFile`: ``base`` (a raw run-file dict) with the dotted ``params`` set."""
    data = base
    for key, value in params.items():
        data = set_dotted(data, key, value, SHORTHANDS)
    return run_file_from_dict(data)


def dhp_trainable(params: dict, *, base: dict, datasets: dict, metric: Optional[str] = None) -> None:
    """Tune function trainable: build this trial's `DisaggregatedTrainer` and fit it; with
    ``metric`` only the reports that carry it go to Tune (`metric_report_callback`)."""
    import ray.tune

    from ray_dhp.cli.train import build_trainer

    rf = trial_run_file(base, params)
    trial = ray.tune.get_context().get_trial_id()
    trainer = build_trainer(rf, datasets=datasets, name=f"{rf.run_name()}_{trial}",
                            callbacks=[metric_report_callback(metric)])
    trainer.fit()


def _check_keys(param_space: dict) -> None:
    """Unknown sweep keys fail before Ray starts, with a suggestion."""
    import difflib

    keys = leaf_keys(RunFile)
    sections = {k.split(".")[0] for k in keys}
    for key in param_space:
        if key in keys or key in sections or key.startswith("model.config."):
            continue
        hint = difflib.get_close_matches(key, keys, n=1)
        raise ConfigError(f"sweep key {key!r} is not a run-file key"
                          + (f"; did you mean {hint[0]!r}?" if hint else "."))


def _grid_values(param_space: dict) -> list:
    """Every combination of the grid-searched values (others at their first/only value)."""
    import itertools

    choices = []
    for key, v in param_space.items():
        grid = v.get("grid_search") if isinstance(v, dict) and "grid_search" in v else None
        choices.append([(key, x) for x in grid] if grid is not None else [])
    combos = itertools.product(*[c for c in choices if c])
    return [dict(c) for c in combos]


def _max_concurrent(worker_cpus: float, trial_cpus: float) -> int:
    import ray

    total = ray.cluster_resources().get("CPU", 1)
    return max(1, math.floor(total / (worker_cpus + trial_cpus)))


def sweep(run_file: Union[str, RunFile, dict, None], param_space: dict, *,
          overrides: Sequence[str] = (), metric: str = "loss", mode: str = "min",
          num_samples: int = 1, max_concurrent_trials: Optional[int] = None,
          trial_cpus: float = 0.5, name: Optional[str] = None):
    """Run a Tune sweep of ``param_space`` (dotted run-file keys -> Tune search spaces).

    Args:
        run_file: YAML path, `RunFile`, raw dict or None (defaults): the base of every trial.
        param_space: e.g. ``{"optim.lr": tune.grid_search([1e-4, 1e-3])}``; a dict value on a
            section key (``"vision": {...}``) is merged into that section, so layout degrees that
            must change together can be swept as one choice.
        overrides: ``key=value`` strings applied to the base first.
        metric, mode: what "best" means (default: lowest final ``loss``); an evaluation metric
            (``eval_loss``) needs ``data.validation``, and Tune then sees the evaluation
            reports only.
        num_samples: Tune repetitions of the search space.
        max_concurrent_trials: default: as many as the cluster's CPUs fit (each trial needs its
            workers' CPUs plus ``trial_cpus`` for its driver).
        trial_cpus: CPUs of each trial's driver (the function that calls ``fit()``).
        name: Tune experiment name (default: ``<run name>_tune``).

    Returns:
        A ``ray.tune.ResultGrid``; ``.get_best_result()`` is the best trial by ``metric``/``mode``.
    """
    import ray.tune

    from ray_dhp.cli.train import init_ray, prepare_data

    if isinstance(run_file, RunFile):
        run_file = run_file.to_dict()
    base_rf = (run_file_from_dict(run_file, overrides) if isinstance(run_file, dict)
               else load_run_file(run_file, overrides))
    _check_keys(param_space)
    if metric.startswith("eval_") and not base_rf.data.validation \
            and "validation" not in (base_rf.data.datasets or {}):
        raise ConfigError(f"sweep metric={metric!r} is an evaluation metric: set data.validation "
                          "in the run file.")
    layouts = [trial_run_file(base_rf.to_dict(), combo) for combo in _grid_values(param_space)]
    workers = max(rf.num_workers() for rf in layouts or [base_rf])
    per_worker = (base_rf.scaling.resources_per_worker or {}).get("CPU", 1)
    base = base_rf.to_dict()
    datasets = prepare_data(base_rf)
    base = set_dotted(base, "data.train", datasets.get("train"))
    base = set_dotted(base, "run.name", base_rf.run_name())
    init_ray(base_rf, workers)
    trainable = ray.tune.with_resources(
        ray.tune.with_parameters(dhp_trainable, base=base, datasets=datasets,
                                 metric=metric if metric.startswith("eval_") else None),
        {"CPU": trial_cpus})
    tuner = ray.tune.Tuner(
        trainable, param_space=param_space,
        tune_config=ray.tune.TuneConfig(
            metric=metric, mode=mode, num_samples=num_samples,
            max_concurrent_trials=max_concurrent_trials
            or _max_concurrent(workers * per_worker, trial_cpus)),
        run_config=ray.tune.RunConfig(name=name or f"{base_rf.run_name()}_tune",
                                      storage_path=base_rf.storage_path()))
    return tuner.fit()
