"""`DisaggregatedTrainer`: a Ray Train V2 `DataParallelTrainer` whose backend builds DHP groups."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

import ray
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from ray_dhp.train.cluster import DEFAULT_PLACEMENT_TIMEOUT_S, PlacementTimeoutError
from ray_dhp.layout import DHPConfig
from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.train.cleanup import owned_actors, sweep_staging_on_all_nodes, wait_for_owned_actors
from ray_dhp.train.waiting import PlacementWatch


logger = logging.getLogger(__name__)


class DisaggregatedTrainer(DataParallelTrainer):
    """Train a vision-language model with disaggregated hybrid parallelism on Ray Train.

    ``fit()`` returns a ``ray.train.Result``; ``RunConfig`` (storage, checkpoints, failures),
    ``datasets=`` and job submission behave as in any Ray Train trainer.

    Args:
        train_loop_per_worker: your train function; None runs the built-in VLM loop
            (`ray_dhp.train.loop.train_loop`) configured by ``train_loop_config``.
        train_loop_config: dict passed to the train function (for the built-in loop, the keys of
            `ray_dhp.TrainLoopConfig`: flat keys such as ``lr`` or ``packing``, or its sections
            such as ``{"optim": {"lr": ...}}``; unknown keys are rejected here, before workers
            start).
        dhp_config: the layout (`DHPConfig`): model, processor, vision/text degrees, placement.
        scaling_config: ``ray.train.ScalingConfig``; ``num_workers`` must equal the layout's
            worker count (``dhp_config.num_workers``).
        run_config: ``ray.train.RunConfig``.
        datasets: ``{name: ray.data.Dataset | path of a LLaVA JSON/JSONL file}``. The built-in
            loop evaluates on "validation" when given (``eval_loss`` every
            ``train_loop_config["eval_every"]`` steps and at the end) and trains on "train", or,
            with ``train_loop_config["dataset_weights"] = {name: weight}``, on those datasets
            mixed in those ratios (each path dataset's images are
            relative to its own file's folder unless ``data_root`` is set). Datasets are given whole
            to every worker (not split): the built-in loop shards samples itself,
            deterministically from the seed and step, over the data-parallel replicas.
        dataset_config: ``ray.train.DataConfig`` (default: nothing split, order preserved).
        resume_from: start from this checkpoint (a ``ray.train.Checkpoint``, e.g. an earlier
            ``result.checkpoint``, or a path: one checkpoint or a folder of them), written at any
            layout; passed to the workers as ``train_loop_config["resume_from"]``. After a failure
            the run resumes from its own latest checkpoint instead.
        run_checked: the caller already ran `ray_dhp.train.run_checks.check_run` on exactly
            this layout and loop configuration and said its notes (``ray-dhp train`` and
            ``ray_dhp.tune.sweep`` do, through `ray_dhp.run_file.RunFile.validate`, whose errors
            name the run file's keys); the trainer then does not run it again.

    Example:
        >>> import ray.train
        >>> from ray_dhp import DisaggregatedTrainer, DHPConfig, ModuleParallel, demo
        >>> path = demo.make_dataset("/tmp/dhp_data", num_samples=16)
        >>> trainer = DisaggregatedTrainer(
        ...     train_loop_config=dict(lr=1e-3, global_batch_size=4, num_steps=10),
        ...     dhp_config=DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
        ...                          vision=ModuleParallel(sequence_parallel=2),
        ...                          text=ModuleParallel(tensor_parallel=2)),
        ...     scaling_config=ray.train.ScalingConfig(num_workers=2),
        ...     datasets={"train": path})
        >>> result = trainer.fit()  # doctest: +SKIP
    """

    def __init__(
        self,
        train_loop_per_worker: Optional[Callable] = None,
        *,
        dhp_config: DHPConfig,
        train_loop_config: Optional[dict] = None,
        scaling_config=None,
        run_config=None,
        datasets: Optional[dict] = None,
        dataset_config=None,
        resume_from=None,
        placement_timeout_s: Optional[float] = DEFAULT_PLACEMENT_TIMEOUT_S,
        run_checked: bool = False,
    ):
        import ray.train

        if not isinstance(dhp_config, DHPConfig):
            raise ValueError(f"dhp_config must be a ray_dhp.DHPConfig, got {type(dhp_config).__name__}.")
        scaling_config = scaling_config or ray.train.ScalingConfig(num_workers=dhp_config.num_workers)
        if scaling_config.num_workers == 0:
            if dhp_config.num_workers != 1:
                raise ValueError("local mode (num_workers=0) runs one process; use all degrees 1.")
        else:
            dhp_config.validate_workers(scaling_config.num_workers)
            scaling_config = _with_label_selectors(scaling_config, dhp_config)
        ray_datasets, paths = _split_datasets(datasets or {})
        config = dict(train_loop_config or {})
        if resume_from is not None:
            config["resume_from"] = _checkpoint_source(resume_from)
        if train_loop_per_worker is None:
            from ray_dhp.train.loop import train_loop

            train_loop_per_worker = train_loop
            if paths:
                config["dataset_paths"] = paths
            loop_cfg = TrainLoopConfig.from_dict(config)  # fail here, before any worker starts
            from ray_dhp.data.audio import refuse_audio
            from ray_dhp.models import family_of

            if getattr(dhp_config, "audio", None) is None:  # no audio group: audio cannot train
                family = family_of(dhp_config.model_config())
                refuse_audio(paths.values(), family.name, family.audio)
            names = set(ray_datasets) | set(paths)
            _check_training_datasets(loop_cfg, names)
            if not run_checked:  # `ray_dhp.run_file.RunFile.validate` ran it, naming its keys
                from ray_dhp.train.run_checks import check_run

                ckpt = getattr(run_config, "checkpoint_config", None)
                for note in check_run(dhp_config, loop_cfg, datasets=names, name=loop_cfg.key,
                                      score_attribute=getattr(ckpt, "checkpoint_score_attribute",
                                                              None)):
                    logger.warning(note)  # the processor fits the model; said once, here
            if dhp_config.processor is None and not isinstance(dhp_config.model, str):
                raise ValueError("the built-in loop needs DHPConfig(processor=...) when the model "
                                 "is a config object (with a model directory it is loaded from there).")
            from ray_dhp.train.callbacks import MetricsHistory
            from ray_dhp.train.tracking import TensorBoardLogger

            run_config = _with_callback(run_config or ray.train.RunConfig(),
                                        MetricsHistory(loop_cfg.optim.num_steps))
            if loop_cfg.tracking.tensorboard:
                run_config = _with_callback(run_config, TensorBoardLogger(
                    {"train_loop_config": config, "dhp_config": dhp_config.to_dict()}))
        elif paths:
            config.setdefault("dataset_paths", paths)
        if dataset_config is None:
            from ray.data import ExecutionOptions

            dataset_config = ray.train.DataConfig(
                datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))
        super().__init__(
            train_loop_per_worker,
            train_loop_config=config,
            backend_config=dhp_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=ray_datasets,
            dataset_config=dataset_config,
        )
        self._dhp_config = dhp_config
        self._placement_timeout_s = placement_timeout_s

    def _create_default_callbacks(self):
        """Ray Train's callbacks, its placement-group cleaner asking this cluster's state API
        (`ray_dhp.train.pg_cleaner`: no "multiple active Ray instances" or GCS-timeout
        tracebacks beside another Ray on the machine)."""
        from ray_dhp.train.pg_cleaner import with_cluster_cleaner

        return with_cluster_cleaner(super()._create_default_callbacks())

    def fit(self):
        """Check the cluster (`ray_dhp.train.cluster.preflight`), then run as ``DataParallelTrainer.fit``;
        a placement that stays unsatisfiable ends in a ``ControllerError`` wrapping a
        `PlacementTimeoutError` that says so."""
        import ray.train
        from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

        from ray_dhp.train.cluster import bound_placement_retries, preflight, start_timeout_s

        if self.scaling_config.num_workers == 0:
            return super().fit()
        preflight(self._dhp_config, self.scaling_config, self.run_config)
        fc = bound_placement_retries(self.run_config.failure_config, self._placement_timeout_s)
        self.run_config.failure_config = fc
        try:
            with PlacementWatch([dict(self.scaling_config._resources_per_worker_not_none)]
                                * self.scaling_config.num_workers, self._placement_timeout_s), \
                    _leaving_nothing():
                return super().fit()
        except ray.train.ControllerError as e:
            if not isinstance(e.controller_failure, WorkerGroupStartupTimeoutError):
                raise
            tries = fc.controller_failure_limit + 1
            raise ray.train.ControllerError(PlacementTimeoutError(
                f"ray_dhp: Ray Train could not place the {self.scaling_config.num_workers} "
                f"workers of this layout ({self.scaling_config._resources_per_worker_not_none} "
                f"each) in {tries} attempt(s) of {start_timeout_s():g} s "
                f"(placement_timeout_s={self._placement_timeout_s}; "
                f"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S): the cluster no longer has room for "
                "them — a node was lost and no replacement joined, or the cluster is too small. "
                "Add nodes (or lower the worker count) and resume the run by its name.")) from e


@contextlib.contextmanager
def _leaving_nothing():
    """Around ``fit()``: afterwards (returned, failed or interrupted) put back the driver's
    SIGINT handler, wait (bounded) until the actors the run started have exited, and sweep
    workers' checkpoint staging folders on every node (`ray_dhp.train.cleanup`). The handler: Ray Train installs one in the main
    thread that holds the controller's handle (Ctrl-C aborts the run gracefully) and leaves it
    installed: the controller actor and its dataset manager then stay alive as long as the
    driver process does (a notebook or a script running several fits kept one idle controller
    per finished run), and a later Ctrl-C called ``abort`` on a finished controller."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        mine = set(owned_actors())  # the caller's own actors, from before the run
    except Exception:  # the GCS table unreadable: skip the wait, never fail the run for it
        mine = None
    try:
        yield
    finally:
        if main and signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)
        left = [] if mine is None else wait_for_owned_actors(ignore=mine, timeout_s=30.0)
        if left:
            logger.warning("ray_dhp: actors of this run still alive 30 s after fit(): %s", left)
        sweep_staging_on_all_nodes(ray.get_runtime_context().get_job_id(),
                                   wait_pids=None if mine is None else _run_pids(mine))


def _run_pids(mine: set):
    """Process ids of the actors this run started (its workers among them), or None (unknown:
    wait for every process of the job). Tune trials share a job: a trial's sweep must not wait
    for another trial's live workers."""
    try:
        return sorted({a["Pid"] for aid, a in owned_actors().items()
                       if aid not in mine and a.get("Pid")})
    except Exception:
        return None


def _check_training_datasets(cfg: TrainLoopConfig, names: set) -> None:
    """The datasets the built-in loop trains on are among ``datasets=`` (ValueError otherwise)."""
    from ray_dhp.config.data_section import check_dataset_weights

    if cfg.data.dataset_weights is not None:
        check_dataset_weights(cfg.data.dataset_weights, names, key=cfg.key("data.dataset_weights"))
    elif "train" not in names:
        raise ValueError('the built-in loop needs datasets={"train": <Dataset or path>}'
                         + (f' (got {sorted(names)}; to mix several, set train_loop_config['
                            '"dataset_weights"] = {name: weight})' if names else "") + ".")


def _checkpoint_source(resume_from):
    """A local path made absolute (workers change directory) and checked; a Checkpoint as is."""
    if not hasattr(resume_from, "as_directory"):  # a path (a ray.train.Checkpoint is PathLike too)
        path = os.path.abspath(os.fspath(resume_from))
        if not os.path.isdir(path):
            raise ValueError(f"resume_from={path!r} is not a directory (a checkpoint or a folder "
                             "of checkpoints).")
        _check_sampler_state(path)
        return path
    return resume_from


def _check_sampler_state(path: str) -> None:
    """Stop before workers start if the checkpoint's data order cannot be continued (a folder
    with no complete checkpoint is left to the workers, which say so)."""
    from ray_dhp.checkpointing import integrity
    from ray_dhp.data.sampler import OldSamplerState, check_state

    try:
        found = integrity.candidates(path)[0]
    except FileNotFoundError:
        return
    try:
        check_state(integrity.read_meta(found).get("sampler"))
    except OldSamplerState as e:
        raise ValueError(f"resume_from={found!r}: {e}") from None


def _with_label_selectors(scaling_config, dhp_config):
    """``scaling_config`` with one ``label_selector`` per worker from ``DHPConfig(labels=...)``
    (in DHP-rank order: bundle r is placed for rank r, `ray_dhp.train.labels`)."""
    selectors = dhp_config.label_selectors()
    if selectors is None:
        return scaling_config
    if scaling_config.label_selector not in (None, selectors):
        raise ValueError(
            f"ScalingConfig(label_selector={scaling_config.label_selector!r}) and "
            f"DHPConfig(labels={dhp_config.labels!r}) both choose the workers' nodes; set the "
            "labels in DHPConfig only (per module; it builds the per-worker selectors).")
    return replace(scaling_config, label_selector=selectors)


def _with_callback(run_config, callback):
    """``run_config`` with ``callback`` added unless one of its class is already there."""
    callbacks = list(run_config.callbacks or [])
    if not any(isinstance(c, type(callback)) for c in callbacks):
        callbacks.append(callback)
    run_config.callbacks = callbacks
    return run_config


def _split_datasets(datasets: dict) -> tuple[dict, dict]:
    """Separate Ray Datasets (kept for Ray Data ingest) from file paths (read by the workers)."""
    ray_datasets: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for name, ds in datasets.items():
        if isinstance(ds, (str, os.PathLike)):
            p = os.path.abspath(os.fspath(ds))
            if not os.path.exists(p):
                raise ValueError(f"datasets[{name!r}]: {p} does not exist.")
            paths[name] = p
        else:
            ray_datasets[name] = ds
    return ray_datasets, paths
