"""Building blocks for your own ``train_loop_per_worker`` under `DisaggregatedTrainer`.

The built-in loop (`ray_dhp.train.loop`) is made of these; a custom loop uses the same ones
(docs/custom_loop.md, examples/custom_loss.py)::

    def train_fn(config):
        ctx = ray_dhp.get_context()                       # layout, groups, device, rank
        cfg = ray_dhp.TrainLoopConfig.from_dict(config)
        engine = ray_dhp.build_engine(cfg)                # this rank's shards + optimizers
        loader = ray_dhp.build_loader(cfg, engine)        # the step's micro-batches
        first = ray_dhp.load_checkpoint(engine, loader, cfg.checkpoint.resume_from)
        loader.start(cfg.optim.num_steps - first)
        for step in range(first, cfg.optim.num_steps):
            out = engine.forward_backward(loader.next(), loss_fn=my_loss, last=True)
            out.update(engine.optimizer_step())
            ray_dhp.report_checkpoint({"step": step + 1, **out}, engine, loader)

Every function here is collective: call it on every rank, in the same order.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Union

from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.train.cleanup import staging_dir

logger = logging.getLogger(__name__)

__all__ = ["build_engine", "build_processor", "build_loader", "find_checkpoint", "load_checkpoint",
           "report", "report_checkpoint"]


def _cfg(config: Union[TrainLoopConfig, dict]) -> TrainLoopConfig:
    return config if isinstance(config, TrainLoopConfig) else TrainLoopConfig.from_dict(config)


def _ctx(ctx):
    if ctx is not None:
        return ctx
    from ray_dhp.train.backend import get_context

    return get_context()


def build_engine(config: Union[TrainLoopConfig, dict], ctx=None, *, comm=None,
                 from_checkpoint: bool = False):
    """The `DHPEngine` of this rank: the model of ``ctx.dhp_config`` (the layout's shards only,
    materialised from the model directory or the seed's init), the optimizers and schedules
    of ``config`` (a `TrainLoopConfig` or its dict); ``ctx``: default `ray_dhp.get_context()`;
    ``comm``: an optional `CommCounter` recording every collective's bytes.
    ``from_checkpoint=True``: the weights are allocated but not filled — call `load_checkpoint`
    next (a resume then never computes or reads the initial weights)."""
    from ray_dhp.step.engine import DHPEngine

    ctx = _ctx(ctx)
    return DHPEngine(ctx.dhp_config.model, ctx.groups, _cfg(config).step_config(), comm=comm,
                     schedule=ctx.dhp_config.schedule,
                     init="checkpoint" if from_checkpoint else "source")


def build_processor(ctx=None, config: Union[TrainLoopConfig, dict, None] = None):
    """The run's `VLProcessor`: ``dhp_config.processor``, else the model directory's; with
    ``config``, its ``processor`` section and ``data.video`` applied (the driver says
    when the processor has no chat template: `ray_dhp.data.compat.processor_notes`)."""
    from ray_dhp.data.model_processor import run_processor
    from ray_dhp.data.video import VideoSettings

    ctx = _ctx(ctx)
    dhp = ctx.dhp_config
    processor = run_processor(dhp.processor if dhp.processor is not None else dhp.model, dhp.model)
    if config is None:
        return processor
    cfg = _cfg(config)
    p = cfg.processor
    system = p.system_prompt if p.system_prompt is not None else processor.system_prompt
    processor = processor.configured(system_prompt=system, min_pixels=p.min_pixels,
                                     max_pixels=p.max_pixels, video=VideoSettings.of(cfg.data.video))
    if ctx.rank == 0:
        logger.debug("prompts: %s (system prompt: %s)", "the processor's chat template"
                     if processor.uses_chat_template else "ray_dhp's own Qwen format",
                     "the template's default" if system is None else repr(system))
    return processor


def build_loader(config: Union[TrainLoopConfig, dict], engine=None, ctx=None, processor=None):
    """The `StepLoader` over the run's training data (``datasets=`` of the trainer, or the
    config's ``data.dataset_paths``), the same micro-batches on every rank, pixels only where they are
    computed. Give it the ``engine`` (its balancer decides which vision replica gets which
    images); ``processor``: default `build_processor`. Call ``loader.start(n)`` to prepare steps
    ahead, ``loader.next()`` for each step's micro-batches, ``loader.close()`` at the end."""
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.data.sources import make_sampler

    cfg, ctx = _cfg(config), _ctx(ctx)
    if engine is not None:
        balancer = engine.balancer()
    else:
        from ray_dhp.models import load_model_config
        from ray_dhp.step.microbatch import balancer_for

        balancer = balancer_for(cfg.optim.balance, load_model_config(ctx.dhp_config.model),
                                packing=cfg.data.packing, max_tokens=cfg.data.max_tokens)
    processor = build_processor(ctx, cfg) if processor is None else processor
    return StepLoader(make_sampler(cfg.sampler_config(), processor), ctx.groups, prefetch=cfg.data.prefetch,
                      num_workers=cfg.data.data_workers, balancer=balancer)


def find_checkpoint(source=None):
    """What to resume from: the run's own latest checkpoint (after a failure and restart), else
    ``source`` (a path or ``ray.train.Checkpoint``, e.g. ``cfg.checkpoint.resume_from``); None: start fresh."""
    from ray_dhp.checkpointing import checkpoint

    return checkpoint.latest_of_run() or source


def load_checkpoint(engine, loader=None, source=None) -> int:
    """Resume: load `find_checkpoint(source)` into ``engine`` and ``loader`` (its data
    position). Returns the step to continue from (0: nothing loaded). Loads at any layout (the
    checkpoint reshards)."""
    from ray_dhp.checkpointing import checkpoint

    found = find_checkpoint(source)
    return checkpoint.load(found, engine, loader) if found is not None else 0


def report(metrics: dict) -> None:
    """``ray.train.report(metrics)`` (call on every rank; rank 0's metrics are the ones kept)."""
    import ray.train

    ray.train.report(metrics)


def report_checkpoint(metrics: dict, engine, loader, processor=None,
                      on_saved: Optional[Callable[[], None]] = None) -> None:
    """Write this rank's part of a sharded checkpoint (`ray_dhp.checkpointing.checkpoint.save`: parameters,
    optimizer and schedule states, RNG, the loader's position, ``processor`` for export) into a
    temporary directory and report it with ``metrics``; Ray Train merges every rank's files into
    ``checkpoint_<step>`` under the run's storage and applies ``CheckpointConfig``. ``on_saved``
    runs after the write, before the report."""
    import ray.train

    from ray_dhp.checkpointing import checkpoint

    with staging_dir() as d:
        checkpoint.save(d, engine, loader, processor)
        if on_saved is not None:
            on_saved()
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                         checkpoint_dir_name=f"checkpoint_{engine.step_count:06d}")
