"""ray_dhp: disaggregated hybrid parallelism for vision-language models on Ray Train.

Ulysses sequence parallelism for the vision encoder, Megatron-style tensor parallelism for the
language model, each module in its own worker group, inside one ``DisaggregatedTrainer.fit()``.
Imports are lazy: ``import ray_dhp`` has no side effects and does not import Ray or torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = [
    "DisaggregatedTrainer",
    "DHPConfig",
    "ModuleParallel",
    "TrainLoopConfig",
    "Topology",
    "get_context",
    "DHPEngine",
    "build_engine",
    "build_processor",
    "build_loader",
    "find_checkpoint",
    "load_checkpoint",
    "report",
    "report_checkpoint",
    "LossInputs",
    "cross_entropy_loss",
    "export_hf",
    "sweep",
    "metric_report_callback",
    "demo",
]

_LAZY = {
    "DisaggregatedTrainer": ("ray_dhp.train.trainer", "DisaggregatedTrainer"),
    "DHPConfig": ("ray_dhp.layout", "DHPConfig"),
    "ModuleParallel": ("ray_dhp.layout", "ModuleParallel"),
    "TrainLoopConfig": ("ray_dhp.config.train_loop", "TrainLoopConfig"),
    "Topology": ("ray_dhp.parallel.topology", "Topology"),
    "get_context": ("ray_dhp.train.backend", "get_context"),
    # building blocks of a custom train loop (docs/custom_loop.md)
    "DHPEngine": ("ray_dhp.step.engine", "DHPEngine"),
    "build_engine": ("ray_dhp.train.custom_loop", "build_engine"),
    "build_processor": ("ray_dhp.train.custom_loop", "build_processor"),
    "build_loader": ("ray_dhp.train.custom_loop", "build_loader"),
    "find_checkpoint": ("ray_dhp.train.custom_loop", "find_checkpoint"),
    "load_checkpoint": ("ray_dhp.train.custom_loop", "load_checkpoint"),
    "report": ("ray_dhp.train.custom_loop", "report"),
    "report_checkpoint": ("ray_dhp.train.custom_loop", "report_checkpoint"),
    "LossInputs": ("ray_dhp.step.loss", "LossInputs"),
    "cross_entropy_loss": ("ray_dhp.step.loss", "cross_entropy_loss"),
    "export_hf": ("ray_dhp.checkpointing.export", "export_hf"),
    # Ray Tune sweeps over run-file keys (docs/cluster.md)
    "sweep": ("ray_dhp.tune", "sweep"),
    "metric_report_callback": ("ray_dhp.tune", "metric_report_callback"),
    "demo": ("ray_dhp.demo", None),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'ray_dhp' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
