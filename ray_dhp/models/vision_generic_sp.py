"""Ulysses sequence parallelism for a generic family's tower (`ray_dhp.models.vision_generic`),
with nothing written for the model: the tower's own code runs, hooked at two seams it has.

* **The encoder** (the module holding the tower's list of ``num_hidden_layers`` layers, found
  by that count): a forward pre-hook cuts its input hidden states ``[images, T, D]`` to this
  SP rank's contiguous share of each image's ``T`` tokens (``T`` need not divide by SP: the
  shares differ by at most one token), slices the rotary ``position_embeddings`` (cos, sin) it
  is handed to the same tokens (and any other keyword tensor with the tokens first: Llama 4's
  complex rotary table ``freqs_ci [T, 1, d]``; or with the images first and the tokens next:
  Gemma 4's patch positions ``[images, T, 2]``, from which its encoder builds its rotary), and hands the layers an `UlyssesContext` as a keyword
  (``CTX_KWARG``), which the layers pass on to attention as transformers passes any keyword
  argument; the masks stay whole (only attention reads them, after the all-to-all, over the whole
  sequence). A forward hook gathers the encoder's output back to all ``T`` tokens.
* **Attention**: the tower's config selects ``ulysses_<inner>`` in transformers' attention
  registry (``AttentionInterface``, and the mask registry with the inner implementation's mask
  builder, so the tower builds the masks it builds for ``sdpa`` / ``eager``): query, key and
  value go sequence -> heads (`seq_to_heads`), the inner function runs on all tokens with this
  rank's ``H / SP`` heads, and the output goes heads -> sequence (`heads_to_seq`).
* The hidden states the tower records per layer (LLaVA takes ``hidden_states[-2]``) are the
  layers' local outputs; the tower's output holds them in `_Gathered`, which gathers an entry
  when the model's code reads it (only those it reads).

So the layers (attention projections, MLPs, norms: token-wise) keep ~1/SP of the activations.
Not split, run whole on every SP rank of the replica: the embeddings (patch convolution and
position table, before the cut), everything after the encoder (post-norm, feature selection,
the projector: pooling, pixel shuffle, patch merging) on the gathered tokens; each rank returns
its cut of the projected rows (the boundary's ``plan.cuts``), so every gradient is counted once
over the SP group. Exact: the same arithmetic per token; attention's sums over keys run whole.

`refusal` says from the tower's code why a tower cannot be split so (no single list of layers,
attention not through the interface, attention that splits its tokens per image itself);
`GenericFamily.validate_layout` refuses SP with it. At run time a layer whose attention did not
get the context, or encoder input that is not ``[images, tokens, width]``, raises.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch

from ray_dhp.parallel.ulysses import UlyssesContext, all_to_all_rows, heads_to_seq, seq_to_heads

__all__ = ["ATTN_PREFIX", "CTX_KWARG", "refusal", "install", "forward", "token_split"]

ATTN_PREFIX = "ulysses_"
CTX_KWARG = "ray_dhp_ulysses"
_ACTIVE = [0]  # encoders inside a split forward (a layer's attention must then get the context)


def _layer_list(tower: torch.nn.Module, depth: int):
    lists = [(n, m) for n, m in tower.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    return lists


def _calls_interface(module: torch.nn.Module) -> bool:
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


def _attentions(layer: torch.nn.Module) -> list:
    return [m for m in layer.modules() if m is not layer and _calls_interface(m)]


def refusal(tower: torch.nn.Module, vision_config) -> str:
    """Why ``tower`` (built on any device) cannot run Ulysses SP here, or ``""``."""
    depth = getattr(vision_config, "num_hidden_layers", None)
    lists = _layer_list(tower, depth) if depth else []
    if len(lists) != 1:
        return (f"its tower has {len(lists)} lists of num_hidden_layers={depth} layers (one "
                "encoder is what the split hooks)")
    layers = lists[0][1]
    for layer in layers:
        attn = _attentions(layer)
        if len(attn) != 1:
            return (f"its {type(layer).__name__} has {len(attn)} attention modules calling "
                    "transformers' attention interface (one is what the all-to-all wraps)")
        src = inspect.getsource(type(attn[0]).forward)
        if "cu_seqlens" in src or "split(" in src:
            return (f"its {type(attn[0]).__name__} splits the tokens per image itself before "
                    "the attention interface")
        if not hasattr(attn[0], "num_heads") and not hasattr(vision_config, "num_attention_heads"):
            return f"its {type(attn[0]).__name__} names no head count"
    return ""


def token_split(tokens: int, sp: int) -> list[int]:
    """Each SP rank's share of ``tokens`` (contiguous, the first ``tokens % sp`` one longer)."""
    return [tokens // sp + (k < tokens % sp) for k in range(sp)]


@dataclass
class _State:
    group: object
    rank: int
    sp: int
    comm: object = None
    lens: Optional[list] = None
    ctx: Optional[UlyssesContext] = None


def _gather(x: torch.Tensor, ctx: UlyssesContext) -> torch.Tensor:
    """``[B, T_local, ...]`` -> ``[B, T, ...]`` over the SP group (autograd: the adjoint sums
    every rank's gradient of this rank's tokens)."""
    y = x.movedim(1, 0)
    s = y.shape[0]
    y = all_to_all_rows(y.repeat(ctx.sp, *([1] * (y.dim() - 1))), [s] * ctx.sp, ctx.seq_lens,
                        ctx.group, ctx.comm, ctx.tag)
    return y.movedim(0, 1)


class _Gathered(tuple):
    """Recorded hidden states: an entry with this rank's token count is gathered when read."""

    def __new__(cls, items, ctx: UlyssesContext):
        out = super().__new__(cls, items)
        out._ctx, out._done = ctx, {}
        return out

    def _entry(self, i: int):
        x = tuple.__getitem__(self, i)
        if not (torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == self._ctx.local_len):
            return x
        if i not in self._done:
            self._done[i] = _gather(x, self._ctx)
        return self._done[i]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._entry(j) for j in range(len(self))[i])
        return self._entry(i % len(self) if i < 0 else i)

    def __iter__(self):
        return (self._entry(i) for i in range(len(self)))


def _all_queries(mask, total: int):
    """A 4-D mask over all ``total`` queries: as it is, or, where the tower built it from its
    cut hidden states (its encoder builds the mask itself: Gemma 4's, ``[B, 1, T_local, T]``),
    its one row repeated, which is exact where every query row is the same (a bidirectional
    padding mask: only the keys are masked); any other raises."""
    if not torch.is_tensor(mask) or mask.dim() != 4 or mask.shape[-2] in (1, total):
        return mask
    if not bool((mask == mask[..., :1, :]).all()):
        raise RuntimeError(f"an attention mask over {mask.shape[-2]} of {total} queries whose rows "
                           "differ: the tower builds it from its cut tokens")
    return mask[..., :1, :].expand(*mask.shape[:-2], total, mask.shape[-1])


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention registry's signature (``[B, H, T_local, d]`` in, ``[B, T_local, H, d]``
    out): sequence -> heads, the inner implementation over all tokens, heads -> sequence."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    import sys

    ctx = kwargs.pop(CTX_KWARG, None) or getattr(module, "_ray_dhp_ctx", None)
    inner = module.config._attn_implementation[len(ATTN_PREFIX):]
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(inner, sys.modules[type(module).__module__].eager_attention_forward)
    if ctx is None:
        if _ACTIVE[0]:
            raise RuntimeError(f"{type(module).__name__}: its layer did not hand {CTX_KWARG!r} on "
                               "to attention: the tower cannot run split over SP ranks")
        return fn(module, query, key, value, attention_mask, **kwargs)
    if query.shape[2] != ctx.local_len:
        raise RuntimeError(f"{type(module).__name__}: attention over {query.shape[2]} tokens, this "
                           f"SP rank holds {ctx.local_len}: the layer splits its tokens itself")
    if query.shape == key.shape == value.shape:  # one all-to-all for the three
        q, k, v = seq_to_heads(torch.stack([query, key, value], 1).permute(3, 0, 1, 2, 4), ctx) \
            .permute(2, 1, 3, 0, 4).unbind(0)
    else:  # fewer key/value heads: each its own
        q, k, v = (seq_to_heads(t.permute(2, 0, 1, 3), ctx).permute(1, 2, 0, 3) for t in (query, key, value))
    out, _ = fn(module, q, k, v, _all_queries(attention_mask, q.shape[2]), **kwargs)  # [B, T, H/sp, d]
    return heads_to_seq(out.transpose(0, 1), ctx).transpose(0, 1), None


def _register(inner: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = ATTN_PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, ulysses_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def _pre(encoder, args, kwargs):
    state: Optional[_State] = getattr(encoder, "_ray_dhp_sp", None)
    if state is None:
        return None
    args, kwargs = list(args), dict(kwargs)
    key = next((k for k in ("inputs_embeds", "hidden_states") if k in kwargs), None)
    hidden = kwargs[key] if key else args[0]
    if not torch.is_tensor(hidden) or hidden.dim() != 3:
        raise RuntimeError(f"{type(encoder).__name__}: input hidden states of shape "
                           f"{getattr(hidden, 'shape', None)}, not [images, tokens, width]")
    total = hidden.shape[1]
    if total < state.sp:
        raise RuntimeError(f"{total} tokens per image cannot be split over {state.sp} SP ranks")
    state.lens = token_split(total, state.sp)
    lo = sum(state.lens[:state.rank])
    ctx = UlyssesContext(state.group, state.lens, state.rank, state.comm)
    local = hidden[:, lo:lo + state.lens[state.rank]]
    if key:
        kwargs[key] = local
    else:
        args[0] = local
    pos = kwargs.get("position_embeddings")
    if pos is not None:
        kwargs["position_embeddings"] = tuple(p.narrow(-2, lo, ctx.local_len) if p.shape[-2] == total
                                              else p for p in pos)
    for k, v in kwargs.items():  # a per-token table with the tokens first (Llama 4's freqs_ci)
        if k not in (key, "position_embeddings") and "mask" not in k and torch.is_tensor(v) \
                and v.dim() >= 2 and v.shape[0] == total:
            if hidden.shape[0] == total:
                raise RuntimeError(f"{type(encoder).__name__}: {k} {tuple(v.shape)} may be per image "
                                   f"or per token ({total} images of {total} tokens)")
            kwargs[k] = v.narrow(0, lo, ctx.local_len)
        elif k not in (key, "position_embeddings") and "mask" not in k and torch.is_tensor(v) \
                and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(hidden.shape[:2]):
            kwargs[k] = v.narrow(1, lo, ctx.local_len)  # per image and token (Gemma 4's positions)
    if _takes_kwargs(encoder):
        kwargs[CTX_KWARG] = ctx
    else:  # it hands its layers no keywords: its attention modules hold the context meanwhile
        if any(getattr(layer, "gradient_checkpointing", False) for layer in encoder._ray_dhp_layers) \
                and encoder.training and torch.is_grad_enabled():
            raise RuntimeError(f"{type(encoder).__name__} hands its layers no keyword arguments: "
                               "its checkpointed layers' recompute would not see the SP split "
                               "(vision SP with activation checkpointing is not covered for it)")
        for attn in encoder._ray_dhp_attns:
            attn._ray_dhp_held = ctx
    state.ctx = ctx
    _ACTIVE[0] += 1
    return tuple(args), kwargs


def _takes_kwargs(module) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(module.forward).parameters.values())


def _attn_pre(attn, args, kwargs):
    """Keep the context the layer hands this attention module for its interface call (a
    module that does not pass its keywords on to the interface, SigLIP's); set on every call,
    so a checkpointed layer's recompute in backward sees its own micro-batch's."""
    attn._ray_dhp_ctx = kwargs.pop(CTX_KWARG, None) or getattr(attn, "_ray_dhp_held", None)
    return args, kwargs


def _post(encoder, args, kwargs, output):
    state: Optional[_State] = getattr(encoder, "_ray_dhp_sp", None)
    if state is None:
        return None
    _ACTIVE[0] -= 1
    ctx = state.ctx
    for attn in encoder._ray_dhp_attns:
        attn._ray_dhp_held = None
    if torch.is_tensor(output):
        return _gather(output, ctx)
    if isinstance(output, tuple):
        return (_gather(output[0], ctx), *output[1:])
    output.last_hidden_state = _gather(output.last_hidden_state, ctx)
    return output


def _tower_post(tower, args, output):
    state: Optional[_State] = getattr(tower, "_ray_dhp_sp", None)
    hs = getattr(output, "hidden_states", None) if state is not None else None
    if isinstance(hs, tuple) and not isinstance(hs, _Gathered):
        ctx = UlyssesContext(state.group, state.lens, state.rank, state.comm)
        output.hidden_states = _Gathered(hs, ctx)
    return None


def install(tower: torch.nn.Module, vision_config) -> torch.nn.Module:
    """Hook ``tower`` once (idempotent) and select the Ulysses attention for it; returns its
    encoder. Outside `forward`'s SP window the hooks do nothing and attention runs as before."""
    enc = getattr(tower, "_ray_dhp_encoder", None)
    if enc is not None:
        return enc
    why = refusal(tower, vision_config)
    if why:
        raise ValueError(f"vision sequence parallelism is not covered for this tower: {why}")
    name, layers = _layer_list(tower, vision_config.num_hidden_layers)[0]
    enc = tower.get_submodule(name.rsplit(".", 1)[0]) if "." in name else tower
    enc._ray_dhp_layers, enc._ray_dhp_attns = list(layers), []
    for layer in layers:
        attn = _attentions(layer)[0]
        enc._ray_dhp_attns.append(attn)
        impl = attn.config._attn_implementation or "sdpa"
        if not impl.startswith(ATTN_PREFIX):
            inner = impl if impl in ("eager", "sdpa") else "sdpa"  # flash: its masks are sdpa's
            attn.config._attn_implementation = _register(inner)
        attn.register_forward_pre_hook(_attn_pre, with_kwargs=True)
    enc.register_forward_pre_hook(_pre, with_kwargs=True)
    enc.register_forward_hook(_post, with_kwargs=True)
    tower.register_forward_hook(_tower_post)
    tower._ray_dhp_encoder = enc
    return enc


def forward(towers: list, run, rows_cut: tuple, sp_rank: int, sp_group, sp: int,
            comm=None) -> torch.Tensor:
    """``run()`` (the whole-image forward: the replica's rows ``[R, D]``) with the encoders of
    ``towers`` (the vision parts with a vision config: VideoLLaVA has an image and a video
    tower) split over the SP group; this rank's rows ``rows_cut = (lo, hi)``. Raises if no
    encoder ran split (the images went through another module)."""
    state = _State(sp_group, sp_rank, sp, comm)
    encs = [install(t, t.config) for t in towers]
    for t, e in zip(towers, encs):
        e._ray_dhp_sp = t._ray_dhp_sp = state
    try:
        feats = run()
    finally:
        for t, e in zip(towers, encs):
            e._ray_dhp_sp = t._ray_dhp_sp = None
        _ACTIVE[0] = 0
    if state.lens is None:
        raise RuntimeError("get_image_features ran none of the split encoders")
    lo, hi = rows_cut
    return feats[lo:hi]
