"""Ulysses sequence parallelism for vision attention (DeepSpeed-Ulysses, Jacobs et al. 2023).

Each sequence-parallel (SP) rank holds a contiguous slice of the packed patch sequence. Around
attention, an all-to-all turns the sequence sharding into a head sharding (every rank then sees
the whole sequence for ``H / sp`` heads), attention runs per segment of the *global*
``cu_seqlens``, and a second all-to-all turns the head sharding back into sequence sharding.
Ranks may hold different numbers of tokens (including zero): the all-to-alls use variable split
sizes.

The attention forward is installed per module instance (``attn.forward`` is overridden), so
parameter names and ``state_dict`` keys stay exactly those of the transformers model.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.comm import CommCounter, record

__all__ = [
    "UlyssesContext",
    "all_to_all_rows",
    "seq_to_heads",
    "heads_to_seq",
    "install_ulysses_attention",
    "ulysses_attention_forward",
]

_COMM_TAG = "vision.sp"


@dataclass
class UlyssesContext:
    """What one full-attention call needs to communicate (passed per call, never stored globally).

    Args:
        group: the SP process group.
        seq_lens: tokens held by each SP rank (group-rank order = processing order).
        rank: this process's rank inside ``group``.
        comm: optional counter; every all-to-all is recorded as ``("all_to_all", tag)``.
        tag: the counter's label (``"vision.sp"``; the LM's context parallelism: ``"text.cp"``).
    """

    group: dist.ProcessGroup
    seq_lens: list[int]
    rank: int
    comm: Optional[CommCounter] = None
    tag: str = _COMM_TAG

    @property
    def sp(self) -> int:
        return len(self.seq_lens)

    @property
    def local_len(self) -> int:
        return self.seq_lens[self.rank]


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group, comm, tag=_COMM_TAG) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    record(comm, "all_to_all", tag, x)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Variable-split all-to-all along dim 0.

    Forward: ``all_to_all_single`` sending ``send[j]`` rows to rank j and receiving ``recv[i]``
    rows from rank i. Backward: the same all-to-all with ``send``/``recv`` swapped (its adjoint).
    Source: DeepSpeed-Ulysses (Jacobs et al. 2023), sequence<->head re-sharding.
    """

    @staticmethod
    def forward(ctx, x, send, recv, group, comm, tag):
        ctx.send, ctx.recv, ctx.group, ctx.comm, ctx.tag = send, recv, group, comm, tag
        return _a2a(x, send, recv, group, comm, tag)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.recv, ctx.send, ctx.group, ctx.comm, ctx.tag), None, None, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group, comm=None,
                    tag: str = _COMM_TAG) -> torch.Tensor:
    """Autograd-aware variable-split all-to-all along dim 0 (see ``_AllToAllRows``)."""
    return _AllToAllRows.apply(x, list(send), list(recv), group, comm, tag)


def seq_to_heads(x: torch.Tensor, ctx: UlyssesContext) -> torch.Tensor:
    """Sequence-sharded ``[S_local, *mid, H, hd]`` -> head-sharded ``[S_total, *mid, H/sp, hd]``.

    Forward: all-to-all (head group j goes to rank j); backward: the reverse all-to-all
    (``heads_to_seq``). DeepSpeed-Ulysses (Jacobs et al. 2023).
    """
    s, sp = x.shape[0], ctx.sp
    *mid, heads, hd = x.shape[1:]
    x = x.reshape(s, *mid, sp, heads // sp, hd).movedim(-3, 0)  # [sp, S_local, *mid, H/sp, hd]
    x = x.reshape(sp * s, *mid, heads // sp, hd)
    return all_to_all_rows(x, [s] * sp, ctx.seq_lens, ctx.group, ctx.comm, ctx.tag)


def heads_to_seq(y: torch.Tensor, ctx: UlyssesContext) -> torch.Tensor:
    """Head-sharded ``[S_total, *mid, H/sp, hd]`` -> sequence-sharded ``[S_local, *mid, H, hd]``.

    Forward: all-to-all (sequence slice i goes to rank i); backward: the reverse all-to-all
    (``seq_to_heads``). DeepSpeed-Ulysses (Jacobs et al. 2023).
    """
    s, sp = ctx.local_len, ctx.sp
    *mid, h, hd = y.shape[1:]
    y = all_to_all_rows(y, ctx.seq_lens, [s] * sp, ctx.group, ctx.comm, ctx.tag)  # [sp * S_local, ...]
    y = y.reshape(sp, s, *mid, h, hd).movedim(0, -3)  # [S_local, *mid, sp, h, hd]
    return y.reshape(s, *mid, sp * h, hd)


def _model_functions(attn: torch.nn.Module):
    """The rotary and eager-attention functions of the attention module's own modeling file."""
    module = sys.modules[type(attn).__module__]
    return module.apply_rotary_pos_emb_vision, module.eager_attention_forward


def _attention_interface(attn):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils.generic import is_flash_attention_requested

    eager = sys.modules[type(attn).__module__].eager_attention_forward  # its modeling file's
    impl = attn.config._attn_implementation
    if is_flash_attention_requested(attn.config):
        impl = "sdpa"  # the varlen kernel is called directly (``_flash_varlen``); else masked SDPA
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)


def _flash_varlen(attn, q, k, v, cu_seqlens: torch.Tensor, max_len: int) -> Optional[torch.Tensor]:
    """flash-attn's varlen kernel (all segments, one call) when it is installed, the tensors are
    on a GPU in half precision and the config asks for flash attention; else ``None``."""
    from transformers.utils.generic import is_flash_attention_requested

    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and is_flash_attention_requested(attn.config)):
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    cu = cu_seqlens.to(dtype=torch.int32).to(q.device, non_blocking=True)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=attn.scaling,
                                  dropout_p=attn.attention_dropout if attn.training else 0.0)


def segment_index(lengths: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index ``[n_seg, L_max]`` of each segment padded to the longest (pad slots point at
    token 0) and the ``[n_seg, L_max]`` validity mask, for one batched attention call."""
    longest = max(lengths)
    lens = torch.tensor(lengths, device=device)
    starts = torch.cumsum(lens, 0) - lens
    slot = torch.arange(longest, device=device)
    valid = slot[None, :] < lens[:, None]
    return torch.where(valid, starts[:, None] + slot[None, :], 0), valid


def _padded_attention(attn, interface, q, k, v, lengths: list[int]) -> torch.Tensor:
    """One interface call on all segments of ``lengths`` stacked as a batch, each padded to the
    longest with the pad keys masked out (additive mask: exactly zero weight). Pad queries attend
    to their segment's real keys; their rows are dropped, so they add exact zeros to the gradients.
    ``[S, h, hd]`` in, ``[S, h, hd]`` out."""
    n, longest = len(lengths), max(lengths)
    mask = valid = None
    if all(x == longest for x in lengths):  # equal windows / frames: a view, no copy, no mask
        q, k, v = (t.view(n, longest, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    else:
        idx, valid = segment_index(lengths, q.device)
        q, k, v = (t[idx].transpose(1, 2) for t in (q, k, v))  # [n_seg, h, L_max, hd]
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(~valid, torch.finfo(q.dtype).min)[:, None, None, :]
    out = interface(attn, q, k, v, attention_mask=mask, scaling=attn.scaling,
                    dropout=0.0 if not attn.training else attn.attention_dropout, is_causal=False)[0]
    if valid is None:
        return out.reshape(n * longest, *out.shape[2:])
    return out[valid]  # [n_seg, L_max, h, hd] -> valid rows in segment order = [S, h, hd]


def _length_groups(lengths: list[int], max_pad: float) -> list[list[int]]:
    """Segment ids grouped so that each group pads to its longest with at most ``max_pad`` times
    its real tokens: one group (one call) when the lengths are close — windows, equal frames."""
    if len(lengths) * max(lengths) <= max_pad * sum(lengths):
        return [list(range(len(lengths)))]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return list(groups.values())


def _segment_attention(attn, q, k, v, cu_seqlens: torch.Tensor, batched: bool = True,
                       max_pad: float = 2.0) -> torch.Tensor:
    """Attention per segment of ``cu_seqlens`` on ``[S, h, hd]`` tensors, like transformers'
    non-flash vision path (same attention interface, same scaling). Returns ``[S, h, hd]``.

    ``batched`` (default): all segments in one kernel call — flash-attn varlen when available
    (GPU, half precision, flash requested), else one padded+masked SDPA/eager call (segments of
    very different lengths, e.g. a big and a small image, go in one call per length so padding
    never more than doubles the work). ``batched=False``: the per-segment loop (the reference the
    benchmark compares with)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    lengths = [n for n in lengths if n > 0]
    if q.shape[0] == 0 or not lengths:
        return q  # no tokens here: an empty tensor that keeps the autograd graph connected
    interface = _attention_interface(attn)
    if not batched:
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, S, hd]
        outs = [
            interface(attn, qs, ks, vs, attention_mask=None, scaling=attn.scaling,
                      dropout=0.0 if not attn.training else attn.attention_dropout, is_causal=False)[0]
            for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]
        return torch.cat(outs, dim=1).squeeze(0)  # [S, h, hd]
    flash = _flash_varlen(attn, q, k, v, cu_seqlens, max(lengths))
    if flash is not None:
        return flash
    groups = _length_groups(lengths, max_pad)
    if len(groups) == 1:
        return _padded_attention(attn, interface, q, k, v, lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out = q.new_empty(q.shape)
    for ids in groups:
        tok = torch.cat([torch.arange(starts[i], starts[i + 1], device=q.device) for i in ids])
        out = out.index_copy(0, tok, _padded_attention(attn, interface, q[tok], k[tok], v[tok],
                                                       [lengths[i] for i in ids]))
    return out


def ulysses_attention_forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                              position_embeddings=None, max_seqlen=None,
                              ulysses: Optional[UlyssesContext] = None, **kwargs) -> torch.Tensor:
    """Forward of a vision attention module (qkv, rotary, ``cu_seqlens`` segments, ``proj``)
    with optional Ulysses sequence parallelism.

    local qkv -> rotary with the local cos/sin -> (all-to-all to ``[S_total, 3, H/sp, hd]``) ->
    attention per segment of ``cu_seqlens`` -> (all-to-all back) -> local ``proj``.
    With ``ulysses=None`` it is local attention and ``cu_seqlens`` are local offsets (window
    blocks, or sp == 1); with a context, ``cu_seqlens`` are the global offsets in processing order.
    """
    rotary, _ = _model_functions(self)
    s, heads, hd = hidden_states.shape[0], self.num_heads, self.head_dim
    q, k, v = _project_qkv(self, hidden_states, s, heads, hd)
    cos, sin = position_embeddings
    q, k = rotary(q, k, cos, sin)
    if ulysses is not None and ulysses.sp > 1:
        q, k, v = seq_to_heads(torch.stack([q, k, v], dim=1), ulysses).unbind(1)
    out = _segment_attention(self, q, k, v, cu_seqlens, batched=getattr(self, "batched_segments", True))
    if ulysses is not None and ulysses.sp > 1:
        out = heads_to_seq(out, ulysses)
    return self.proj(out.reshape(s, heads * hd))


def _project_qkv(attn, hidden_states: torch.Tensor, s: int, heads: int, hd: int):
    """``q, k, v`` (each ``[s, heads, hd]``) from a fused ``qkv`` linear or from separate
    ``q`` / ``k`` / ``v`` linears (the towers differ), as the module's own forward
    computes them."""
    if hasattr(attn, "qkv"):
        return attn.qkv(hidden_states).reshape(s, 3, heads, hd).unbind(1)
    return tuple(getattr(attn, n)(hidden_states).reshape(s, heads, hd) for n in ("q", "k", "v"))


def install_ulysses_attention(attn: torch.nn.Module, sp: int = 1) -> None:
    """Override ``attn.forward`` (this instance only) with ``ulysses_attention_forward``.

    Idempotent; parameter names are unchanged. Raises if the head count is not divisible by sp.
    """
    if attn.num_heads % sp:
        raise ValueError(f"vision num_heads={attn.num_heads} is not divisible by the vision sequence-parallel "
                         f"degree sp={sp}; choose a sequence_parallel degree that divides {attn.num_heads}.")
    if getattr(attn, "_ray_dhp_ulysses", False):
        return
    attn.forward = types.MethodType(ulysses_attention_forward, attn)
    attn._ray_dhp_ulysses = True
