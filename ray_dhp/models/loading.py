"""Sharded construction: build on the meta device, materialise only what this rank keeps.

Every rank constructs the whole model on the ``meta`` device (no parameter memory; buffers such
as rotary ``inv_freq`` are real, computed by the model's own code), keeps the modules it hosts,
applies the tensor-parallel plan on meta (DTensor shards of meta tensors), and only then gives
each kept parameter real storage for its *local* shard, filled from one of two sources:

* a Hugging Face directory (`HFDirectory`): each tensor's local slice is read from its
  safetensors file and converted to the parameter dtype on the fly;
* random init from the seed (`InitRecord`): the reference's init is replayed one full
  parameter at a time and the local slice is kept, so the values are bit-identical to
  ``build_model`` (the single-process reference's model).

A rank therefore holds the parameters it keeps plus at most one full tensor at a time. On the
``meta`` device nothing is filled: the model then only reports its local shapes and bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ray_dhp.models.hf_dir import HFDirectory
from ray_dhp.models.meta_init import InitRecord, construct_recorded


@dataclass
class MetaModel:
    """A model constructed on the meta device, with where its weights come from."""

    module: torch.nn.Module
    seed: int
    init: InitRecord                      # the recorded random init (used without a directory)
    directory: Optional[HFDirectory] = None

    @property
    def source(self) -> str:
        return f"directory {self.directory.path}" if self.directory is not None else f"random init (seed {self.seed})"


def build_meta_model(model, *, seed: int = 0, dtype=None) -> MetaModel:
    """Construct ``model`` (a config or a local HF directory) on the meta device.

    The construction is the reference's (``cls._from_config(config, dtype=dtype)``, see
    `ray_dhp.models.build_model`); a directory's weights are indexed and checked against the
    config here (missing shards or tensors, wrong shapes or dtypes raise `CheckpointError`).
    """
    import transformers

    from ray_dhp.models import family_of, fp64_experts, load_model_config

    dtype = dtype or torch.float32
    if not dtype.is_floating_point:
        raise ValueError(f"model dtype {dtype} is not a floating-point dtype")
    config = load_model_config(model)
    if fp64_experts(config, dtype):
        config._experts_implementation = "eager"
    cls = getattr(transformers, family_of(config).model_class)
    module, record = construct_recorded(lambda: cls._from_config(config, dtype=dtype))
    directory = HFDirectory(model, module) if isinstance(model, (str, os.PathLike)) else None
    return MetaModel(module, seed, record, directory)


def check_model_directory(path) -> None:
    """Check a model directory's weights against its config.json from the safetensors headers
    only (nothing is loaded): raises `CheckpointError` naming the file / tensor for a missing
    shard, a missing tensor, a shape unlike the config's or a non-float dtype. Run by the driver
    (`DHPConfig`) so a bad directory fails before any worker starts."""
    build_meta_model(path)


def module_prefix(root: torch.nn.Module, sub: torch.nn.Module) -> str:
    """The parameter-name prefix of ``sub`` inside ``root`` (``""`` for the root itself)."""
    for name, m in root.named_modules():
        if m is sub:
            return f"{name}." if name else ""
    raise ValueError(f"{type(sub).__name__} is not a submodule of {type(root).__name__}")


@dataclass
class _Slot:
    """One kept parameter: where it is registered, its full names, and its local slice."""

    param: torch.nn.Parameter          # the meta parameter (maybe a DTensor)
    places: list                       # (module, attribute) holding it
    names: list                        # full-model names (several when tied)
    slices: tuple                      # local slice of the full tensor (() = all of it)
    local: Optional[torch.Tensor] = None


def _local_slices(p: torch.Tensor) -> tuple:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return ()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _slots(parts: dict) -> list:
    by_id: dict = {}
    for prefix, part in parts.items():
        for mname, mod in part.named_modules(remove_duplicate=False):
            for leaf, p in mod._parameters.items():
                if p is None:
                    continue
                slot = by_id.get(id(p))
                if slot is None:
                    slot = by_id[id(p)] = _Slot(p, [], [], _local_slices(p))
                if (mod, leaf) not in [(m, a) for m, a in slot.places]:
                    slot.places.append((mod, leaf))
                name = f"{prefix}{mname}.{leaf}" if mname else f"{prefix}{leaf}"
                if name not in slot.names:
                    slot.names.append(name)
    return list(by_id.values())


def materialize(meta: MetaModel, parts: dict, device, fill: bool = True) -> None:
    """Give the parameters of ``parts`` ({prefix in the full model: module}) real storage on
    ``device`` holding their local shards, filled from ``meta``'s source; move buffers there.

    On the ``meta`` device the shapes stay and nothing is filled. ``fill=False``: the storage is
    allocated as zeros, not filled (a checkpoint load fills it: no init is replayed, no weight read).
    """
    device = torch.device(device)
    slots = _slots(parts)
    if device.type == "meta":
        return
    for s in slots:
        shape = tuple(sl.stop - sl.start for sl in s.slices) if s.slices else tuple(s.param.shape)
        # unfilled: zeros, not garbage (the optimizer-state set-up before a load steps on these;
        # arbitrary bits can be denormals or NaN, which make that arithmetic slow)
        s.local = (torch.empty if fill else torch.zeros)(shape, dtype=s.param.dtype, device=device)
    if not fill:
        pass
    elif meta.directory is not None:
        for s in slots:
            meta.directory.read_into(s.names, s.slices, s.local)
    else:
        _fill_random(meta.init, meta.seed, slots)
    for s in slots:
        _install(s)
    for prefix, part in parts.items():
        _buffers_to(prefix, part, device, meta.directory)


def _fill_random(init: InitRecord, seed: int, slots: list) -> None:
    by_name = {n: s for s in slots for n in s.names}
    wanted = {st for st, names in init.names.items() if any(n in by_name for n in names)}
    known = {n for names in init.names.values() for n in names}
    unknown = [s.names[0] for s in slots if not any(n in known for n in s.names)]
    if unknown:
        raise ValueError(f"random init: no recorded init for {unknown[:3]}")

    def sink(names: list, full: torch.Tensor) -> None:
        for slot in {id(by_name[n]): by_name[n] for n in names if n in by_name}.values():
            slot.local.copy_(full[slot.slices] if slot.slices else full)

    init.replay(seed, wanted, sink)


def _install(s: _Slot) -> None:
    from torch.distributed.tensor import DTensor

    p = s.param
    value = s.local
    if isinstance(p, DTensor):
        value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
    new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    for mod, leaf in s.places:
        mod._parameters[leaf] = new


def _buffers_to(prefix: str, part: torch.nn.Module, device, directory: Optional[HFDirectory]) -> None:
    """Move ``part``'s buffers to ``device``; persistent ones the directory holds are loaded."""
    for mname, mod in part.named_modules():
        for leaf, b in mod._buffers.items():
            if b is None:
                continue
            name = f"{prefix}{mname}.{leaf}" if mname else f"{prefix}{leaf}"
            if directory is not None and name in directory.source:
                b = directory.read([name], (), b.dtype)
            mod._buffers[leaf] = b.to(device)


def local_parameter_bytes(*modules) -> int:
    """Bytes of the parameters a rank holds in ``modules`` (local shards of DTensors; each
    tensor once): what a meta-built engine reports without allocating anything."""
    from ray_dhp.parallel.tensor import local

    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                t = local(p)
                total += t.numel() * t.element_size()
    return total
