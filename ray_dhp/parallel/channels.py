"""Head-sharded token mixers whose fused channels are not laid out per head (DTensor styles).

A column-parallel split of a fused projection is only right when its output channels are
grouped by head. Some mixers concatenate *kinds* of channels instead: a linear-attention block
projects ``[q (all heads) | k (all heads) | v (all heads)]`` in one matrix, runs a depthwise
causal convolution over those concatenated channels and then splits them. The rank that owns
heads ``h`` needs channels ``q_h | k_h | v_h``, one piece of every *segment*, not one contiguous
block. `RankChannels` gives each TP rank exactly those channels:

* ``gather_outputs`` ({child linear: segments}): the child stays column-parallel (a contiguous
  ``Shard(0)`` weight, loaded and checkpointed like any other), its local output columns are
  all-gathered along the last dim and the rank keeps its piece of every segment. Forward
  all-gather, backward reduce-scatter (`_segment_pieces`: the kept channels' gradient is a
  partial sum over the ranks, zero outside the rank's pieces).
* ``params`` ({parameter path: segments}): a small replicated parameter (a depthwise conv
  weight, per-head decay terms) of which the forward sees only this rank's pieces along dim 0
  (a differentiable index, so its gradient is partial: the family lists it among its
  ``tp_partial_grad_suffixes``, all-reduced over TP like the per-head norms). The view is put
  in the owning module's ``__dict__`` for the length of the styled module's forward, where it
  shadows the registered parameter; non-reentrant activation checkpointing re-runs the hooks.
* ``attrs`` ({attribute: None}): module attributes holding global widths (``key_dim``) divided
  by the TP degree, so the module's own reshapes and splits see local widths.

Example (the plan entry of a Gated DeltaNet block, key width K, value width V)::

    "layers.*.linear_attn": RankChannels(gather_outputs={"in_proj_qkv": (K, K, V)},
                                         params={"conv1d.weight": (K, K, V)},
                                         attrs=("key_dim", "value_dim", "conv_dim"))
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = ["RankChannels", "segment_index", "Styles"]


def segment_index(segments: tuple, tp: int, rank: int) -> torch.Tensor:
    """Channel ids of ``rank``'s piece of every segment (each segment split into ``tp`` equal
    contiguous pieces), in segment order."""
    out, offset = [], 0
    for size in segments:
        if size % tp:
            raise ValueError(f"segment of {size} channels is not divisible by tensor_parallel={tp}")
        piece = size // tp
        out.append(torch.arange(offset + rank * piece, offset + (rank + 1) * piece))
        offset += size
    return torch.cat(out)


def _segment_pieces(local_cols: torch.Tensor, mesh, index: torch.Tensor) -> torch.Tensor:
    """All-gather the column shards ``[..., C / tp]`` to ``[..., C]`` and keep ``index``. The
    gathered tensor's gradient is partial on each rank (nonzero only at its own channels), so
    its backward is a reduce-scatter back to the column shards."""
    full = DTensor.from_local(local_cols, mesh, [Shard(local_cols.dim() - 1)], run_check=False)
    full = full.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    return full.index_select(-1, index.to(full.device))


class RankChannels(ParallelStyle):
    """This TP rank's channels of a mixer whose fused channels are segmented by kind (see the
    module docstring); apply after the children's column/row-parallel styles."""

    shards_parameters = False  # the module's own parameters stay whole (`ray_dhp.planning.memory`)

    def __init__(self, gather_outputs: dict = None, params: dict = None, attrs: tuple = ()):
        super().__init__()
        self.gather_outputs, self.params = dict(gather_outputs or {}), dict(params or {})
        self.attrs = tuple(attrs)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        for path, segments in self.gather_outputs.items():
            index = segment_index(segments, tp, rank)
            module.get_submodule(path).register_forward_hook(
                lambda _m, _a, out, index=index: _segment_pieces(_local(out), device_mesh, index))
        shadows = []
        for path, segments in self.params.items():
            owner_path, _, leaf = path.rpartition(".")
            owner = module.get_submodule(owner_path)
            if leaf not in owner._parameters:
                raise ValueError(f"RankChannels: {type(module).__name__}.{path} is not a parameter")
            shadows.append((owner, leaf, segment_index(segments, tp, rank)))
        for attr in self.attrs:
            value = getattr(module, attr)
            if value % tp:
                raise ValueError(f"RankChannels: {type(module).__name__}.{attr}={value} is not "
                                 f"divisible by tensor_parallel={tp}")
            setattr(module, attr, value // tp)
        if shadows:
            module.register_forward_pre_hook(lambda _m, _a: _shadow(shadows))
            module.register_forward_hook(lambda *_: _unshadow(shadows), always_call=True)
        return module


def _shadow(shadows: list) -> None:
    for owner, leaf, index in shadows:
        p = owner._parameters[leaf]
        owner.__dict__[leaf] = p.index_select(0, index.to(p.device))


def _unshadow(shadows: list) -> None:
    for owner, leaf, _ in shadows:
        owner.__dict__.pop(leaf, None)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class Styles(ParallelStyle):
    """Several styles on one module path, applied in order (a plan maps each path to one style)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module
