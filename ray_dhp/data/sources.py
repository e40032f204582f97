"""Where the training samples come from: annotation files given to the trainer, or Ray Datasets.

Without ``dataset_weights`` the run trains on the dataset named "train"; with it, on every dataset
the weights name, mixed in those ratios (`ray_dhp.data.mixture`).
"""

from __future__ import annotations

import os

from ray_dhp.config.data_section import DataConfig


def load_records(cfg: DataConfig, name: str = "train"):
    """(records, data_root) of dataset ``name``: a path given to the trainer, indexed (root: the
    file's folder, or ``cfg.data_root``), or the Ray Dataset of that name, streamed into a spool
    (`ray_dhp.data.spool`; root: ``cfg.data_root`` or the current directory). Either way the
    records are parsed on demand (`ray_dhp.data.reading.Annotations`)."""
    from ray_dhp.data.reading import Annotations, read_annotations, resolve_data_root

    paths = cfg.dataset_paths or {}
    if name in paths:
        return (read_annotations(paths[name], cfg.index_dir),
                resolve_data_root(paths[name], cfg.data_root))
    import ray.train

    from ray_dhp.data.spool import spool_dataset, spool_dir

    shard = ray.train.get_dataset_shard(name)
    if shard is None:
        raise ValueError(f'no {name!r} dataset: pass datasets={{"{name}": ...}} to the trainer.')
    root = cfg.data_root or os.getcwd()
    key = run_key()
    return Annotations([spool_dataset(shard, name, spool_dir(cfg.index_dir), key,
                                      in_task=True)]), root


def run_key() -> str:
    """Names this run's spools: its experiment name and storage folder (a restart, or a later
    ``fit`` of the same run, reuses them; another run of the same name elsewhere does not)."""
    import hashlib

    import ray.train

    ctx = ray.train.get_context()
    try:
        where = ctx.get_storage().experiment_fs_path
    except Exception:  # local mode: no storage context
        where = os.getcwd()
    return f"{ctx.get_experiment_name()}-{hashlib.sha256(where.encode()).hexdigest()[:10]}"


def load_sources(cfg: DataConfig) -> list:
    """The run's `DataSource` list: "train" alone (weight 1: a mixture of one), or each dataset of
    ``cfg.dataset_weights`` with its weight."""
    from ray_dhp.data.mixture import DataSource

    if cfg.dataset_weights is None:
        return [DataSource("train", *load_records(cfg))]
    return [DataSource(name, *load_records(cfg, name), weight=float(w))
            for name, w in sorted(cfg.dataset_weights.items())]


def make_sampler(cfg, processor):
    """The `StepSampler` over the run's training data (``cfg``: what the sampler reads,
    `ray_dhp.config.views.SamplerConfig`; the datasets from its ``data`` section)."""
    from ray_dhp.data.sampler import StepSampler

    return StepSampler.from_sources(load_sources(cfg.data), processor, cfg)
