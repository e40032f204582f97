"""Tensor parallelism for the language model: DTensor plans applied from outside the model.

Plans are plain data (module path with ``*`` wildcards -> ``ParallelStyle``) kept next to each
model family; this module only applies them and fixes up what DTensor cannot know.
"""

from __future__ import annotations

import fnmatch

import torch
from torch.distributed.tensor import DTensor


def apply_tp_plan(model: torch.nn.Module, tp_mesh, plan: dict) -> None:
    """Apply ``plan`` over the 1-D ``tp_mesh``; every pattern must match at least one module.

    Tied parameters (one Parameter registered on several modules, e.g. the input embedding and
    ``lm_head`` of a ``tie_word_embeddings`` model) stay tied: ``parallelize_module`` gives each
    module its own new DTensor Parameter, so the first registration's is put back on the others
    (`tied_registrations`, `retie`) and the gradient stays the sum of both uses, as in the model.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    names = [n for n, _ in model.named_modules()]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"TP plan entry {pattern!r} matches no module of {type(model).__name__}")
    tied = tied_registrations(model)
    parallelize_module(model, tp_mesh, plan)
    retie(tied)


def tied_registrations(model: torch.nn.Module) -> list:
    """``[(module, attribute, name), ...]`` per parameter registered in more than one place."""
    places: dict = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for leaf, p in mod._parameters.items():
            if p is not None and (mod, leaf) not in [(m, a) for m, a, _ in places.get(id(p), [])]:
                places.setdefault(id(p), []).append((mod, leaf, f"{mname}.{leaf}" if mname else leaf))
    return [group for group in places.values() if len(group) > 1]


def retie(groups: list) -> None:
    """Register each group's first parameter in all of its places. The plan must have laid the
    tied places out alike (same DTensor placements): a weight shared by a vocab-parallel
    embedding (``Shard(0)`` rows) and a column-parallel head (``Shard(0)`` output rows) is one
    sharded tensor; any other pairing has no single layout and is refused."""
    for group in groups:
        mod0, leaf0, name0 = group[0]
        keep = mod0._parameters[leaf0]
        for mod, leaf, name in group[1:]:
            p = mod._parameters[leaf]
            if p is keep:
                continue
            if _layout(p) != _layout(keep):
                raise ValueError(
                    f"tied parameters {name0} and {name} are laid out differently by the TP plan "
                    f"({_layout(keep)} vs {_layout(p)}); a tied weight needs one layout: give both "
                    f"modules plan entries that shard it alike (e.g. a vocab-parallel embedding and "
                    f"a column-parallel head), or untie them in the model's config.")
            mod._parameters[leaf] = keep


def _layout(p: torch.Tensor) -> tuple:
    placements = tuple(p.placements) if isinstance(p, DTensor) else None
    return tuple(p.shape), p.dtype, placements


def is_sharded(p: torch.Tensor) -> bool:
    """True for a DTensor with a Shard placement (each TP rank holds a distinct piece)."""
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (same storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def partial_grad_params(model: torch.nn.Module, suffixes: tuple) -> list:
    """Parameters whose TP-rank gradients are partial sums (see FamilySpec.tp_partial_grad_suffixes)."""
    return [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(tuple(suffixes))]
