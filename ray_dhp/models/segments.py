"""Packed rows for token mixers that carry state along the sequence (a causal convolution, a
linear-attention recurrence): no state crosses a sample boundary.

A packed row holds several samples back to back. Attention keeps them apart through the mask
transformers builds from the packed position ids; a recurrent mixer (Gated DeltaNet: a short
causal conv1d, then the gated delta rule) would instead carry its conv window and its recurrent
state from one sample into the next. transformers' torch path of such a mixer has no sequence
boundaries (its kernel wrappers refuse ``cu_seqlens`` without the optimized packages), so
`SegmentRows` runs the mixer on **one row per segment**: before the mixer, the packed
``[R, L, C]`` input is laid out as ``[S, M, C]`` (segment ``s`` at the start of row ``s``, zero
after its end, ``M`` the longest segment); the mixer's own forward then starts every segment
from a zero conv window and a zero state, exactly as for the sample alone (right padding never
reaches earlier tokens of a causal mixer); before the mixer's per-token output projection, its
input is laid back out as the packed ``[R, L, C']``. The projection, its tensor-parallel
collectives and a sequence-parallel reduce-scatter therefore see the packed layout, as
without packing (the projections of a row are per token, so either layout computes the same).

The segments come as a forward keyword argument, `SEGMENTS_KWARG`: ``cu_seqlens`` ``[S + 1]``
(long) over the row-major flattened ``[R * L]`` tokens, the convention of varlen attention
(`ray_dhp.data.collate.pack_text_batch` returns it; every sample and every row's padded tail is
a segment, and segments never cross rows). A keyword argument travels with the call through
transformers' decoder layers and non-reentrant activation checkpointing's recomputation. A
forward without it (padded batches, the reference) is left untouched.

Which modules carry state, and which child projects their output, is a family fact
(`FamilySpec.stateful_mixers`); this module names no family.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ray_dhp.parallel.segments import SEGMENTS_KWARG, segment_rows_index

__all__ = ["SEGMENTS_KWARG", "SegmentRows", "install_segment_rows", "segment_rows_index"]


class SegmentRows:
    """Hooks that run ``mixer`` on one row per segment of a packed batch (module docstring);
    ``output``: its child that projects the mixed channels per token (e.g. ``out_proj``).
    ``required``: every call must bring the segments (a model that only ever sees packed rows),
    so a forward that stopped handing them down raises instead of mixing samples silently."""

    def __init__(self, mixer: nn.Module, output: nn.Module, required: bool = False):
        self.required = required
        self._packed_shape: Optional[tuple] = None
        self._to_packed: Optional[torch.Tensor] = None
        mixer.register_forward_pre_hook(self._before_mixer, with_kwargs=True)
        mixer.register_forward_hook(self._after_mixer, always_call=True)
        # prepend: before the output's own (tensor-parallel) input hooks, which then see the
        # packed layout exactly as without packing
        output.register_forward_pre_hook(self._before_output, prepend=True)

    def _before_mixer(self, module, args, kwargs):
        cu = kwargs.pop(SEGMENTS_KWARG, None)
        if cu is None and self.required:
            raise RuntimeError(f"{type(module).__name__} was called without {SEGMENTS_KWARG!r}: the "
                               "model's forward no longer hands its keyword arguments down to "
                               "this layer, so packed samples would share its state")
        if cu is None:
            return args, kwargs
        if kwargs.get("attention_mask") is not None:
            raise ValueError(f"{type(module).__name__}: packed rows take no padding mask (the "
                             f"segments replace it), got an attention_mask")
        positional = "hidden_states" not in kwargs
        x = args[0] if positional else kwargs["hidden_states"]
        rows, length, width = x.shape
        to_rows, to_packed = segment_rows_index(cu)
        if int(to_packed.numel()) != rows * length:
            raise ValueError(f"{SEGMENTS_KWARG} cover {to_packed.numel()} tokens, the mixer's input "
                             f"has {rows} x {length}")
        flat = torch.cat([x.reshape(rows * length, width), x.new_zeros(1, width)])
        segs = flat.index_select(0, to_rows.to(x.device).reshape(-1)).view(*to_rows.shape, width)
        self._packed_shape, self._to_packed = (rows, length), to_packed.to(x.device)
        if positional:
            return (segs, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": segs}

    def _before_output(self, module, args):
        if self._to_packed is None:
            return None
        y = args[0]
        flat = y.reshape(-1, y.shape[-1]).index_select(0, self._to_packed)
        self._to_packed = None  # one output call per mixer call
        return (flat.view(*self._packed_shape, y.shape[-1]), *args[1:])

    def _after_mixer(self, module, args, output):
        self._packed_shape, self._to_packed = None, None


def install_segment_rows(model: nn.Module, mixers: tuple, required: bool = False) -> int:
    """`SegmentRows` on every module of ``model`` whose name ends with a ``(suffix, output)`` of
    ``mixers`` (``output``: the child path under it; ``required``: see `SegmentRows`). Call it
    once, after the tensor-parallel plan and LoRA (the output child must be the module the
    forward calls). Returns how many."""
    count = 0
    for name, module in model.named_modules():
        for suffix, output in mixers:
            if name == suffix or name.endswith("." + suffix):
                SegmentRows(module, module.get_submodule(output), required)
                count += 1
    return count
