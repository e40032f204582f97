"""The built-in VLM train loop (the default ``train_loop_per_worker``)."""

from __future__ import annotations

import logging
import os
import time

import torch

from ray_dhp.train_config import TrainLoopConfig

logger = logging.getLogger(__name__)


def load_records(cfg: TrainLoopConfig):
    """(records, data_root): from a path given to the trainer, or from the Ray Dataset "train"."""
    from ray_dhp.data.reading import read_annotations, resolve_data_root

    paths = cfg.dataset_paths or {}
    if "train" in paths:
        return read_annotations(paths["train"]), resolve_data_root(paths["train"], cfg.data_root)
    import ray.train

    from ray_dhp.data.reading import records_from_rows

    shard = ray.train.get_dataset_shard("train")
    if shard is None:
        raise ValueError('no "train" dataset: pass datasets={"train": ...} to the trainer.')
    root = cfg.data_root or os.getcwd()
    return records_from_rows(shard.iter_rows(), source="ray.data:train"), root


def _report(metrics: dict, *, checkpoint=None) -> None:
    import ray.train

    ray.train.report(metrics, checkpoint=checkpoint)


def train_loop(config: dict) -> None:
    """Train the configured VLM with DHP; report loss/step/tokens_per_s every ``log_every`` steps."""
    from ray_dhp.backend import get_context
    from ray_dhp.data.processing import as_vl_processor
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.engine import DHPEngine
    from ray_dhp.parallel.comm import CommCounter

    cfg = TrainLoopConfig.from_dict(config)
    ctx = get_context()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    processor = as_vl_processor(ctx.dhp_config.processor if ctx.dhp_config.processor is not None
                                else ctx.dhp_config.model)
    records, data_root = load_records(cfg)
    sampler = StepSampler(records, processor, data_root, cfg)
    engine = DHPEngine(ctx.dhp_config.model, ctx.groups, cfg, comm=CommCounter(),
                       schedule=ctx.dhp_config.schedule)
    window_tokens, window_time = 0, 0.0
    for step in range(cfg.num_steps):
        t0 = time.perf_counter()
        micro_batches = sampler.next_step()
        out = engine.step(micro_batches)
        window_time += time.perf_counter() - t0
        window_tokens += sum(int(s.input_ids.numel()) for mb in micro_batches for s in mb)
        last = step == cfg.num_steps - 1
        if step == 0 or (step + 1) % cfg.log_every == 0 or last:
            metrics = {
                "step": step + 1, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                "tokens_per_s": window_tokens / max(window_time, 1e-9),
                "skipped_samples": sampler.skipped, "epoch": sampler.epoch,
            }
            if ctx.rank == 0:
                logger.info("step %d/%d %s", step + 1, cfg.num_steps, metrics)
            _report(metrics)
            window_tokens, window_time = 0, 0.0
