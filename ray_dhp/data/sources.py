"""Where the training samples come from: annotation files given to the trainer, or Ray Datasets.

Without ``dataset_weights`` the run trains on the dataset named "train"; with it, on every dataset
the weights name, mixed in those ratios (`ray_dhp.data.mixture`).
"""

from __future__ import annotations

import os

from ray_dhp.train.loop_config import TrainLoopConfig


def load_records(cfg: TrainLoopConfig, name: str = "train"):
    """(records, data_root) of dataset ``name``: a path given to the trainer (root: the file's
    folder, or ``cfg.data_root``), or the Ray Dataset of that name (root: ``cfg.data_root`` or
    the current directory)."""
    from ray_dhp.data.reading import read_annotations, resolve_data_root

    paths = cfg.dataset_paths or {}
    if name in paths:
        return read_annotations(paths[name]), resolve_data_root(paths[name], cfg.data_root)
    import ray.train

    from ray_dhp.data.reading import records_from_rows

    shard = ray.train.get_dataset_shard(name)
    if shard is None:
        raise ValueError(f'no {name!r} dataset: pass datasets={{"{name}": ...}} to the trainer.')
    root = cfg.data_root or os.getcwd()
    return records_from_rows(shard.iter_rows(), source=f"ray.data:{name}"), root


def load_sources(cfg: TrainLoopConfig) -> list:
    """The run's `DataSource` list: "train" alone (weight 1: a mixture of one), or each dataset of
    ``cfg.dataset_weights`` with its weight."""
    from ray_dhp.data.mixture import DataSource

    if cfg.dataset_weights is None:
        return [DataSource("train", *load_records(cfg))]
    return [DataSource(name, *load_records(cfg, name), weight=float(w))
            for name, w in sorted(cfg.dataset_weights.items())]


def make_sampler(cfg: TrainLoopConfig, processor):
    """The `StepSampler` over the run's training data."""
    from ray_dhp.data.sampler import StepSampler

    return StepSampler.from_sources(load_sources(cfg), processor, cfg)
