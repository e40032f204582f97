"""The ``data`` section of the default loop's configuration (`DataConfig`) and its ``video``
part (`VideoConfig`); the other sections: `ray_dhp.config.sections`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ray_dhp.config.checks import ConfigError, checked, keyed
from ray_dhp.config.sections import Section, subsection

__all__ = ["DataConfig", "VideoConfig", "BAD_DATA", "check_dataset_weights"]

BAD_DATA = ("skip", "strict")


@dataclass
class VideoConfig(Section):
    """How videos are sampled and sized, as qwen-vl-utils samples them (`ray_dhp.data.video`).

    Args:
        fps, min_frames, max_frames: videos are sampled at fps frames per second (default 2),
            the frame count kept within [min_frames, max_frames] (default 4, 768) and a
            multiple of the temporal patch size.
        min_pixels, max_pixels, total_pixels: per-frame area bounds and the whole video's area
            budget (the per-frame cap is min(max_pixels, 768 merge units, 2 x total_pixels /
            frames)); None: qwen-vl-utils' defaults (128 and 768 merge units per frame, 115200
            merge units per video; a merge unit is 28x28 px, 32x32 for Qwen3-VL). Source frames
            over data.max_image_pixels are bad data.
    """

    fps: float = checked(2.0, gt=0)
    min_frames: int = checked(4, ge=1)
    max_frames: int = checked(768, ge=2)
    min_pixels: Optional[int] = checked(None, ge=1)
    max_pixels: Optional[int] = checked(None, ge=1)
    total_pixels: Optional[int] = checked(None, ge=1)

    def rules(self) -> list:
        return [
            (f"{{min_frames}}={self.min_frames} > {{max_frames}}={self.max_frames}: the "
             "frame-count range is empty.", self.min_frames <= self.max_frames),
            (f"{{min_pixels}}={self.min_pixels} > {{max_pixels}}={self.max_pixels}: the frame "
             "area range is empty.",
             None in (self.min_pixels, self.max_pixels) or self.min_pixels <= self.max_pixels),
        ]


@dataclass
class DataConfig(Section):
    """Training data.

    Args:
        data_root: folder image paths are relative to, for every dataset (default: each
            annotation file's folder; the current directory for Ray Datasets).
        max_tokens: samples longer than this many tokens are bad data (None = no limit); with
            ``packing`` also the length of a packed row.
        packing: concatenate each text replica's samples of a micro-batch into rows of at most
            ``max_tokens`` tokens (filled first fit decreasing, as few rows as that makes,
            evened out; one row if max_tokens is None)
            instead of padding one sample per row. Each sample keeps its own positions,
            attention and targets, so the update equals the padded one; it saves the compute
            spent on padding.
        bad_data: "skip" (default: skip and count bad samples) or "strict" (fail naming file/line).
        dataset_weights: ``{dataset name: weight > 0}``: train on these named datasets (the
            trainer's ``datasets=``; in a run file, data.train is named "train" and data.datasets
            holds the others), mixed in these ratios (deterministic, resumable). None: train on
            the dataset named "train" alone.
        prefetch: prepare the next step's samples in a background thread while the current
            step trains (each sample is decoded once across the cluster either way).
        data_workers: processes per rank that decode its share of each step (0: decode in the
            prefetch thread; the GIL then serialises decoding with Python-heavy training steps,
            so use 1-4 when the step is not dominated by accelerator time).
        max_text_chars: records whose turns hold more characters than this are bad data, found
            before tokenizing (a runaway line would cost gigabytes in the tokenizer; None = no
            limit).
        max_image_pixels: images with more pixels (width x height, read from the file header)
            are bad data, found before decoding (None = no limit; Pillow's own bomb guard still
            refuses images over about 179M pixels).
        max_bad_fraction: in skip mode, fail the run with a summary of the bad samples (counts
            per reason, first examples, likely fix) once more than this fraction of the records
            drawn so far are bad (judged after min(200, dataset size) draws; the default 0.25
            catches a wrong data_root or a broken file early); 1.0 never fails.
        eval_every: with a validation set (``datasets={"validation": ...}``; run file:
            data.validation), report ``eval_loss`` (the loss over the whole validation set,
            token-weighted, forward only) every this many steps and at the end of training;
            0: only at the end.
        eval_batch_size: validation records per batch, one forward each (with
            ``micro_batch_tokens``: cut by that token budget, as training steps are); the last
            batch may be partial. None: global_batch_size / micro_batches.
        index_dir: where annotation files' record indexes (and Ray Datasets' spools) are kept;
            None: a ``.ray_dhp_index`` folder beside each file (``~/.cache/ray_dhp/index`` when
            that folder is not writable) and ``<tmp>/ray_dhp_spool`` (see docs/data.md).
        video: how videos are sampled and sized (`VideoConfig`).
        dataset_paths: ``{name: annotation file}``; set by `DisaggregatedTrainer` when
            ``datasets=`` holds paths instead of Ray Datasets (a run file's data.train and
            data.datasets).
    """

    data_root: Optional[str] = None
    max_tokens: Optional[int] = checked(None, ge=1)
    packing: bool = False
    bad_data: str = checked("skip", choices=BAD_DATA)
    dataset_weights: Optional[dict] = None
    prefetch: bool = True
    data_workers: int = checked(0, ge=0)
    max_text_chars: Optional[int] = checked(1_000_000, ge=1)
    max_image_pixels: Optional[int] = checked(50_000_000, ge=1)
    max_bad_fraction: float = checked(0.25, ge=0, le=1)
    eval_every: int = checked(0, ge=0)
    eval_batch_size: Optional[int] = checked(None, ge=1)
    index_dir: Optional[str] = None
    video: VideoConfig = subsection(VideoConfig, "how videos are sampled and sized")
    dataset_paths: Optional[dict] = field(default=None, metadata={"runtime": True})  # not in a file

    def rules(self) -> list:
        with keyed("dataset_weights") as key:
            check_dataset_weights(self.dataset_weights, key=key)
        return []


def check_dataset_weights(weights: Optional[dict], names: Optional[Iterable] = None, *,
                          key: str = "train_loop_config.dataset_weights") -> None:
    """ConfigError (a ValueError) naming ``key`` unless ``weights`` is None or a non-empty
    ``{name: number > 0}`` whose names are all among ``names`` (the trainer's ``datasets=``;
    None: not checked)."""
    if weights is None:
        return
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"{key}: must be a non-empty mapping {{dataset name: weight > 0}}, "
                          f"got {weights!r}.")
    bad = {k: w for k, w in weights.items() if isinstance(w, bool)
           or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0}
    if bad:
        raise ConfigError(f"{key}: weights must be finite numbers > 0, got {bad}.")
    if names is not None:
        names = sorted(names)
        missing = sorted(str(k) for k in weights if k not in names)
        if missing:
            raise ConfigError(f"{key}: names {missing} not in datasets= (the datasets given are "
                              f"{names}); weight only datasets passed to the trainer.")
