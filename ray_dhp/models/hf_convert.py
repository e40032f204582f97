"""Model tensors a checkpoint stores *converted*, read one slice at a time.

transformers describes how a checkpoint's tensors become a model's with its conversion mapping
(`transformers.conversion_mapping`): renamings, and `WeightConverter`s whose operations merge,
concatenate or transpose tensors. `HFDirectory` applies the renamings itself; this module reads
the tensors of the converters that sharded loading can slice without reading anything a rank
does not keep:

* ``Transpose(d0, d1, check_dims=True)`` (``qwen3_vl_moe``: the Hub's Qwen3-VL-MoE checkpoints
  store the fused experts as ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``, the
  transformers 5 modules hold ``[E, 2I, H]`` / ``[E, H, I]``): the slice is read with the two dims
  swapped and transposed; a tensor already in the model's shape is read as it is (what
  ``check_dims`` means, and what ``save_pretrained`` writes);
* ``MergeModulelist(dim=0)`` then optionally ``Concatenate(dim=1)`` (per-expert checkpoints,
  ``mlp.experts.{i}.gate_proj.weight`` / ``up_proj`` / ``down_proj``): a slice of the fused
  ``[E, ...]`` tensor reads only its experts' tensors, and of each only the rows in the slice.

A fused-expert family also accepts per-expert checkpoints with the mapping transformers gives
the per-expert families of the same experts (`PER_EXPERT`: Qwen3-MoE's, ``qwen2_moe``), so a
checkpoint exported expert by expert loads too. Any other converter is refused by the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# fused-expert model types -> the transformers mapping of their per-expert checkpoint names
PER_EXPERT = {"qwen3_vl_moe": "qwen2_moe"}


class Unsupported(ValueError):
    """A converter whose result cannot be read slice by slice."""


@dataclass
class Converted:
    """One model tensor built from checkpoint tensors by one `WeightConverter`.

    ``parts``: per source pattern, the checkpoint keys (one for a transpose; one per expert,
    expert order, for a merge); ``shapes``: the checkpoint's header shapes."""

    name: str
    parts: list
    shapes: dict
    transpose: tuple = ()  # (d0, d1) to swap (Transpose); () when stored as the model holds it
    cat_dim: int = -1      # merged experts: the fused dim the patterns are concatenated on (-1: one tensor)

    @property
    def keys(self) -> list:
        return [k for keys in self.parts for k in keys]

    @property
    def shape(self) -> tuple:
        if self.cat_dim < 0:
            s = list(self.shapes[self.parts[0][0]])
            if self.transpose:
                d0, d1 = self.transpose
                s[d0], s[d1] = s[d1], s[d0]
            return tuple(s)
        return self._merged_shape()

    def _merged_shape(self) -> tuple:
        first = self.shapes[self.parts[0][0]]
        rows = sum(self.shapes[keys[0]][0] for keys in self.parts)
        if len(self.parts) == 1:
            return (len(self.parts[0]), *first)
        return (len(self.parts[0]), rows, *first[1:])

    def read(self, open_file, slices: tuple) -> torch.Tensor:
        """The slice ``slices`` of the model tensor (``open_file(key)``: a safetensors handle)."""
        slices = slices or tuple(slice(0, n) for n in self.shape)
        if self.cat_dim < 0:
            key = self.keys[0]
            if not self.transpose:
                return open_file(key).get_slice(key)[slices]
            d0, d1 = self.transpose
            swapped = list(slices)
            swapped[d0], swapped[d1] = slices[d1], slices[d0]
            return open_file(key).get_slice(key)[tuple(swapped)].transpose(d0, d1)
        experts, rows, rest = slices[0], slices[1], tuple(slices[2:])
        out = []
        for e in range(experts.start, experts.stop):
            pieces, offset = [], 0
            for keys in self.parts:
                key = keys[e]
                n = self.shapes[key][0]
                lo, hi = max(rows.start, offset), min(rows.stop, offset + n)
                if lo < hi:
                    pieces.append(open_file(key).get_slice(key)[(slice(lo - offset, hi - offset), *rest)])
                offset += n
            out.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        return torch.stack(out)


def converter_sources(converter) -> list:
    """The converter's source patterns as regexes (``*``: an expert index, captured)."""
    return [re.compile(re.escape(p).replace(r"\*", r"(\d+)")) for p in converter.source_patterns]


def build(name: str, converter, keys: list, shapes: dict, model_shape: tuple) -> Converted:
    """The `Converted` tensor ``name`` from the checkpoint ``keys`` that ``converter`` maps to it
    (raises `Unsupported` for operations other than the module docstring's)."""
    ops = [type(op).__name__ for op in converter.operations]
    if ops == ["Transpose"]:
        op = converter.operations[0]
        if len(keys) != 1:
            raise Unsupported(f"{name}: a transpose of {len(keys)} tensors")
        stored = tuple(shapes[keys[0]])
        swap = () if (op.check_dims and stored == tuple(model_shape)) else (op.dim0, op.dim1)
        return Converted(name, [list(keys)], shapes, transpose=swap)
    merge = ops[:1] == ["MergeModulelist"] and converter.operations[0].dim == 0
    if not merge or ops[1:] not in ([], ["Concatenate"]) or \
            (ops[1:] and converter.operations[1].dim != 1):
        raise Unsupported(f"{name}: operations {ops}")
    patterns = converter_sources(converter)
    parts = []
    for pat in patterns:
        found = {}
        for k in keys:
            m = pat.search(k)
            if m:
                found[int(m.group(1))] = k
        if sorted(found) != list(range(len(found))) or not found:
            raise Unsupported(f"{name}: experts {sorted(found)[:8]} of {pat.pattern} are not 0..n-1")
        parts.append([found[i] for i in range(len(found))])
    if len({len(p) for p in parts}) != 1:
        raise Unsupported(f"{name}: the patterns {converter.source_patterns} have unequal experts")
    for keys in parts:
        odd = [k for k in keys if tuple(shapes[k]) != tuple(shapes[keys[0]])]
        if odd:
            raise Unsupported(f"{name}: {odd[0]} has shape {list(shapes[odd[0]])}, {keys[0]} "
                              f"{list(shapes[keys[0]])}")
    return Converted(name, parts, shapes, cat_dim=1 if len(parts) > 1 else 0)


def extra_converters(model) -> list:
    """transformers' per-expert converters for a fused-expert model (`PER_EXPERT`), else []."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    other = PER_EXPERT.get(getattr(model.config, "model_type", None))
    mapping = get_checkpoint_conversion_mapping(other) if other else None
    return [m for m in mapping or [] if isinstance(m, WeightConverter)]
