"""Where the training samples come from: annotation files given to the trainer, or Ray Datasets."""

from __future__ import annotations

import os

from ray_dhp.train_config import TrainLoopConfig


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


def make_sampler(cfg: TrainLoopConfig, processor):
    """The `StepSampler` over the run's training data."""
    from ray_dhp.data.sampler import StepSampler

    records, data_root = load_records(cfg)
    return StepSampler(records, processor, data_root, cfg)
