"""What a room of the loop reads where it reads across sections: the step engine
(`StepConfig`) and the step sampler (`SamplerConfig`). Each is built from the tree
(`ray_dhp.config.train_loop.TrainLoopConfig.step_config` / ``sampler_config``) or directly from
its sections, and holds nothing else, so the engine and the sampler never see the whole tree.

Example:
    >>> from ray_dhp.config.data_section import DataConfig
    >>> cfg = StepConfig(OptimConfig(lr=3e-4), packing=True)
    >>> cfg.optim.lr, cfg.packing, cfg.max_tokens
    (0.0003, True, None)
    >>> SamplerConfig.of(DataConfig(), OptimConfig(global_batch_size=8, micro_batches=2)).micro_batch_size
    4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ray_dhp.config.data_section import DataConfig
from ray_dhp.config.sections import OptimConfig, PrecisionConfig

__all__ = ["StepConfig", "SamplerConfig"]

# the ``optim`` keys that shape a step's batch: what the sampler reads of that section
BATCH_KEYS = ("seed", "global_batch_size", "micro_batches", "micro_batch_tokens", "balance")
_OPTIM = OptimConfig()  # the defaults below are the section's


@dataclass(frozen=True)
class StepConfig:
    """What the step engine (`ray_dhp.step.engine.DHPEngine`) reads: the ``optim`` and
    ``precision`` sections, and from ``data`` how text rows are made: ``packing`` (several
    samples per row) and ``max_tokens`` (a packed row's length)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    packing: bool = False
    max_tokens: Optional[int] = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    @classmethod
    def of(cls, optim: OptimConfig, data: DataConfig,
           precision: Optional[PrecisionConfig] = None) -> "StepConfig":
        return cls(optim, packing=data.packing, max_tokens=data.max_tokens,
                   precision=precision or PrecisionConfig())


@dataclass(frozen=True)
class SamplerConfig:
    """What the step sampler (`ray_dhp.data.sampler.StepSampler`) and its loaders read: the
    ``data`` section (limits, bad data, workers, evaluation batch) and, from ``optim``, the
    step's batch (`BATCH_KEYS`: the seed of the data order, the global batch, its micro-batches
    by count or by tokens, the balancing)."""

    data: DataConfig = field(default_factory=DataConfig)
    seed: int = _OPTIM.seed
    global_batch_size: int = _OPTIM.global_batch_size
    micro_batches: int = _OPTIM.micro_batches
    micro_batch_tokens: Optional[int] = _OPTIM.micro_batch_tokens
    balance: str = _OPTIM.balance

    @classmethod
    def of(cls, data: DataConfig, optim: OptimConfig) -> "SamplerConfig":
        return cls(data, **{k: getattr(optim, k) for k in BATCH_KEYS})

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.micro_batches

    def eval_batch(self) -> int:
        """Validation records per forward (``data.eval_batch_size``, default the micro-batch
        size)."""
        return self.data.eval_batch_size or self.micro_batch_size
