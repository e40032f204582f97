"""Packed rows for token mixers that carry state along the sequence (a causal convolution, a
chunked linear-attention recurrence): no state crosses a sample boundary, and a packed row costs
about its real tokens.

A packed row holds several samples back to back. Attention keeps them apart through the mask
transformers builds from the packed position ids; a recurrent mixer (Gated DeltaNet: a short
causal conv1d, then the chunked gated delta rule) would instead carry its conv window and its
recurrent state from one sample into the next, and transformers' torch path of such a mixer has
no sequence boundaries (its kernel wrappers refuse ``cu_seqlens`` without the optimized
packages). `SegmentRows` keeps the packed rows but, before the mixer, lays each row out
**aligned** (`ray_dhp.parallel.segments.segment_layout`): every segment starts at a multiple of
the recurrence's chunk with at least ``kernel - 1`` zero tokens before it, so the conv starts
each segment from a zero window; for the call, the recurrence the mixer's forward calls by name
is the family's resetting one (`StatefulMixer.resetting`), whose state is zero at every chunk
where a segment starts. A row grows by at most ``chunk - 1 + kernel - 1`` tokens per segment
(the mixer's earlier layout, one row per segment padded to the micro-batch's longest segment,
cost ``segments x longest``). Before the mixer's per-token output projection, its input is
laid back out as the packed ``[R, L, C']``: the projection, its tensor-parallel collectives and
a sequence-parallel reduce-scatter see the packed layout, as without packing.

The recurrence is swapped through a `_Dispatch` put once in place of the name the mixer's
forward calls (an attribute of the mixer if it has one, else a global of its class's module,
as transformers' ``torch_chunk_gated_delta_rule``): it calls the stock function unless a packed
call of that mixer is running in this context. A packed call whose forward did not call it
raises (a transformers version that renamed it would otherwise share state silently).

The segments come as a forward keyword argument, `SEGMENTS_KWARG`: ``cu_seqlens`` ``[S + 1]``
over the row-major flattened ``[R * L]`` tokens (`ray_dhp.data.collate.pack_text_batch`). A
keyword argument travels with the call through transformers' decoder layers and non-reentrant
activation checkpointing's recomputation. A mixer with no resetting recurrence named (a
``(suffix, output)`` pair found in a generic model's module tree, e.g. a short convolution)
runs one row per segment instead, each from a zero state (`segment_per_row`). A forward without it (padded batches, the reference)
is left untouched. Which modules carry state, the name and chunk of their recurrence and its
resetting twin are family facts (`FamilySpec.stateful_mixers`); this module names no family.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from ray_dhp.parallel.segments import SEGMENTS_KWARG, SegmentLayout, segment_layout, segment_per_row

__all__ = ["SEGMENTS_KWARG", "SegmentRows", "StatefulMixer", "install_segment_rows", "stateful_mixer"]


@dataclass(frozen=True)
class StatefulMixer:
    """A family fact: the LM's modules named ``*.<suffix>`` carry state; ``output``: their child
    projecting the mixed channels per token; ``recurrence``: the names their forward may call
    the chunked recurrence by (the first one found on the module, else in its class's module;
    empty: no reset to hand, so each segment runs as a row of its own, `segment_per_row`);
    ``resetting``: that recurrence with a ``starts`` ``[B, L]`` (bool) keyword, zero state at
    each; ``chunk``: its chunk; ``window``: the module's attribute holding its causal conv's
    kernel width ("" for none)."""

    suffix: str
    output: str
    recurrence: tuple = ()
    resetting: Optional[Callable] = None
    chunk: int = 64
    window: str = ""

    def layout(self, mixer: nn.Module, cu_seqlens, row_length: int) -> SegmentLayout:
        if not self.recurrence:
            return segment_per_row(cu_seqlens)
        gap = getattr(mixer, self.window) - 1 if self.window else 0
        return segment_layout(cu_seqlens, row_length, align=self.chunk, gap=gap)

    def resetter(self, mixer: nn.Module) -> "_Resetter":
        return _Resetter(mixer, self)


def stateful_mixer(entry) -> StatefulMixer:
    """A `StatefulMixer`, or one from a ``(suffix, output)`` pair (a mixer found in the module
    tree, `ray_dhp.models.generic_packing`: no recurrence known, one row per segment)."""
    return entry if isinstance(entry, StatefulMixer) else StatefulMixer(*entry)


_ACTIVE = contextvars.ContextVar("ray_dhp_resetting_recurrence", default=None)


class _Dispatch:
    """Stands in for a mixer's recurrence (module docstring): the resetting one while a packed
    call of that mixer is active, the stock one otherwise."""

    def __init__(self, stock: Callable):
        self.stock = stock

    def __call__(self, *args, **kwargs):
        active = _ACTIVE.get()
        if active is None or active[0] is not self:
            return self.stock(*args, **kwargs)
        active[2] += 1
        return active[1](*args, **kwargs)


class _Resetter:
    """Puts a `_Dispatch` in place of ``spec.recurrence`` for ``mixer`` once; `enter` /
    `leave` bracket one packed call."""

    def __init__(self, mixer: nn.Module, spec: StatefulMixer):
        self.spec, self._token, self.dispatch = spec, None, None
        if not spec.recurrence:  # nothing to reset: rows of one segment
            return
        owner, name = _recurrence_owner(mixer, spec.recurrence)
        found = getattr(owner, name)
        if not isinstance(found, _Dispatch):
            found = _Dispatch(found)
            setattr(owner, name, found)
        self.dispatch, self.name, self._token = found, name, None

    def enter(self, starts) -> None:
        if self.dispatch is None:
            return
        run = functools.partial(self.spec.resetting, starts=starts, chunk_size=self.spec.chunk)
        self._token = _ACTIVE.set([self.dispatch, run, 0])

    def leave(self, module: nn.Module) -> None:
        if self._token is None:
            return
        calls = _ACTIVE.get()[2]
        _ACTIVE.reset(self._token)
        self._token = None
        if calls == 0 and sys.exc_info()[0] is None:
            raise RuntimeError(f"{type(module).__name__}'s forward did not call {self.name!r}: "
                               "packed samples would share its recurrent state (a transformers "
                               "version that renamed it needs the family's StatefulMixer updated)")


def _recurrence_owner(mixer: nn.Module, names: tuple) -> tuple:
    for name in names:
        if name in vars(mixer) and callable(vars(mixer)[name]):
            return mixer, name
    module = sys.modules[type(mixer).__module__]
    for name in names:
        if callable(getattr(module, name, None)):
            return module, name
    raise ValueError(f"{type(mixer).__name__} calls none of {names} (neither an attribute nor a "
                     f"global of {module.__name__}): its packed rows cannot reset the state")


class SegmentRows:
    """Hooks that run ``mixer`` on aligned packed rows with the resetting recurrence (module
    docstring); ``spec``: its `StatefulMixer`. ``required``: every call must bring the segments
    (a model that only ever sees packed rows), so a forward that stopped handing them down
    raises instead of mixing samples silently."""

    def __init__(self, mixer: nn.Module, spec: StatefulMixer, required: bool = False):
        self.spec, self.required = spec, required
        self._rows: Optional[int] = None
        self._layout: Optional[SegmentLayout] = None
        self._reset = spec.resetter(mixer)
        mixer.register_forward_pre_hook(self._before_mixer, with_kwargs=True)
        mixer.register_forward_hook(self._after_mixer, always_call=True)
        # prepend: before the output's own (tensor-parallel) input hooks, which then see the
        # packed layout exactly as without packing
        mixer.get_submodule(spec.output).register_forward_pre_hook(self._before_output, prepend=True)

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
        layout = self.spec.layout(module, cu, x.shape[1]).to(x.device)
        if layout.to_packed.numel() != x.shape[0] * x.shape[1]:
            raise ValueError(f"{SEGMENTS_KWARG} cover {layout.to_packed.numel()} tokens, the "
                             f"mixer's input has {x.shape[0]} x {x.shape[1]}")
        self._rows, self._layout = x.shape[0], layout
        self._reset.enter(layout.starts)
        rows = layout.rows(x)
        if positional:
            return (rows, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": rows}

    def _before_output(self, module, args):
        if self._layout is None:
            return None
        y = self._layout.packed(args[0], self._rows)
        self._layout = None  # one output call per mixer call
        return (y, *args[1:])

    def _after_mixer(self, module, args, output):
        self._rows, self._layout = None, None
        self._reset.leave(module)


def install_segment_rows(model: nn.Module, mixers: tuple, required: bool = False) -> int:
    """`SegmentRows` on every module of ``model`` named by a `StatefulMixer` (or a ``(suffix,
    output)`` pair, `stateful_mixer`) of ``mixers``
    (``required``: see `SegmentRows`). Call it once, after the tensor-parallel plan and LoRA
    (the output child must be the module the forward calls). Returns how many."""
    count = 0
    mixers = tuple(map(stateful_mixer, mixers))
    for name, module in model.named_modules():
        for spec in mixers:
            if name == spec.suffix or name.endswith("." + spec.suffix):
                SegmentRows(module, spec, required)
                count += 1
    return count
