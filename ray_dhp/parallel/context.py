"""Context parallelism (CP) for the language model: Ulysses-style, over ``text.context_parallel``.

Each CP rank of a text replica holds a contiguous ``1/cp`` slice of the (padded) sequence for
everything outside attention: embeddings, norms, MLP, residual stream, ``lm_head`` and the loss
(`slice_sequence`). Around attention an all-to-all turns the sequence sharding into a head
sharding (`ray_dhp.parallel.ulysses.seq_to_heads`: every CP rank then holds the *whole* sequence
for ``H / (tp x cp)`` heads), causal attention runs over the whole sequence for those heads, and
the reverse all-to-all (`heads_to_seq`) turns the output back into the rank's slice. The backward
of each all-to-all is the other one (its adjoint). DeepSpeed-Ulysses (Jacobs et al. 2023).

* Load balance: every CP rank runs attention over the whole sequence for an equal share of the
  heads, so the causal triangle is split evenly without zigzag chunking.
* Beyond the heads (``tp x cp`` does not divide the attention heads, e.g. CP4 with 2 heads per
  TP rank, or CP3 with 4): ring attention (`ray_dhp.parallel.ring`). Every rank keeps all of its
  heads and its queries; the key/value blocks pass around the CP group by paired point-to-point
  (send to the next rank, receive from the previous, posted together before each step's
  compute), merged by log-sum-exp; the backward recomputes each block and passes the dK/dV
  accumulators around the ring. A rank holds ~2 K/V blocks, never ``cp`` copies. Causal load
  balance inside attention only: each rank swaps the second half of its slice with rank
  ``cp - 1 - r`` (one message per direction), so every rank's queries are a low and a high
  half-slice and every ring step costs every rank the same (zigzag's balance, without
  re-laying the sequence out: everything outside attention keeps the contiguous slice). The
  planner prices the ring where the heads run out (`ray_dhp.planning.memory.cp_working_bytes`,
  `cp_ring_bytes`). Ulysses stays the form where the heads divide: one all-to-all of q, k, v
  and one of the output per layer against the ring's ``cp - 1`` K/V blocks. Stateful mixers
  still need ``tp x cp`` to divide their heads.
* KV heads: where the rank's KV heads do not divide by ``cp`` (grouped-query attention with few
  KV heads) they are repeated to the query heads before the all-to-all (exact: each query head
  meets the KV head it always used; the repeat's backward sums the copies' gradients).
* Masks: the slice is right-padded (pads have no target) and attention is causal, so no real
  token sees a pad: the rank's attention is ``is_causal`` over the whole sequence, no mask.
* Packed rows (``data.packing``): each row of ``[R, L]`` is sliced like a padded one; positions
  and targets are computed per sample on the whole packed row before the slicing
  (`ray_dhp.data.collate.pack_text_batch`), the samples' segments (``cu_seqlens`` over the
  ``R x L`` tokens, the `ray_dhp.parallel.segments.SEGMENTS_KWARG` keyword that travels down the
  decoder layers) reach `cp_attention`, which after the all-to-all runs causal attention per
  segment (no token attends across a sample boundary, no ``L x L`` mask), and the head-sharded
  stateful mixers, which lay the rows out chunk-aligned and reset their recurrence at every
  sample (their state starts at zero at every sample, `ray_dhp.parallel.context_mixers`).
* The function is registered in transformers' attention registry (``AttentionInterface``) as
  ``"ray_dhp_cp"`` and selected by the language model's ``config._attn_implementation``; the CP
  group travels on each attention module (``module._ray_dhp_cp``), never in a global.
* Stateful token mixers (linear attention such as Gated DeltaNet: a causal conv and a recurrent
  state along the sequence) are head-sharded by all-to-all like attention, not fed state from
  slice to slice: each CP rank runs the whole sequence for ``1 / cp`` of the mixer's heads
  (`ray_dhp.parallel.context_mixers`, the family's `FamilySpec.cp_mixers` facts), so the conv
  and the recurrence see every earlier token exactly and all CP ranks work at once; chunked
  state passing would run the ranks one after the other (or need a second, parallel-prefix form
  of each recurrence) for the same exactness. The same limit as attention: ``tp x cp`` divides
  the mixer's key heads.
* Expert parallelism draws its EP group from the dp x cp gradient replicas (CP ranks hold
  different tokens outside attention, `ray_dhp.parallel.expert`).
* Gradients: parameters are replicated over the CP ranks, each of which back-propagates its
  slice's share of the step's loss, so CP ranks join the data-parallel ranks in the gradient sum
  and the ZeRO partition (`ray_dhp.parallel.topology.ModuleLayout.dp_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ray_dhp.parallel.ulysses import UlyssesContext, heads_to_seq, seq_to_heads

__all__ = ["ATTN_NAME", "check_context_parallel", "install_context_parallel", "local_rows",
           "refusal", "slice_sequence"]

ATTN_NAME = "ray_dhp_cp"
_TAG = "text.cp"


def check_context_parallel(cp: int, ep: int, expert_tp: bool) -> None:
    """``text.context_parallel`` against the topology's other text degrees (driver check).
    Expert parallelism composes: the EP group takes the CP ranks as it takes data-parallel
    replicas (`ray_dhp.parallel.expert`)."""
    if cp > 1 and expert_tp:
        raise ValueError("text.context_parallel > 1 is not covered with "
                         "text.expert_tensor_parallel yet; set text.context_parallel=1 or use "
                         "text.expert_parallel.")


def refusal(family, config, cp: int, tp: int, encoder_ops: tuple = (),
            text_sp: bool = False) -> Optional[str]:
    """Why ``text.context_parallel=cp`` cannot be exact for this model and layout (None: it
    can). Read from the family's facts (no family is named here)."""
    if cp == 1:
        return None
    key = f"text.context_parallel={cp}"
    tc = config.text_config
    why = []
    mixers = family.cp_mixers(tc) if family.stateful_mixers else ()
    if family.stateful_mixers and not mixers:
        why.append("linear-attention layers (their recurrent state runs along the whole "
                   "sequence, and the family does not say how they split by head)")
    elif mixers:  # head-sharded by all-to-all (`ray_dhp.parallel.context_mixers`)
        from ray_dhp.parallel.context_mixers import mixer_refusal

        bad = mixer_refusal(mixers, tp, cp)
        if bad:
            return f"{key}: {bad}; use a text.context_parallel that divides them."
        if text_sp:
            why.append("linear-attention layers under text.sequence_parallel (not covered "
                       "together yet)")
    if getattr(tc, "use_sliding_window", False) or any(
            "sliding" in t for t in (getattr(tc, "layer_types", None) or ())):
        why.append("sliding-window attention layers")
    if any(not getattr(ops, "CONTEXT_PARALLEL", False) for ops in encoder_ops):
        why.append("an encoder whose feature rows cannot be sliced by sequence position")
    if why:
        return (f"{key} is not exact yet for the {family.name} family with " + "; ".join(why)
                + ": set text.context_parallel=1 (use text.sequence_parallel / "
                "tensor_parallel for long sequences instead).")
    return None


# -- the sequence slice -----------------------------------------------------------------------

def bounds(length: int, cp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of CP rank ``rank``'s slice of a sequence of ``length`` (a multiple of cp)."""
    if length % cp:
        raise ValueError(f"sequence length {length} is not a multiple of the CP degree {cp}")
    s = length // cp
    return rank * s, (rank + 1) * s


def slice_sequence(t: Optional[torch.Tensor], cp: int, rank: int) -> Optional[torch.Tensor]:
    """The rank's slice of ``t`` along its last dimension (the sequence): ``[..., S / cp]``."""
    if t is None:
        return None
    lo, hi = bounds(t.shape[-1], cp, rank)
    return t[..., lo:hi]


def local_rows(token_masks: list, length: int, cp: int, rank: int,
               starts: Optional[list] = None) -> torch.Tensor:
    """Indices, among a replica's feature rows, of those whose tokens fall in CP rank ``rank``'s
    slice. ``token_masks``: per sample (in order), a bool ``[n]`` of the tokens that take a
    feature row; the rows are ordered sample by sample, token by token. ``starts``: each
    sample's first column in its row of ``length`` (packed rows); None: one padded row each."""
    lo, hi = bounds(length, cp, rank)
    out, seen = [], 0
    for i, m in enumerate(token_masks):
        idx = m.nonzero().flatten() + (0 if starts is None else starts[i])
        out.append(seen + ((idx >= lo) & (idx < hi)).nonzero().flatten())
        seen += idx.numel()
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# -- attention -----------------------------------------------------------------------------------

@dataclass
class CPContext:
    """What the attention function needs on one rank: the CP group, its size, this rank's
    index in it, and the communication counter."""

    group: object
    cp: int
    rank: int
    comm: object = None


def cp_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                 scaling: Optional[float] = None, sliding_window=None, **kwargs):
    """transformers attention function (``[B, H, S_local, hd]`` in, ``[B, S_local, H, hd]`` out):
    all-to-all to head shards, causal attention over the whole sequence (packed rows: over each
    of its segments, `SEGMENTS_KWARG`), all-to-all back."""
    from ray_dhp.parallel.segments import SEGMENTS_KWARG

    ctx: CPContext = getattr(module, "_ray_dhp_cp", None)
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__} has no context-parallel group; the "
                           f"'{ATTN_NAME}' attention needs install_context_parallel()")
    if sliding_window is not None:
        raise ValueError("context parallelism does not cover sliding-window attention")
    p = dropout if module.training else 0.0
    segments = kwargs.get(SEGMENTS_KWARG)
    if query.shape[1] % ctx.cp:  # the heads run out: ring attention instead
        out = _ring(query, key, value, ctx, segments, scaling, p)
        return out.transpose(1, 2).contiguous(), None
    s = query.shape[2]
    uc = UlyssesContext(group=ctx.group, seq_lens=[s] * ctx.cp, rank=ctx.rank, comm=ctx.comm, tag=_TAG)
    if key.shape[1] % ctx.cp:  # too few KV heads: repeat them to the query heads (GQA-exact)
        rep = query.shape[1] // key.shape[1]
        key, value = (x.repeat_interleave(rep, dim=1) for x in (key, value))

    def to_heads(x):  # [B, H, S_l, hd] -> [B, H / cp, S, hd]
        return seq_to_heads(x.permute(2, 0, 1, 3), uc).permute(1, 2, 0, 3)

    q, k, v = to_heads(query), to_heads(key), to_heads(value)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if segments is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=p)
    else:
        out = segment_attention(q, k, v, segments, scaling, p)
    out = heads_to_seq(out.permute(2, 0, 1, 3), uc)  # [S_l, B, H, hd]
    return out.transpose(0, 1).contiguous(), None


def segment_attention(q, k, v, cu_seqlens: torch.Tensor, scale: Optional[float] = None,
                      dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of ``[R, H, L, hd]`` packed rows within each segment (``cu_seqlens`` over
    the row-major ``R x L`` tokens; segments never cross rows): one SDPA call per segment, each
    from the segment's first token, so no token sees another sample and no ``L x L`` mask is
    built. (A varlen flash kernel would take the same boundaries on GPU.)"""
    rows, length = q.shape[0], q.shape[2]
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != rows * length:
        raise ValueError(f"packed segments cover {cu[-1] - cu[0]} tokens, the rows {rows} x {length}")
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        r, lo, hi = a // length, a % length, b - (a // length) * length
        if hi > length:
            raise ValueError(f"packed segment [{a}, {b}) crosses the end of row {r} (length {length})")
        out.append(F.scaled_dot_product_attention(q[r:r + 1, :, lo:hi], k[r:r + 1, :, lo:hi],
                                                  v[r:r + 1, :, lo:hi], is_causal=True,
                                                  scale=scale, dropout_p=dropout))
    by_row = [[] for _ in range(rows)]
    for (a, _), o in zip(zip(cu[:-1], cu[1:]), out):
        by_row[a // length].append(o)
    return torch.cat([torch.cat(parts, dim=2) for parts in by_row], dim=0)


# -- beyond the heads: ring attention (`ray_dhp.parallel.ring`) ----------------------------------

def _ring(query, key, value, ctx: "CPContext", segments=None, scale=None, dropout: float = 0.0):
    """`ray_dhp.parallel.ring.ring_attention` of the rank's slice (``[B, H, S_l, hd]`` q,
    ``[B, Hkv, S_l, hd]`` k and v; ``[B, H, S_l, hd]`` out): the form where the heads do not
    split over cp. Packed rows: each token's sample number (``segments`` over the B x S tokens)."""
    from ray_dhp.parallel.ring import ring_attention

    if dropout:
        raise ValueError("context parallelism beyond the attention heads (ring attention) does "
                         "not cover attention dropout; set the model's attention_dropout to 0")
    b, _, s, _ = query.shape
    ids = None if segments is None else _segment_ids(segments, b, s * ctx.cp)
    return ring_attention(query, key, value, ctx.group, ctx.cp, ctx.rank, ids, scale, ctx.comm)


def _segment_ids(cu_seqlens: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``[R, L]``: each packed token's segment number (``cu_seqlens`` over the ``R x L`` tokens)."""
    cu = cu_seqlens.to("cpu", torch.long)
    if int(cu[-1]) != rows * length:
        raise ValueError(f"packed segments cover {int(cu[-1])} tokens, the rows {rows} x {length}")
    ids = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    return ids.view(rows, length)


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTN_NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, cp_attention)
    if ATTN_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:  # the model builds a mask; it goes unused
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)


def install_context_parallel(language_model: torch.nn.Module, group, cp: int, rank: int,
                             comm=None, mixers: tuple = (), tp: int = 1, packed: bool = False) -> None:
    """Select the CP attention for ``language_model`` (its config only) and give every module
    that reads that config (its attention layers) the CP group; head-shard the family's
    stateful ``mixers`` (`FamilySpec.cp_mixers`, inside the TP rank's ``1 / tp`` of heads;
    ``packed``: their every call brings the packed segments)."""
    _register()
    config = language_model.config
    ctx = CPContext(group, cp, rank, comm)
    for m in language_model.modules():
        if getattr(m, "config", None) is config:
            m._ray_dhp_cp = ctx
    config._attn_implementation = ATTN_NAME
    if mixers:  # stateful mixers: the whole sequence for 1/cp of their heads
        from ray_dhp.parallel.context_mixers import install_mixer_heads

        install_mixer_heads(language_model, mixers, group, cp, rank, tp, comm, packed)
