"""`train_loop_config` of the default VLM loop, as one validated dataclass."""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Optional

LR_SCHEDULES = ("constant", "cosine", "linear")
BAD_DATA = ("skip", "strict")


@dataclass
class TrainLoopConfig:
    """Hyper-parameters of the default loop (keys of ``train_loop_config``).

    Args:
        lr: peak learning rate of AdamW.
        global_batch_size: samples per optimizer step, over all data-parallel replicas.
        num_steps: optimizer steps to run.
        seed: seeds model init (random-init configs), data order and dropout.
        log_every: report metrics every this many steps (each report is a barrier).
        max_grad_norm: global gradient-norm clipping over both modules (None = off).
        micro_batches: gradient-accumulation micro-batches per step.
        lr_schedule: "constant", "cosine" or "linear" decay after warmup.
        warmup_steps: linear warmup steps.
        weight_decay: AdamW decay (not applied to norms and biases).
        betas, eps: AdamW moments.
        bad_data: "skip" (default: skip and count bad samples) or "strict" (fail naming file/line).
        data_root: folder image paths are relative to, for every dataset (default: each
            annotation file's folder; the current directory for Ray Datasets).
        max_tokens: samples longer than this many tokens are bad data (None = no limit); with
            ``packing`` also the length of a packed row.
        micro_batch_tokens: cut each step into micro-batches by tokens instead of by count: in
            order, as many samples as keep every text replica's share within this many tokens
            (image placeholders included); the number of micro-batches then varies per step,
            the update does not. Requires micro_batches=1.
        packing: concatenate each text replica's samples of a micro-batch into rows of at most
            ``max_tokens`` tokens (greedy, in sample order; one row if max_tokens is None)
            instead of padding one sample per row. Each sample keeps its own positions,
            attention and targets, so the update equals the padded one; it saves the compute
            spent on padding.
        checkpoint_every: steps between checkpoints (0 = only at the end).
        resume_from: checkpoint to start from when the run has none of its own yet: a path (one
            checkpoint, or a folder of them) or a ``ray.train.Checkpoint``; any layout.
        precision: the precision policy (`ray_dhp.precision`): "fp32" (fp32 weights, grads and
            AdamW state: 16 B/param), "bf16_autocast" (the same state, matmuls under bf16
            autocast), "bf16_mixed" (bf16 weights and grads, fp32 master weights and AdamW
            moments that the optimizer steps; 16 B/param, half-size weights, grads and
            activations; checkpoints hold the masters) or "bf16" (bf16 weights, grads and
            moments, no masters: 8 B/param). None: from autocast_dtype ("fp32", or
            "bf16_autocast" with autocast_dtype="bfloat16").
        autocast_dtype: None or "bfloat16" (= precision "bf16_autocast"; kept for older run
            files; contradicting precision is an error).
        activation_checkpointing: recompute transformer blocks in backward.
        vision_zero1: shard the vision optimizer state over the vision group (ZeRO-1).
        prefetch: prepare the next step's samples in a background thread while the current
            step trains (each sample is decoded once across the cluster either way).
        data_workers: processes per rank that decode its share of each step (0: decode in the
            prefetch thread; the GIL then serialises decoding with Python-heavy training steps,
            so use 1-4 when the step is not dominated by accelerator time).
        dataset_weights: ``{dataset name: weight > 0}``: train on these named datasets (the
            trainer's ``datasets=``; in a run file, data.train is named "train" and data.datasets
            holds the others), mixed in these ratios (deterministic, resumable). None: train on
            the dataset named "train" alone.
        dataset_paths: ``{name: annotation file}``; set by `DisaggregatedTrainer` when
            ``datasets=`` holds paths instead of Ray Datasets.
    """

    lr: float = 1e-3
    global_batch_size: int = 4
    num_steps: int = 20
    seed: int = 0
    log_every: int = 5
    max_grad_norm: Optional[float] = 1.0
    micro_batches: int = 1
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    bad_data: str = "skip"
    data_root: Optional[str] = None
    max_tokens: Optional[int] = None
    packing: bool = False
    micro_batch_tokens: Optional[int] = None
    checkpoint_every: int = 0
    resume_from: Optional[str] = None
    precision: Optional[str] = None
    autocast_dtype: Optional[str] = None
    activation_checkpointing: bool = False
    vision_zero1: bool = True
    prefetch: bool = True
    data_workers: int = 0
    dataset_weights: Optional[dict] = None
    dataset_paths: Optional[dict] = None

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"train_loop_config: {msg}")

        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        for k in ("global_batch_size", "num_steps", "micro_batches", "log_every"):
            v = getattr(self, k)
            need(isinstance(v, int) and v >= 1, f"{k} must be an integer >= 1, got {v!r}")
        need(self.global_batch_size % self.micro_batches == 0,
             f"global_batch_size={self.global_batch_size} must be divisible by "
             f"micro_batches={self.micro_batches}")
        need(self.lr_schedule in LR_SCHEDULES, f"lr_schedule must be one of {LR_SCHEDULES}")
        need(self.bad_data in BAD_DATA, f"bad_data must be one of {BAD_DATA}")
        need(self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm must be > 0 or None")
        need(self.micro_batch_tokens is None or (isinstance(self.micro_batch_tokens, int)
                                                 and self.micro_batch_tokens >= 1),
             f"micro_batch_tokens must be an integer >= 1 or None, got {self.micro_batch_tokens!r}")
        need(self.micro_batch_tokens is None or self.micro_batches == 1,
             "set micro_batches=1 (the default) with micro_batch_tokens: the token budget decides "
             "how many micro-batches a step has")
        need(isinstance(self.data_workers, int) and self.data_workers >= 0,
             f"data_workers must be an integer >= 0, got {self.data_workers!r}")
        need(self.warmup_steps >= 0 and self.checkpoint_every >= 0,
             "warmup_steps and checkpoint_every must be >= 0")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        need(isinstance(self.packing, bool), f"packing must be true or false, got {self.packing!r}")
        from ray_dhp.precision import policy_name

        try:
            policy_name(self.precision, self.autocast_dtype)
        except ValueError as e:
            need(False, str(e))
        self.betas = tuple(self.betas)
        check_dataset_weights(self.dataset_weights)

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "TrainLoopConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for k in d:
            if k not in known:
                hint = difflib.get_close_matches(k, known, n=1)
                raise ValueError(
                    f"train_loop_config: unknown key {k!r}"
                    + (f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {sorted(known)}")
                )
        return cls(**d)

    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.micro_batches

    def to_dict(self) -> dict:
        return asdict(self)


def check_dataset_weights(weights: Optional[dict], names: Optional[Iterable] = None) -> None:
    """ValueError unless ``weights`` is None or a non-empty ``{name: number > 0}`` whose names are
    all among ``names`` (the trainer's ``datasets=``; None: not checked)."""
    if weights is None:
        return
    if not isinstance(weights, dict) or not weights:
        raise ValueError("train_loop_config: dataset_weights must be a non-empty dict "
                         f"{{dataset name: weight > 0}}, got {weights!r}")
    bad = {k: w for k, w in weights.items() if isinstance(w, bool)
           or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0}
    if bad:
        raise ValueError(f"train_loop_config: dataset_weights must be finite numbers > 0, got {bad}")
    if names is not None:
        names = sorted(names)
        missing = sorted(str(k) for k in weights if k not in names)
        if missing:
            raise ValueError(f"train_loop_config: dataset_weights names {missing} not in datasets= "
                             f"(the datasets given are {names}); weight only datasets passed "
                             "to the trainer")
