"""`train_loop_config` of the default VLM loop: one tree of sections (`TrainLoopConfig`).

The tree's sections are the run file's: ``optim``, ``precision``, ``data`` (with ``data.video``),
``processor``, ``checkpoint``, ``tracking`` (`ray_dhp.config.sections`,
`ray_dhp.config.data_section`); each part of the loop receives its own section.

From Python, ``train_loop_config`` takes the flat keys it always took (``lr``, ``packing``,
``video_fps``...), each mapped to its place in the tree by `FLAT_KEYS` (the one mapping), or
sections (``{"optim": {"lr": 3e-4}}``), or both. Messages name a key as the user wrote it:
``train_loop_config.lr`` for a flat key, ``train_loop_config.optim.lr`` for a nested one; the
run file names it by its path (``optim.lr``).

Example:
    >>> cfg = TrainLoopConfig(lr=3e-4, packing=True, video_fps=1.0)
    >>> cfg.optim.lr, cfg.data.packing, cfg.data.video.fps
    (0.0003, True, 1.0)
    >>> TrainLoopConfig.from_dict({"optim": {"lr": 3e-4}}).optim.lr
    0.0003
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable, Optional

from ray_dhp.config.checks import ConfigError
from ray_dhp.config.data_section import DataConfig, check_dataset_weights
from ray_dhp.config.sections import (CheckpointConfig, OptimConfig, PrecisionConfig,
                                     ProcessorConfig, Section, TrackingConfig)
from ray_dhp.config.views import SamplerConfig, StepConfig

__all__ = ["TrainLoopConfig", "FLAT_KEYS", "loop_key", "check_dataset_weights"]  # + the sections:
# `ray_dhp.config.sections`, `ray_dhp.config.data_section`


def _paths(section: str, names: str, prefix: str = "", sub: str = "") -> dict:
    where = f"{section}.{sub}." if sub else f"{section}."
    return {prefix + n: where + n for n in names.split()}


# The Python API's flat keys -> their path in the tree (the one mapping; a test checks that it
# covers every key of the tree exactly once).
FLAT_KEYS = {
    **_paths("optim", "lr global_batch_size num_steps seed log_every max_grad_norm micro_batches "
                      "lr_schedule warmup_steps weight_decay betas eps micro_batch_tokens balance "
                      "activation_checkpointing modules"),
    "precision": "precision.policy", **_paths("precision", "tf32"),
    **_paths("data", "data_root max_tokens packing bad_data dataset_weights prefetch data_workers "
                     "max_text_chars max_image_pixels max_bad_fraction eval_every eval_batch_size "
                     "index_dir dataset_paths"),
    **_paths("data", "fps min_frames max_frames min_pixels max_pixels total_pixels",
             prefix="video_", sub="video"),
    **_paths("processor", "system_prompt min_pixels max_pixels"),
    **_paths("checkpoint", "checkpoint_every async_save resume_from"),
    **_paths("tracking", "tensorboard mlflow wandb ray_report_logs"),
}
FLAT_OF = {path: flat for flat, path in FLAT_KEYS.items()}


def loop_key(key: str) -> str:
    """How the Python API names a key in messages: ``train_loop_config.lr`` for ``lr`` or its
    path ``optim.lr``."""
    return f"train_loop_config.{FLAT_OF.get(key, key)}"


def _section(cls, value, where: str):
    """A section ``cls`` from a mapping (strictly: unknown keys are errors naming ``where``), or
    a copy of a ``cls`` (so that flat keys set on it leave the caller's object alone)."""
    if isinstance(value, cls):
        return replace(value, **{f.name: _section(type(v), v, "")
                                 for f in fields(value) if isinstance(v := getattr(value, f.name),
                                                                      Section)})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {value!r}.")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for k, v in value.items():
        if k not in known:
            hint = difflib.get_close_matches(str(k), list(known), n=1)
            raise ConfigError(f"{where}: unknown key {k!r}"
                              + (f"; did you mean {hint[0]!r}?" if hint
                                 else f"; known keys: {sorted(known)}"))
        sub = known[k].metadata.get("section")
        kwargs[k] = _section(sub, v, f"{where}.{k}") if sub else v
    return cls(**kwargs)


def _field(cls, help: str, shorthand: Optional[str] = None):
    """A section of the tree; a scalar given for it stands for its ``shorthand`` field."""
    return field(default_factory=cls, metadata={"section": cls, "help": help,
                                                "shorthand": shorthand})


@dataclass(init=False)
class TrainLoopConfig:
    """Hyper-parameters of the default loop (``train_loop_config``), one section per part.

    Args:
        optim: `OptimConfig`: AdamW, its schedule, the batch and step, activation
            checkpointing, per-module choices.
        precision: `PrecisionConfig`: the precision policy and TF32 (a policy name alone:
            ``precision="bf16"``).
        data: `DataConfig`: reading, limits, packing, evaluation, video (`VideoConfig`).
        processor: `ProcessorConfig`: the system prompt and the image area range.
        checkpoint: `CheckpointConfig`: when and how checkpoints are written, where to resume.
        tracking: `TrackingConfig`: TensorBoard, MLflow, W&B and console output.
        **flat: the flat keys of `FLAT_KEYS` (``lr=3e-4``), set over the sections.
    """

    optim: OptimConfig = _field(OptimConfig, "optimizer and loop hyper-parameters")
    precision: PrecisionConfig = _field(PrecisionConfig, "precision policy and TF32",
                                        shorthand="policy")
    data: DataConfig = _field(DataConfig, "training data")
    processor: ProcessorConfig = _field(ProcessorConfig, "processor settings")
    checkpoint: CheckpointConfig = _field(CheckpointConfig, "checkpointing")
    tracking: TrackingConfig = _field(TrackingConfig, "experiment tracking")

    def __init__(self, optim=None, precision=None, data=None, processor=None, checkpoint=None,
                 tracking=None, **flat):
        given = dict(optim=optim, precision=precision, data=data, processor=processor,
                     checkpoint=checkpoint, tracking=tracking)
        for f in fields(self):
            cls, value = f.metadata["section"], given[f.name]
            short = f.metadata.get("shorthand")
            if short and value is not None and not isinstance(value, (dict, cls)):
                value = {short: value}  # ``precision="bf16"``: the flat key of that field
            setattr(self, f.name, cls() if value is None
                    else _section(cls, value, f"train_loop_config.{f.name}"))
        for key, value in flat.items():
            if key not in FLAT_KEYS:
                known = list(FLAT_KEYS) + [f.name for f in fields(self)]
                hint = difflib.get_close_matches(key, known, n=1)
                raise ConfigError(f"train_loop_config: unknown key {key!r}"
                                  + (f"; did you mean {hint[0]!r}?" if hint
                                     else f"; known keys: {sorted(known)}"))
            *path, last = FLAT_KEYS[key].split(".")
            node = self
            for part in path:
                node = getattr(node, part)
            setattr(node, last, value)
        nested = {f.name for f in fields(self) if isinstance(given[f.name], dict)}
        # how the user wrote each key: flat, else in a section given as a mapping, else flat
        self._names = {path: f"train_loop_config.{path}" for path in FLAT_OF
                       if path.split(".")[0] in nested and FLAT_OF[path] not in flat}
        self.validate()

    def validate(self, name: Optional[Callable[[str], str]] = None) -> None:
        """ConfigError (a ValueError) for the first value not accepted, naming each key with
        ``name(path)`` (``path``: ``optim.lr``; default: as the user wrote it,
        ``train_loop_config.lr`` or ``train_loop_config.optim.lr``; the run file names paths
        as they are). Types are coerced first (``"1e-3"`` -> 0.001)."""
        name = name or self.key
        for f in fields(self):
            try:
                getattr(self, f.name)._validate()
            except ConfigError as e:
                raise e.under(f.name).renamed(name) from None

    def key(self, key: str) -> str:
        """How messages name a key (its path ``data.packing`` or flat name ``packing``): as the
        user wrote it, ``train_loop_config.packing`` or ``train_loop_config.data.packing``."""
        path = FLAT_KEYS.get(key, key)
        return getattr(self, "_names", {}).get(path) or loop_key(path)

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "TrainLoopConfig":
        """From ``train_loop_config``: flat keys, sections, or both (see the module docstring)."""
        return cls(**dict(d or {}))

    def eval_batch(self) -> int:
        """Validation records per forward (`data.eval_batch_size`, default the micro-batch
        size)."""
        return self.sampler_config().eval_batch()

    def step_config(self) -> StepConfig:
        """What the step engine reads (`StepConfig`: ``optim``, ``precision``, ``data.packing`` /
        ``max_tokens``)."""
        return StepConfig.of(self.optim, self.data, self.precision)

    def sampler_config(self) -> SamplerConfig:
        """What the step sampler reads (`SamplerConfig`: ``data`` and the batch keys of ``optim``)."""
        return SamplerConfig.of(self.data, self.optim)

    def to_dict(self) -> dict:
        """The tree as nested plain dicts (``{"optim": {"lr": ...}, ...}``)."""
        return asdict(self)

    def to_flat_dict(self) -> dict:
        """Every key by its Python API name (``{"lr": ...}``, `FLAT_KEYS`): how trackers name
        the run's parameters."""
        out = {}
        for flat, path in FLAT_KEYS.items():
            node = self
            for part in path.split("."):
                node = getattr(node, part)
            out[flat] = node
        return out
