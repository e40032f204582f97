"""Packed rows' attention one segment at a time: each sample's causal attention over its own
tokens, never the whole row.

Without a varlen kernel, transformers keeps the samples of a packed row apart with a block mask
(`ray_dhp.data.collate.pack_text_batch`): SDPA then runs over the whole ``L x L`` row, so a row
of many short samples pays the row length squared for attention, not the sum of its samples'
squares. Here a function in transformers' attention registry (``AttentionInterface``, as
``ATTN_NAME``, selected by the language model's ``config._attn_implementation``) runs
transformers' own SDPA forward (`sdpa_attention_forward`: grouped-query heads, scaling, dropout
as the stock ``sdpa`` path) on each segment alone with ``is_causal`` and no mask. The segments
are the batch's ``cu_seqlens`` (every sample and every row's padded tail a segment; segments
never cross rows), handed down the forward as the keyword argument
`ray_dhp.models.segments.SEGMENTS_KWARG`, which transformers passes on to the attention
function as it passes any keyword argument; a call without them raises (samples would attend
across a boundary otherwise). The name is not in the mask registry, so the model builds no mask
at all (``masking_utils`` skips it for attention functions it has no mask builder for).

Exactness: the same dot products and softmax per token as the block-masked row, summed over the
sample's keys only (SDPA's kernels may block the sums differently: rounding only). It holds for
attention that is plain causal inside a sample; `refusal` names what is not (sliding or chunked
windows, bidirectional blocks inside an image, `FamilySpec.segment_attention`), and such a model
keeps the block mask. A varlen kernel (flash attention on GPU) makes this unnecessary: only
``sdpa`` is replaced (`install_segment_attention`).
"""

from __future__ import annotations

import torch

from ray_dhp.models.segments import SEGMENTS_KWARG

__all__ = ["ATTN_NAME", "install_segment_attention", "refusal", "segment_attention"]

ATTN_NAME = "ray_dhp_segments"


def refusal(text_config, causal_in_sample: bool = True) -> str:
    """Why the language model's attention is not plain causal inside a sample (then per-segment
    attention would not be exact and the block mask stays), or ``""``. ``causal_in_sample``:
    the family's `FamilySpec.segment_attention` (False for bidirectional image blocks)."""
    if not causal_in_sample:
        return "its attention is bidirectional inside an image (a mask, not causal)"
    types = sorted({str(t) for t in getattr(text_config, "layer_types", None) or ()
                    if "sliding" in str(t) or "chunked" in str(t)})
    if types:
        return f"its {', '.join(map(repr, types))} layers attend through a window"
    # another attention kind (an indexer's sparse selection, ``indexed_attention``) may read the
    # 4-D mask itself: only plain softmax attention runs per segment without one
    other = sorted({str(t) for t in getattr(text_config, "layer_types", None) or ()
                    if str(t).endswith("attention") and str(t) not in ("full_attention", "linear_attention")})
    if other:
        return f"its {', '.join(map(repr, other))} layers may read the attention mask themselves"
    if getattr(text_config, "layer_types", None) is None and getattr(text_config, "sliding_window", None) \
            and getattr(text_config, "use_sliding_window", True):
        return "its attention has a sliding window"
    if getattr(text_config, "attention_chunk_size", None):
        return "its attention is chunked"
    return ""


def _segment_lengths(cu: torch.Tensor, rows: int, length: int) -> list[list[int]]:
    """The segment lengths of each of ``rows`` rows of ``length`` tokens from ``cu_seqlens``
    over the row-major flattened tokens (each row's lengths sum to ``length``)."""
    bounds = cu.to("cpu", torch.long).tolist()
    if bounds[0] != 0 or bounds[-1] != rows * length:
        raise ValueError(f"{SEGMENTS_KWARG} span {bounds[0]}..{bounds[-1]}, the attention's "
                         f"input holds {rows} x {length} tokens")
    per_row: list[list[int]] = [[] for _ in range(rows)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a or a // length != (b - 1) // length:
            raise ValueError(f"{SEGMENTS_KWARG}: segment {a}..{b} is empty or crosses a row of {length}")
        per_row[a // length].append(b - a)
    return per_row


def segment_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling=None, **kwargs):
    """The attention registry's signature: ``query`` ``[B, H, L, d]``, ``key``/``value``
    ``[B, H_kv, L, d]``, the packed rows' ``cu_seqlens`` in ``kwargs[SEGMENTS_KWARG]``; returns
    ``([B, L, H, d], None)`` as `sdpa_attention_forward` does (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop(SEGMENTS_KWARG, None)
    if cu is None:
        raise RuntimeError(f"{type(module).__name__}: '{ATTN_NAME}' attention was called without "
                           f"{SEGMENTS_KWARG!r}: the model's forward no longer hands its keyword "
                           "arguments down to attention, so packed samples would attend across "
                           "their boundaries")
    if attention_mask is not None or kwargs.get("sliding_window"):
        raise ValueError(f"{type(module).__name__}: '{ATTN_NAME}' attention is plain causal per "
                         "segment; it got a mask or a sliding window (`refusal` should have kept "
                         "the block mask for this model)")
    rows, length = query.shape[0], query.shape[2]
    per_row = _segment_lengths(cu, rows, length)
    kwargs.pop("is_causal", None)
    out = []
    # unbind + split: one autograd node each, whose backward stacks / concatenates the pieces'
    # gradients once (a slice per segment would build a full-size zero gradient per segment)
    for lengths, q, k, v in zip(per_row, query.unbind(0), key.unbind(0), value.unbind(0)):
        pieces = [sdpa_attention_forward(module, qs[None], ks[None], vs[None], None, dropout=dropout,
                                         scaling=scaling, is_causal=True, **kwargs)[0]
                  for qs, ks, vs in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))]
        out.append(torch.cat(pieces, dim=1))
    return torch.cat(out, dim=0), None


def _register() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTN_NAME not in ALL_ATTENTION_FUNCTIONS:  # no mask builder: the model builds no mask
        ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, segment_attention)


def install_segment_attention(language_model: torch.nn.Module, causal_in_sample: bool = True) -> str:
    """Select per-segment attention for ``language_model`` (its config only: an encoder's
    attention is untouched) when it runs ``sdpa`` and `refusal` has nothing against it. Every
    forward of the model must then bring the segments. Returns ``""`` when installed, else why
    not (the model keeps its block mask)."""
    config = language_model.config
    impl = config._attn_implementation
    if impl == ATTN_NAME:
        return ""
    if impl != "sdpa":
        return f"it runs {impl!r} attention, not 'sdpa'"
    why = refusal(config, causal_in_sample)
    if not why:
        _register()
        config._attn_implementation = ATTN_NAME
    return why
