"""The built-in VLM train loop (the default ``train_loop_per_worker``)."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import torch

from ray_dhp.train.checkpoint_reports import CheckpointReports
from ray_dhp.train.custom_loop import build_engine, find_checkpoint
from ray_dhp.config.train_loop import TrainLoopConfig

logger = logging.getLogger(__name__)


def _peak_memory_mb_per_rank() -> list:
    """Peak memory of every rank (CUDA max allocated on GPU, else peak RSS), in MiB."""
    import resource

    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine = torch.cuda.max_memory_allocated() / 2**20
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, round(mine, 1))
    return out


def train_loop(config: dict, *, hook: Optional[Callable] = None) -> dict:
    """Train the configured VLM with DHP; report loss/step/tokens_per_s every ``log_every`` steps,
    a sharded checkpoint every ``checkpoint_every`` steps and at the end, and, with a
    "validation" dataset, ``eval_loss`` every ``eval_every`` steps and at the end.

    Args:
        config: ``train_loop_config`` (keys of `TrainLoopConfig`).
        hook: optional ``hook(event, step)`` called on every rank at ``"step_end"``, at
            ``"checkpoint_writing"`` (background writes only, on the writer thread: this rank's
            shards are on disk, the checkpoint is not committed) and at ``"checkpoint_saved"``
            (complete on every rank, before its report); for instrumentation and
            fault-injection tests (`ray_dhp.train.checkpoint_reports`).

    Returns:
        ``{"resumed_from_step": k, "final_step": n}`` (rank 0's is ``Result.return_value``).
    """
    from ray_dhp.train.backend import get_context
    from ray_dhp.train.custom_loop import build_loader, build_processor
    from ray_dhp.train.tracking import WorkerTrackers, set_ray_report_logs

    cfg = TrainLoopConfig.from_dict(config)
    set_ray_report_logs(cfg.tracking.ray_report_logs)
    hook = hook or (lambda event, step: None)
    ctx = get_context()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    processor = build_processor(ctx, cfg)
    loader = build_loader(cfg, ctx=ctx, processor=processor)  # the engine's balancer, from the config
    from ray_dhp.data.eval_loader import make_eval_loader

    eval_loader = make_eval_loader(cfg.sampler_config(), processor, ctx.groups, loader.balancer)  # None: no validation set
    import ray.train

    trackers = WorkerTrackers(mlflow=cfg.tracking.mlflow, wandb=cfg.tracking.wandb, rank=ctx.rank,
                              config={**cfg.to_flat_dict(), "dhp": ctx.dhp_config.to_dict()},
                              run_name=ray.train.get_context().get_experiment_name())
    try:
        out = _train(cfg, ctx, loader, processor, hook, trackers, eval_loader)
        from ray_dhp.data.spool import release_spools

        release_spools(loader.sampler, loader.group)  # done: its Ray Dataset spools go (kept on failure)
        return out
    finally:
        trackers.close()
        loader.close()
        if eval_loader is not None:
            eval_loader.close()


def _train(cfg: TrainLoopConfig, ctx, loader, processor, hook, trackers, eval_loader=None) -> dict:
    """The loop itself (see `train_loop`)."""
    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.planning.flops import peak_flops, step_flops
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.comm import CommCounter

    # The run's latest checkpoint (after a restart) or cfg.checkpoint.resume_from: the engine is then built
    # without filling its weights (the checkpoint overwrites every one of them).
    found = find_checkpoint(cfg.checkpoint.resume_from)
    engine = build_engine(cfg, ctx, comm=CommCounter(), from_checkpoint=found is not None)
    first = checkpoint.load(found, engine, loader) if found is not None else 0
    reports = CheckpointReports(cfg.checkpoint.async_save, ctx.groups.device, hook)
    if first >= cfg.optim.num_steps:
        logger.warning("the checkpoint is at step %d >= num_steps=%d: nothing to train; raise "
                       "num_steps to continue it", first, cfg.optim.num_steps)
    loader.start(cfg.optim.num_steps - first)  # prepares step k+1 while step k trains
    counts = count_params(engine.config)
    bf16 = torch.bfloat16 in (engine.policy.param_dtype, engine.policy.autocast_dtype)
    peak = peak_flops(ctx.groups.device, "bfloat16" if bf16 else None)
    window_start = first
    window_tokens, window_patches, window_time, data_wait, window_flops = 0, 0, 0.0, 0.0, 0.0
    for step in range(first, cfg.optim.num_steps):
        t0 = time.perf_counter()
        micro_batches = loader.next()
        data_wait += time.perf_counter() - t0
        out = engine.step(micro_batches)
        window_time += time.perf_counter() - t0
        if step == first:  # outside the timed window, once: the async save's host buffers
            reports.reserve(engine)
        window_tokens += sum(int(s.input_ids.numel()) for mb in micro_batches for s in mb)
        window_patches += sum(int(s.image_grid_thw.prod(-1).sum()) for mb in micro_batches for s in mb
                              if s.image_grid_thw is not None)
        window_flops += step_flops(engine.config, counts, micro_batches)
        hook("step_end", step + 1)
        last = step == cfg.optim.num_steps - 1
        save = last or (cfg.checkpoint.checkpoint_every > 0 and (step + 1) % cfg.checkpoint.checkpoint_every == 0)
        evaluate = eval_loader is not None and (
            last or (cfg.data.eval_every > 0 and (step + 1) % cfg.data.eval_every == 0))
        if save or evaluate or step == first or (step + 1) % cfg.optim.log_every == 0:
            metrics = {
                "step": step + 1, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                "tokens_per_s": window_tokens / max(window_time, 1e-9),
                "vision_tokens_per_s": window_patches / max(window_time, 1e-9),
                "skipped_samples": loader.skipped, "epoch": loader.epoch,
                "time_data_wait_s": data_wait / max(1, step + 1 - window_start),
                # model FLOPs (no recompute) per second per rank; MFU against the device's peak
                "model_tflops_per_s_per_rank": window_flops / max(window_time, 1e-9) / ctx.topology.world_size / 1e12,
                "peak_memory_mb_per_rank": _peak_memory_mb_per_rank(),
                **{k: v for k, v in out.items() if k.startswith("time_")},  # step-phase times
            }
            if evaluate:  # outside the timed window: tokens_per_s stays the training speed
                t_eval = time.perf_counter()
                metrics.update(engine.evaluate(eval_loader.batches()))
                metrics["time_eval_s"] = time.perf_counter() - t_eval
            if peak is not None:
                metrics["mfu"] = metrics["model_tflops_per_s_per_rank"] * 1e12 / peak
            mix = loader.state_dict().get("datasets")
            if mix is not None:  # several datasets: samples drawn and passes completed, per dataset
                metrics["dataset_draws"] = {n: st["draws"] for n, st in mix.items()}
                metrics["dataset_epochs"] = {n: st["epoch"] for n, st in mix.items()}
            if ctx.rank == 0:
                logger.debug("step %d/%d %s", step + 1, cfg.optim.num_steps, metrics)
            trackers.log(metrics, step + 1)
            if save:
                reports.save(metrics, engine, loader, processor)
            else:
                reports.report(metrics)
            window_tokens, window_patches, window_time, data_wait, window_flops = 0, 0, 0.0, 0.0, 0.0
            window_start = step + 1
        else:  # a write that became durable everywhere is registered at once, not at the next log
            reports.flush(wait=False)
    reports.flush(wait=True)  # the last checkpoint, durable on every rank, reported
    return {"resumed_from_step": first, "final_step": engine.step_count}
