"""What a generic family's language model saves for backward per decoder layer, measured from its
own code (`ray_dhp.models.generic`): the decoder (``embed_tokens`` .. ``layers`` .. ``norm``) built
on the meta device (shapes only, no memory, at any width) in the activation dtype, one forward of
a row's input embeddings (its length: what a token saves can depend on it) under ``torch.autograd.graph.saved_tensors_hooks``, each saved
storage counted once at its full size (identity: the storage's ``_cdata``), parameters and views
of them excluded, as `benchmarks/measure.py` counts a real step's, and given to the decoder layer
running when it was first saved: bytes per token of each layer (every layer type measured:
dense / sparse / other token mixers, extra norms, parallel blocks, latent attention).

Per text TP rank: each saved tensor is *sharded* (``1/tp`` of it on a TP rank) or *replicated*,
as the language model's ``base_model_tp_plan`` makes it (the styles `ray_dhp.models.text_plans`
translates), followed through the forward: a column-parallel module's output is sharded, so is
every tensor computed from a sharded one (a `torch.overrides.TorchFunctionMode` sees every op),
until a row-parallel module's output (its all-reduce) makes it replicated again; a fused gate_up
whose output is gathered (``colwise_gather_output``) stays replicated, and the row-parallel
module after it (``rowwise_split_input``) keeps its input's local slice, a storage of its own
(sharded), the input itself replicated for whatever else reads it (Qwen4-Exp's hyper-connections
mix the normed residual they split into the token mixer's input). A layer the
plan does not shard (LFM2's short-convolution blocks) is whole on every TP rank. Under text
sequence parallelism every per-token activation is ``1/tp`` of the whole
(`ray_dhp.planning.memory.text_activation_parts`).

Besides the layers: the per-token tensors the layers are handed and save (the rotary ``cos`` /
``sin`` tables: float, fewer than four dims, one of them the probe's tokens; a mask, ``s²``, is
not counted) and what the decoder saves outside its layers (the final norm, an embedding scale).

What it cannot see (kept by formula in the planner): the input ids, labels and logits (the
engine's vocabulary-parallel loss, not the stock head), the routed experts' rows where the experts
module is handed the routing (the probe runs it as a stub that saves nothing: the stock loop's
per-expert gathers depend on the routing's values, which the meta device has none of;
`ray_dhp.planning.memory_layers.routed_rows_bytes` counts them, stock and expert-parallel; an
experts module handed the hidden rows alone, Llama 4's every expert on every token, is measured),
autocast's casts, an eager attention's ``s²`` scores (the probe runs attention as the fused CPU
kernel, `ray_dhp.models.vision_saved._FusedAttention`), an attention mask the stock forward builds
from its inputs and SDPA keeps (``rows x s²``: Gemma's and PaliGemma's image tokens attending
both ways; the probe's causal run has none), rotary tables shared by a micro-batch's rows
(counted per token), and kernels whose meta implementation saves other tensors than their CPU /
CUDA one.
`text_saved_per_token` returns None where the meta forward fails: the planner keeps its block
formula.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
from typing import NamedTuple, Optional

import torch

from ray_dhp.models.vision_saved import _FusedAttention

__all__ = ["text_saved_per_token", "TextSaved", "PROBE_TOKENS", "PROBE_MAX_TOKENS"]

PROBE_TOKENS = 64  # a row's length where the caller names none
# the longest row probed: a longer one is probed at this length (what a token saves is then
# within a chunk's padding of its value at any longer length: a chunked linear-attention
# kernel's 64-token chunks, 3% at 2048; the meta forward's time grows with the chunks)
PROBE_MAX_TOKENS = 2048
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


class TextSaved(NamedTuple):
    """Bytes per token a decoder saves for backward (`text_saved_per_token`)."""

    layers: tuple    # per decoder layer (replicated, sharded): a TP rank keeps rep + sharded/tp
    tables: float    # what the layers are handed and save (the rotary cos / sin; masks not)
    outside: float   # saved outside the layers (the final norm, an embedding scale): replicated;
    #                  not the norm's output, which the head keeps (the planner's ``d h``)
    stubbed: frozenset = frozenset()  # the layers whose routed rows are not in ``layers``


def text_saved_per_token(config, family, dtype_bytes: int,
                         tokens: int = PROBE_TOKENS) -> Optional[TextSaved]:
    """The `TextSaved` of ``config``'s language model (a `GenericFamily` ``family``'s) at
    ``dtype_bytes`` per activation element, for rows of ``tokens`` tokens (at most
    `PROBE_MAX_TOKENS`: a chunked kernel pads each row to its chunks, so what a token saves
    depends on the row's length), its layers' bytes split as the text TP plan shards them (a
    stubbed experts module's routed rows not included), or None where the meta probe cannot run
    (module docstring). Cached per (config, dtype, tokens)."""
    import transformers

    cls = getattr(transformers, family.model_class)
    return _measure(cls, config.to_json_string(use_diff=False), family, _DTYPES[dtype_bytes],
                    max(1, min(int(tokens), PROBE_MAX_TOKENS)))


class _Sharding(_FusedAttention):
    """Marks the storages of the outputs of every op that reads a sharded tensor as sharded
    (module docstring; SDPA's as its fused kernel, `_FusedAttention`, with every tensor that kernel
    keeps); the plan's modules mark and unmark by their forward hooks."""

    def __init__(self):
        super().__init__()
        self.sharded, self.keep = set(), []

    def mark(self, x, on: bool = True) -> None:
        for t in _tensors(x):
            st = t.untyped_storage()
            if on:
                self.sharded.add(st._cdata)
                self.keep.append(st)  # its id stays this storage's
            else:
                self.sharded.discard(st._cdata)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        got = (self.fused(args, kwargs)
               if func is torch.nn.functional.scaled_dot_product_attention else None)
        out = super().__torch_function__(func, types, args, kwargs) if got is None else got[0]
        if any(t.untyped_storage()._cdata in self.sharded for t in _tensors((args, kwargs))):
            self.mark(out if got is None else got)
        return out


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _hook_plan(decoder, plan: dict, mode: _Sharding) -> list:
    """Forward hooks by the plan's styles (keys relative to the decoder, module docstring)."""
    hooks = []
    for name, module in decoder.named_modules():
        style = next((s for k, s in plan.items() if fnmatch.fnmatchcase(name, k)), None)
        if style == "colwise":
            hooks.append(module.register_forward_hook(lambda _m, _a, out: mode.mark(out)))
        elif style in ("rowwise", "rowwise_split_input"):
            if style == "rowwise_split_input":
                hooks.append(module.register_forward_pre_hook(
                    lambda _m, args: _split_input(args, mode)))
            hooks.append(module.register_forward_hook(lambda _m, _a, out: mode.mark(out, False)))
    return hooks


def _split_input(args: tuple, mode: _Sharding) -> tuple:
    """A ``rowwise_split_input`` module's arguments as the TP rank runs it: each replicated input
    split into its local slice (DTensor's redistribution: a new storage, ``1/tp`` of the input,
    the one the linear saves), the caller's tensor left replicated (what else reads it, e.g. a
    hyper-connection's mix of its normed input, keeps the whole tensor)."""
    def split(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.clone()
            mode.mark(x)
        return x

    return tuple(split(a) for a in args)


def _is_param(t: torch.Tensor) -> bool:
    while t is not None:
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base
    return False


def _storages(x, out: set) -> None:
    out.update(t.untyped_storage()._cdata for t in _tensors(x))


def _stub(module, current: list, stubbed: set) -> None:
    """The experts module handed the routing as an identity-shaped forward that saves nothing, its
    layer recorded in ``stubbed``; one handed the hidden rows alone runs (module docstring)."""
    real = module.forward

    def forward(hidden_states, *args, **kwargs):
        if next(_tensors((args, kwargs)), None) is None:
            return real(hidden_states, *args, **kwargs)
        stubbed.add(current[0])
        return hidden_states * 0.0

    module.forward = forward


@functools.lru_cache(maxsize=None)
def _measure(cls, config_json: str, family, dtype, tokens: int) -> Optional[tuple]:
    config = cls.config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    decoder = family.language_model(model)
    decoder = getattr(decoder, "base_model", decoder)
    plan = dict(getattr(decoder.config, "base_model_tp_plan", None) or {})
    layers = decoder.layers
    current, handed, stubbed = [None], {}, set()  # handed: storage id -> per token (docstring)
    if family.moe is not None:
        for name, module in decoder.named_modules():
            if fnmatch.fnmatchcase(name, f"layers.*.{family.moe.experts_suffix}"):
                _stub(module, current, stubbed)
    saved: list = [[] for _ in layers]
    params = {p.untyped_storage()._cdata for p in decoder.parameters()}

    def enter(i):
        def hook(_m, args, kwargs):
            current[0] = i
            for t in _tensors((args[1:], {k: v for k, v in kwargs.items()
                                          if k != "hidden_states"})):  # what the layer is handed
                handed.setdefault(t.untyped_storage()._cdata, t.is_floating_point()
                                  and t.dim() < 4 and tokens in t.shape)
        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(enter(i), with_kwargs=True)
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))
    seen: dict = {}

    def pack(t):
        if not _is_param(t):
            st = t.untyped_storage()
            if st._cdata not in seen and st._cdata not in params:
                seen[st._cdata] = st  # the id stays this storage's while counting
                if st._cdata in handed:
                    if handed[st._cdata]:
                        tables.append(st)  # per token (rotary tables), not a mask (s²)
                else:
                    (outside if current[0] is None else saved[current[0]]).append(st)
        return t

    for cpu_ints in (False, True):  # positions on CPU where the code reads their values
        for s in saved:
            s.clear()
        stubbed.clear()
        tables, outside = [], []
        seen.clear()
        handed.clear()
        mode = _Sharding()
        hooks = _hook_plan(decoder, plan, mode)
        embeds = torch.ones(1, tokens, decoder.config.hidden_size, dtype=dtype,
                            device="meta", requires_grad=True)
        try:
            with (contextlib.nullcontext() if cpu_ints else torch.device("meta")), \
                    mode, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                positions = torch.arange(tokens)[None] if cpu_ints else None
                decoder(inputs_embeds=embeds, position_ids=positions, use_cache=False)
        except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError,
                AttributeError):
            continue
        finally:
            for h in hooks:
                h.remove()
        def per_token(storages, sharded=None) -> float:
            return sum(st.nbytes() for st in storages
                       if sharded is None or (st._cdata in mode.sharded) == sharded) / tokens

        return TextSaved(tuple((per_token(s, False), per_token(s, True)) for s in saved),
                         per_token(tables), per_token(outside), frozenset(stubbed))
    return None
