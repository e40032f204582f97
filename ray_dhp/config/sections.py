"""The sections of the default loop's configuration: one dataclass per run-file section.

`ray_dhp.config.train_loop.TrainLoopConfig` is the tree of these (``optim``, ``precision``,
``data`` with its ``video``, ``processor``, ``checkpoint``, ``tracking``); each part of the loop receives only its
own section (`ray_dhp.step.optim.build_optimizer` takes ``cfg.optim``, the sampler ``cfg.data``
and ``cfg.optim``...). The run file's sections are these classes (`ray_dhp.run_sections` adds the
keys only a file has, such as ``data.train``), so defaults, help strings (each class's ``Args:``)
and checks have one source. Each section validates itself (`Section.validate`); its messages
name keys as ``{field}`` templates that the tree renders as the user wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from ray_dhp.config.checks import ConfigError, check_fields, checked, coerce, keyed
from ray_dhp.config.tuning import parse_tuning_named

__all__ = ["Section", "OptimConfig", "PrecisionConfig", "ProcessorConfig", "CheckpointConfig", "TrackingConfig",
           "subsection", "LR_SCHEDULES", "POLICY_NAMES", "BALANCE"]

LR_SCHEDULES = ("constant", "cosine", "linear")
POLICY_NAMES = ("fp32", "bf16_autocast", "bf16_mixed", "bf16")  # `ray_dhp.step.precision.POLICIES`
BALANCE = ("cost", "count")  # = ray_dhp.parallel.balance.BALANCE_MODES


def subsection(cls, help: str):
    """A nested section field of type ``cls`` (default ``cls()``), e.g. ``data.video``."""
    return field(default_factory=cls, metadata={"section": cls, "help": help})


class Section:
    """Base of a configuration section.

    `validate` coerces each value to its annotated type (``"1e-3"`` -> 0.001), checks it against
    its declared `ray_dhp.config.checks.Check`, then the section's `rules` (several keys at
    once), then its nested sections. A `ConfigError` names keys through ``name`` (default: the
    field's own name; the tree passes the names the user wrote).
    """

    _untyped: tuple = ()  # fields taken as given (a path or a ray.train.Checkpoint)

    def rules(self) -> list:
        """``(message template, holds)`` for the rules that involve several keys."""
        return []

    def validate(self, name=str) -> None:
        try:
            self._validate()
        except ConfigError as e:
            raise e.renamed(name) from None

    def _validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                try:
                    value._validate()
                except ConfigError as e:
                    raise e.under(f.name) from None
            elif f.name not in self._untyped:
                with keyed(f.name) as key:
                    setattr(self, f.name, coerce(value, f.type, key))
        check_fields(self, str)
        for template, ok in self.rules():
            if not ok:
                raise ConfigError.about(template, str)


@dataclass
class OptimConfig(Section):
    """Optimizer and loop hyper-parameters.

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
        micro_batch_tokens: cut each step into micro-batches by tokens instead of by count: in
            order, as many samples as keep every text replica's share within this many tokens
            (image placeholders included); the number of micro-batches then varies per step,
            the update does not. Requires micro_batches=1.
        balance: how a step's samples are shared out: "cost" (default) gives every vision
            replica, text replica, micro-batch and decode owner an even share of the work by a
            per-sample cost model (vision: patches, full attention ~ patches² per image; text:
            tokens incl. image placeholders, attention ~ tokens²), so mixed resolutions do not
            leave replicas waiting, and a text replica that pads runs its samples as padded
            groups of similar length; "count" splits into contiguous equal counts, one padded
            batch per text replica. The update is the same either way (each sample is
            computed once).
        activation_checkpointing: recompute transformer blocks in backward.
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
    micro_batch_tokens: Optional[int] = checked(None, ge=1)
    balance: str = checked("cost", choices=BALANCE)
    activation_checkpointing: bool = False
    modules: Optional[dict] = None

    def rules(self) -> list:
        parse_tuning_named(self.modules, str)  # raises with its own messages
        return [
            (f"{{global_batch_size}}={self.global_batch_size} must be divisible by "
             f"{{micro_batches}}={self.micro_batches}.",
             self.global_batch_size % self.micro_batches == 0),
            ("{micro_batch_tokens}: set {micro_batches}=1 (the default) with it: the token budget "
             "decides how many micro-batches a step has.",
             self.micro_batch_tokens is None or self.micro_batches == 1),
        ]

    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.micro_batches


@dataclass
class PrecisionConfig(Section):
    """Numerics of the step: the precision policy of weights, gradients, optimizer state and
    matmuls, and TF32. A policy name alone stands for the section (``precision: bf16`` in a
    run file, ``train_loop_config["precision"] = "bf16"`` from Python).

    Args:
        policy: the precision policy (`ray_dhp.step.precision`): "fp32" (fp32 weights, grads and
            AdamW state: 16 B/param), "bf16_autocast" (the same state, matmuls under bf16
            autocast), "bf16_mixed" (bf16 weights, gradients accumulated in fp32, fp32 master
            weights and AdamW moments that the optimizer steps; 18 B/param, half-size weights
            and activations; checkpoints hold the masters) or "bf16" (bf16 weights and
            moments, gradients accumulated in fp32, no masters: 10 B/param).
        tf32: TF32 for fp32 matmuls and convolutions on CUDA (`ray_dhp.step.gpu`; ignored on
            CPU). Matters for the fp32 and bf16_autocast policies' fp32 matmuls.
    """

    policy: str = checked("fp32", choices=POLICY_NAMES)
    tf32: bool = True


@dataclass
class ProcessorConfig(Section):
    """The processor (tokenizer + image processor; the prompt is rendered with its chat
    template).

    Args:
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
    """

    system_prompt: Optional[str] = None
    min_pixels: Optional[int] = checked(None, ge=1)
    max_pixels: Optional[int] = checked(None, ge=1)

    def rules(self) -> list:
        return [
            (f"{{min_pixels}}={self.min_pixels} > {{max_pixels}}={self.max_pixels}: the image "
             "area range is empty; lower min_pixels or raise max_pixels.",
             None in (self.min_pixels, self.max_pixels) or self.min_pixels <= self.max_pixels),
            ("{system_prompt}: must not contain the '<image>' or '<video>' placeholder (images "
             "and videos belong to the records' user turns).",
             self.system_prompt is None
             or not any(p in self.system_prompt for p in ("<image>", "<video>"))),
        ]


@dataclass
class CheckpointConfig(Section):
    """Checkpointing.

    Args:
        checkpoint_every: steps between checkpoints (0 = only at the end).
        async_save: write checkpoints in the background (default): a save point holds the step
            only while this rank's state is copied into host buffers (pinned on GPU; one copy of
            the rank's checkpoint state, kept for the run: ``ray-dhp plan`` shows it), the write
            (checksummed, fsynced) runs in a thread, and the checkpoint is reported to Ray Train
            once it is durable on every rank (`ray_dhp.train.checkpoint_reports`). False: write
            inside the step (no extra host memory; the step waits for the whole write).
        resume_from: checkpoint to start from when the run has none of its own yet: a path (one
            checkpoint, or a folder of them) or a ``ray.train.Checkpoint``; any layout.
    """

    _untyped = ("resume_from",)

    checkpoint_every: int = checked(0, ge=0)
    async_save: bool = True
    resume_from: Optional[str] = None


@dataclass
class TrackingConfig(Section):
    """Experiment tracking (TensorBoard, MLflow, W&B) and console output.

    Args:
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
    """

    tensorboard: bool = True
    mlflow: Optional[dict] = None
    wandb: Optional[dict] = None
    ray_report_logs: bool = False
