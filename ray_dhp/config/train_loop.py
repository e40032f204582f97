"""`train_loop_config` of the default VLM loop, as one validated dataclass."""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterable, Optional

from ray_dhp.config.checks import ConfigError, check_fields, checked, coerce
from ray_dhp.config.tuning import parse_tuning_named

LR_SCHEDULES = ("constant", "cosine", "linear")
POLICY_NAMES = ("fp32", "bf16_autocast", "bf16_mixed", "bf16")  # `ray_dhp.step.precision.POLICIES`
BAD_DATA = ("skip", "strict")
BALANCE = ("cost", "count")  # = ray_dhp.parallel.balance.BALANCE_MODES
_UNTYPED = ("resume_from",)  # a path or a ray.train.Checkpoint


def loop_key(name: str) -> str:
    """How the Python API names a key in messages: ``train_loop_config.lr``."""
    return f"train_loop_config.{name}"


@dataclass
class TrainLoopConfig:
    """Hyper-parameters of the default loop (keys of ``train_loop_config``).

    Args:
        lr: peak learning rate of AdamW.
        global_batch_size: samples per optimizer step, over all data-parallel replicas.
        num_steps: optimizer steps to run.
        seed: seeds model init (random-init configs), data order and dropout.
        log_every: report metrics every this many steps (each report is a barrier).
        max_grad_norm: global gradient-norm clipping over every module (None = off).
        micro_batches: gradient-accumulation micro-batches per step.
        lr_schedule: "constant", "cosine" or "linear" decay after warmup.
        warmup_steps: linear warmup steps.
        weight_decay: AdamW decay (not applied to norms and biases).
        betas: AdamW's decay rates of the first and second moment estimates, each in [0, 1).
        eps: AdamW's term added to the denominator (the root of the second moment), > 0.
        bad_data: "skip" (default: skip and count bad samples) or "strict" (fail naming file/line).
        data_root: folder image paths are relative to, for every dataset (default: each
            annotation file's folder; the current directory for Ray Datasets).
        max_tokens: samples longer than this many tokens are bad data (None = no limit); with
            ``packing`` also the length of a packed row.
        max_text_chars: records whose turns hold more characters than this are bad data, found
            before tokenizing (a runaway line would cost gigabytes in the tokenizer; None = no
            limit).
        max_image_pixels: images with more pixels (width x height, read from the file header)
            are bad data, found before decoding (None = no limit; Pillow's own bomb guard still
            refuses images over about 179M pixels).
        video_fps, video_min_frames, video_max_frames: videos are sampled at video_fps frames
            per second (default 2), the frame count kept within [video_min_frames,
            video_max_frames] (default 4, 768) and a multiple of the temporal patch size, as
            qwen-vl-utils samples them (`ray_dhp.data.video`).
        video_min_pixels, video_max_pixels, video_total_pixels: per-frame area bounds and the
            whole video's area budget (the per-frame cap is min(video_max_pixels, 768 merge
            units, 2 x video_total_pixels / frames)); None: qwen-vl-utils' defaults (128 and
            768 merge units per frame, 115200 merge units per video; a merge unit is 28x28 px,
            32x32 for Qwen3-VL). Source frames over max_image_pixels are bad data.
        max_bad_fraction: in skip mode, fail the run with a summary of the bad samples (counts
            per reason, first examples, likely fix) once more than this fraction of the records
            drawn so far are bad (judged after min(200, dataset size) draws; the default 0.25
            catches a wrong data_root or a broken file early); 1.0 never fails.
        micro_batch_tokens: cut each step into micro-batches by tokens instead of by count: in
            order, as many samples as keep every text replica's share within this many tokens
            (image placeholders included); the number of micro-batches then varies per step,
            the update does not. Requires micro_batches=1.
        packing: concatenate each text replica's samples of a micro-batch into rows of at most
            ``max_tokens`` tokens (greedy, in sample order; one row if max_tokens is None)
            instead of padding one sample per row. Each sample keeps its own positions,
            attention and targets, so the update equals the padded one; it saves the compute
            spent on padding.
        balance: how a step's samples are shared out: "cost" (default) gives every vision
            replica, text replica, micro-batch and decode owner an even share of the work by a
            per-sample cost model (vision: patches, full attention ~ patches² per image; text:
            tokens incl. image placeholders, attention ~ tokens²), so mixed resolutions do not
            leave replicas waiting, and a text replica that pads runs its samples as padded
            groups of similar length; "count" splits into contiguous equal counts, one padded
            batch per text replica. The update is the same either way (each sample is
            computed once).
        system_prompt: the system message of conversations that have none, when the processor
            has a chat template (`ray_dhp.data.chat`): None = the template's default (the
            Qwen2/2.5-VL-Instruct templates: "You are a helpful assistant."), "" = no system
            message where the template allows it (Qwen2/2.5-VL's always write one: then an empty
            one), any other text = that system message. Without a chat template (ray_dhp's own
            Qwen format): a system message only when set to a non-empty text.
        min_pixels, max_pixels: the image processor resizes every image to an area within
            [min_pixels, max_pixels] pixels, sides multiples of patch_size x merge_size (28 px;
            32 px for Qwen3-VL) (None: the processor's own limits). This sets the vision tokens
            per image; max_image_pixels instead refuses oversized source files.
        checkpoint_every: steps between checkpoints (0 = only at the end).
        async_save: write checkpoints in the background (default): a save point holds the step
            only while this rank's state is copied into host buffers (pinned on GPU; one copy of
            the rank's checkpoint state, kept for the run: ``ray-dhp plan`` shows it), the write
            (checksummed, fsynced) runs in a thread, and the checkpoint is reported to Ray Train
            once it is durable on every rank (`ray_dhp.train.checkpoint_reports`). False: write
            inside the step (no extra host memory; the step waits for the whole write).
        eval_every: with a validation set (``datasets={"validation": ...}``; run file:
            data.validation), report ``eval_loss`` (the loss over the whole validation set,
            token-weighted, forward only) every this many steps and at the end of training;
            0: only at the end.
        eval_batch_size: validation records per batch, one forward each (with
            ``micro_batch_tokens``: cut by that token budget, as training steps are); the last
            batch may be partial. None: global_batch_size / micro_batches.
        resume_from: checkpoint to start from when the run has none of its own yet: a path (one
            checkpoint, or a folder of them) or a ``ray.train.Checkpoint``; any layout.
        precision: the precision policy (`ray_dhp.step.precision`): "fp32" (fp32 weights, grads and
            AdamW state: 16 B/param), "bf16_autocast" (the same state, matmuls under bf16
            autocast), "bf16_mixed" (bf16 weights, gradients accumulated in fp32, fp32 master
            weights and AdamW moments that the optimizer steps; 18 B/param, half-size weights
            and activations; checkpoints hold the masters) or "bf16" (bf16 weights and
            moments, gradients accumulated in fp32, no masters: 10 B/param).
        tf32: TF32 for fp32 matmuls and convolutions on CUDA (`ray_dhp.step.gpu`; ignored on
            CPU). Matters for the fp32 and bf16_autocast policies' fp32 matmuls.
        activation_checkpointing: recompute transformer blocks in backward.
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
        index_dir: where annotation files' record indexes (and Ray Datasets' spools) are kept;
            None: a ``.ray_dhp_index`` folder beside each file (``~/.cache/ray_dhp/index`` when
            that folder is not writable) and ``<tmp>/ray_dhp_spool`` (see docs/data.md).
        tensorboard: write every reported metric as TensorBoard scalars into
            ``<storage_path>/<run name>/tensorboard`` (from the Ray Train controller).
        mlflow: None (off) or the keyword arguments of Ray's ``setup_mlflow`` (e.g.
            ``{tracking_uri: ..., experiment_name: ...}``): the run's config as parameters and
            every reported metric, logged from rank 0. Needs ``pip install mlflow``.
        wandb: None (off) or the keyword arguments of Ray's ``setup_wandb`` (e.g. ``{project:
            ...}``), logged from rank 0. Needs ``pip install wandb``.
        ray_report_logs: keep Ray Train's per-rank "Reporting training result ..." and
            "Checkpoint successfully created" log lines (off: the console shows one progress
            line per report instead).
        modules: per-module training choices (`ray_dhp.config.tuning`), a mapping of ``vision`` (the
            vision tower), ``merger``, ``audio`` (Qwen2.5-Omni's audio tower) and ``llm`` (the
            language model) to ``{train: bool, lr:
            float, weight_decay: float}``; ``llm`` also takes ``lora: {r, alpha,
            target_modules}`` (PEFT LoRA adapters; the base weights are frozen). A module not
            named trains with lr and weight_decay. Frozen modules keep no gradients, optimizer
            state or fp32 masters. None: everything trains.
    """

    lr: float = checked(1e-3, gt=0)
    global_batch_size: int = checked(4, ge=1)
    num_steps: int = checked(20, ge=1)
    seed: int = checked(0, ge=0)
    log_every: int = checked(5, ge=1)
    max_grad_norm: Optional[float] = checked(1.0, gt=0)
    micro_batches: int = checked(1, ge=1)
    lr_schedule: str = checked("constant", choices=LR_SCHEDULES)
    warmup_steps: int = checked(0, ge=0)
    weight_decay: float = checked(0.0, ge=0)
    betas: tuple = checked((0.9, 0.999), length=2, ge=0, lt=1)
    eps: float = checked(1e-8, gt=0)
    bad_data: str = checked("skip", choices=BAD_DATA)
    data_root: Optional[str] = None
    max_tokens: Optional[int] = checked(None, ge=1)
    max_text_chars: Optional[int] = checked(1_000_000, ge=1)
    max_image_pixels: Optional[int] = checked(50_000_000, ge=1)
    max_bad_fraction: float = checked(0.25, ge=0, le=1)
    video_fps: float = checked(2.0, gt=0)
    video_min_frames: int = checked(4, ge=1)
    video_max_frames: int = checked(768, ge=2)
    video_min_pixels: Optional[int] = checked(None, ge=1)
    video_max_pixels: Optional[int] = checked(None, ge=1)
    video_total_pixels: Optional[int] = checked(None, ge=1)
    packing: bool = False
    micro_batch_tokens: Optional[int] = checked(None, ge=1)
    balance: str = checked("cost", choices=BALANCE)
    system_prompt: Optional[str] = None
    min_pixels: Optional[int] = checked(None, ge=1)
    max_pixels: Optional[int] = checked(None, ge=1)
    checkpoint_every: int = checked(0, ge=0)
    async_save: bool = True
    eval_every: int = checked(0, ge=0)
    eval_batch_size: Optional[int] = checked(None, ge=1)
    resume_from: Optional[str] = None
    precision: str = checked("fp32", choices=POLICY_NAMES)
    tf32: bool = True
    activation_checkpointing: bool = False
    prefetch: bool = True
    data_workers: int = checked(0, ge=0)
    dataset_weights: Optional[dict] = None
    dataset_paths: Optional[dict] = None
    index_dir: Optional[str] = None
    tensorboard: bool = True
    mlflow: Optional[dict] = None
    wandb: Optional[dict] = None
    ray_report_logs: bool = False
    modules: Optional[dict] = None

    def __post_init__(self):
        self.validate(loop_key)

    def validate(self, name: Callable[[str], str] = None) -> None:
        """ConfigError (a ValueError) for the first value not accepted, naming each key with
        ``name(field)`` (default: ``train_loop_config.<field>``; the run file passes its dotted
        keys). Types are coerced first (``"1e-3"`` -> 0.001), as the run-file loader does."""
        name = name or loop_key
        for f in fields(self):
            if f.name not in _UNTYPED:
                setattr(self, f.name, coerce(getattr(self, f.name), f.type, name(f.name)))
        check_fields(self, name)
        for template, ok in self._cross_rules():
            if not ok:
                raise ConfigError.about(template, name)
        check_dataset_weights(self.dataset_weights, key=name("dataset_weights"))
        parse_tuning_named(self.modules, name)

    def _cross_rules(self) -> list:
        """``(message template, holds)`` for the rules that involve several keys."""
        return [
            (f"{{global_batch_size}}={self.global_batch_size} must be divisible by "
             f"{{micro_batches}}={self.micro_batches}.",
             self.global_batch_size % self.micro_batches == 0),
            ("{micro_batch_tokens}: set {micro_batches}=1 (the default) with it: the token budget "
             "decides how many micro-batches a step has.",
             self.micro_batch_tokens is None or self.micro_batches == 1),
            (f"{{min_pixels}}={self.min_pixels} > {{max_pixels}}={self.max_pixels}: the image "
             "area range is empty; lower min_pixels or raise max_pixels.",
             None in (self.min_pixels, self.max_pixels) or self.min_pixels <= self.max_pixels),
            (f"{{video_min_frames}}={self.video_min_frames} > {{video_max_frames}}="
             f"{self.video_max_frames}: the frame-count range is empty.",
             self.video_min_frames <= self.video_max_frames),
            (f"{{video_min_pixels}}={self.video_min_pixels} > {{video_max_pixels}}="
             f"{self.video_max_pixels}: the frame area range is empty.",
             None in (self.video_min_pixels, self.video_max_pixels)
             or self.video_min_pixels <= self.video_max_pixels),
            ("{system_prompt}: must not contain the '<image>' or '<video>' placeholder (images "
             "and videos belong to the records' user turns).",
             self.system_prompt is None
             or not any(p in self.system_prompt for p in ("<image>", "<video>"))),
        ]

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "TrainLoopConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for k in d:
            if k not in known:
                hint = difflib.get_close_matches(k, known, n=1)
                raise ConfigError(
                    f"train_loop_config: unknown key {k!r}"
                    + (f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {sorted(known)}")
                )
        return cls(**d)

    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.micro_batches

    def eval_batch(self) -> int:
        """Validation records per forward (`eval_batch_size`, default the micro-batch size)."""
        return self.eval_batch_size or self.micro_batch_size()

    def to_dict(self) -> dict:
        return asdict(self)


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
