"""Tensor parallelism for the language model: DTensor plans applied from outside the model.

Plans are plain data (module path with ``*`` wildcards -> ``ParallelStyle``) kept next to each
model family; this module only applies them and fixes up what DTensor cannot know.
"""

from __future__ import annotations

import fnmatch

import torch
from torch.distributed.tensor import DTensor


def apply_tp_plan(model: torch.nn.Module, tp_mesh, plan: dict) -> None:
    """Apply ``plan`` over the 1-D ``tp_mesh``; every pattern must match at least one module."""
    from torch.distributed.tensor.parallel import parallelize_module

    names = [n for n, _ in model.named_modules()]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"TP plan entry {pattern!r} matches no module of {type(model).__name__}")
    parallelize_module(model, tp_mesh, plan)


def is_sharded(p: torch.Tensor) -> bool:
    """True for a DTensor with a Shard placement (each TP rank holds a distinct piece)."""
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (same storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def partial_grad_params(model: torch.nn.Module, suffixes: tuple) -> list:
    """Parameters whose TP-rank gradients are partial sums (see FamilySpec.tp_partial_grad_suffixes)."""
    return [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(tuple(suffixes))]
