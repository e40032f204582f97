"""Ring attention for the LM's context parallelism where the heads run out (`ray_dhp.parallel.context`).

Where ``tp x cp`` does not divide the attention heads, Ulysses' all-to-all cannot give each CP
rank whole heads; every rank then keeps all of its heads and its own queries, and the key/value
blocks travel around the CP group (ring attention, Liu et al. 2023): at step ``t`` rank ``r``
attends its queries to the block of rank ``r - t`` while it sends that block to ``r + 1`` and
receives the next one from ``r - 1`` (both posted before the step's compute). Each block's
partial result is merged by its log-sum-exp (online softmax, as flash attention merges its
tiles). `RingAttention`'s backward recomputes every block's scores (nothing quadratic is saved),
and the keys' and values' gradient accumulator travels around the ring with its block, so it is
back at the block's owner after ``cp`` steps. A rank holds two K/V blocks (the current one and
the one arriving) in the forward, those and two gradient accumulators in the backward: never
``cp`` copies of the sequence.

Causal load balance without changing the sequence slice. Outside attention every CP rank keeps
its contiguous slice (`ray_dhp.parallel.context.slice_sequence`: positions, targets, the
boundary's feature rows, the stateful mixers all follow it). With contiguous slices the last
rank's queries see the whole sequence and the first rank's only its own slice. Inside attention
rank ``r`` swaps the *second half* of its slice (queries, keys and values in one message) with
rank ``cp - 1 - r`` (`mirror_swap`; the middle rank of an odd CP degree keeps its own): it then
holds chunk ``2r`` and chunk ``2cp - 1 - 2r`` of the ``2cp`` half-slices, a low chunk and its
mirror. Every step of the ring then costs every rank the same two chunk pairs (of the four its
two query chunks and the block's two key chunks make, exactly one low/low-or-high/high pair and
one low/high pair are causal; the diagonal step: the two diagonal halves and one full pair),
as zigzag chunking does. Zigzag itself (chunks ``r`` and ``2cp - 1 - r``) would need every
chunk but rank 0's first to move, by an all-to-all of q, k, v and the output (Ulysses' traffic
on top of the ring's); the mirror swap moves half of each rank's q, k, v and output once, to
one peer. Odd slice lengths split into unequal halves; the masks follow the true positions.

Each chunk pair runs in tiles of at most `TILE` x `TILE` positions, merged like the blocks, so
the scores a kernel call materialises stay bounded however long the slice (a fused kernel that
returns its log-sum-exp, e.g. flash attention's, would take the tile's place on a GPU).
Masks: causal by global position inside a tile pair that straddles the diagonal (pairs wholly
in the future are skipped, wholly in the past run unmasked); packed rows (``cu_seqlens``) add
"same sample" by each token's segment number, so no token attends across a sample. Grouped-query
attention: the blocks carry the KV heads only; each is broadcast over its query-head group in
the kernel and its gradient summed over the group.

Point-to-point under NCCL: every exchange posts, per peer in ascending rank order, the send
first to a higher peer and the receive first from a lower one (`exchange_order`, the rule the
boundary uses), so no pair has both sides receive first and the pair communicators are created
in a chain, never a cycle. Every rank of the CP group posts the same sequence of exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.comm import CommCounter, exchange_order, record

__all__ = ["RingContext", "mirror_chunks", "ring_attention"]

_TAG = "text.cp.ring"
_SWAP_TAG = "text.cp.swap"


@dataclass
class RingContext:
    """One ring-attention call: the CP group, its size, this rank's index in it, the counter,
    the slice length, the softmax scale and the packed rows' segment numbers (``[B, S]``)."""

    group: object
    cp: int
    rank: int
    length: int  # the rank's slice (S / cp)
    scale: float
    segment_ids: Optional[torch.Tensor] = None
    comm: Optional[CommCounter] = None

    def peer(self, i: int) -> int:
        """The global rank of CP rank ``i``."""
        return dist.get_global_rank(self.group, i) if self.group is not None else i


def _exchange(ctx: RingContext, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
              tag: str) -> list:
    """Post the send of ``send`` to CP rank ``dst`` and the receive into ``recv`` from ``src``
    in `exchange_order`; returns the works (the caller waits)."""
    works = []
    for kind, peer in exchange_order(ctx.rank, {dst: send}, {src: recv}):
        if kind == "send":
            works.append(dist.isend(send, dst=ctx.peer(peer), group=ctx.group))
        else:
            works.append(dist.irecv(recv, src=ctx.peer(peer), group=ctx.group))
    record(ctx.comm, "p2p", tag, send)
    return works


# -- the mirror layout ---------------------------------------------------------------------------

def mirror_chunks(rank: int, cp: int, length: int) -> list:
    """``[(lo, hi, offset)]``: the global positions ``[lo, hi)`` of the two chunks CP rank
    ``rank`` holds inside attention, and where each starts in its local rows: the first half of
    its own slice and the second half of rank ``cp - 1 - rank``'s."""
    h, p = length // 2, cp - 1 - rank
    return [(rank * length, rank * length + h, 0), (p * length + h, (p + 1) * length, h)]


class _MirrorSwap(torch.autograd.Function):
    """Forward: swap the second half (dim 2) of each tensor with CP rank ``cp - 1 - rank`` in
    one message. Backward: the same swap of the gradients (a swap is its own adjoint)."""

    @staticmethod
    def forward(fctx, ctx, *xs):
        fctx.ring = ctx
        return _swap(ctx, xs)

    @staticmethod
    def backward(fctx, *grads):
        return (None, *_swap(fctx.ring, grads))


def _swap(ctx: RingContext, xs) -> tuple:
    partner, h = ctx.cp - 1 - ctx.rank, ctx.length // 2
    if partner == ctx.rank:
        return tuple(x.clone() for x in xs)
    send = torch.cat([x[:, :, h:].reshape(-1) for x in xs])
    recv = torch.empty_like(send)
    for work in _exchange(ctx, send, partner, recv, partner, _SWAP_TAG):
        work.wait()
    out, at = [], 0
    for x in xs:
        n = x[:, :, h:].numel()
        tail = recv[at:at + n].view(*x.shape[:2], x.shape[2] - h, *x.shape[3:])
        out.append(torch.cat([x[:, :, :h], tail], dim=2))
        at += n
    return tuple(out)


def mirror_swap(ctx: RingContext, *xs) -> tuple:
    """``xs`` (``[B, heads, S_local, hd]`` each) in the mirror layout (`mirror_chunks`) and back."""
    return _MirrorSwap.apply(ctx, *xs)


# -- one block pair --------------------------------------------------------------------------------

def pair_mask(ctx: RingContext, qc: tuple, kc: tuple, device=None):
    """``(run, mask)`` for query chunk ``qc`` against key chunk ``kc`` (`mirror_chunks` entries):
    run False when every key is after every query; mask None when no pair is masked, else a
    bool ``[B or 1, 1, 1, Sq, Sk]`` (causal by position, and the same sample when packed)."""
    (qlo, qhi, _), (klo, khi, _) = qc, kc
    if qhi <= qlo or khi <= klo or klo >= qhi:
        return False, None
    mask = None
    if khi - 1 > qlo:  # straddles the diagonal
        qpos = torch.arange(qlo, qhi, device=device)
        kpos = torch.arange(klo, khi, device=device)
        mask = (kpos[None, :] <= qpos[:, None])[None, None, None]
    if ctx.segment_ids is not None:
        seg = ctx.segment_ids
        same = (seg[:, qlo:qhi, None] == seg[:, None, klo:khi])[:, None, None]
        mask = same if mask is None else mask & same
    return True, mask


def block_forward(q, k, v, mask, scale: float):
    """Attention of ``q`` ``[B, G, R, Sq, hd]`` to ``k``, ``v`` ``[B, G, 1, Sk, hd]`` (G KV heads,
    R query heads each): ``(out, lse)``, fp32 at least; a row with every key masked has lse -inf
    and output 0."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    return torch.matmul(p.to(v.dtype), v).to(acc), lse


def block_backward(q, k, v, mask, scale: float, lse, d_out, delta):
    """``(dq, dk, dv)`` of one block from the final ``lse`` and ``delta = rowsum(dO * O)``: the
    scores recomputed, dK and dV summed over each KV head's query heads."""
    acc = lse.dtype
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), d_out).sum(2, keepdim=True)
    ds = p * (torch.matmul(d_out, v.to(acc).transpose(-1, -2)) - delta[..., None]) * scale
    dq = torch.matmul(ds, k.to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)).sum(2, keepdim=True)
    return dq, dk, dv


def _merge(out, lse, o, l, sl: slice) -> None:
    """Fold one block's ``(o, l)`` into the running ``out[..., sl, :]``, ``lse[..., sl]``."""
    old = lse[..., sl]
    new = torch.logaddexp(old, l)
    safe = new.masked_fill(torch.isinf(new), 0)
    out[..., sl, :] = out[..., sl, :] * torch.exp(old - safe)[..., None] + o * torch.exp(l - safe)[..., None]
    lse[..., sl] = new


TILE = 1024  # rows and columns of one kernel call: its scores are at most TILE x TILE per head


def _tiles(chunks: list) -> list:
    """The chunks cut into tiles of at most `TILE` positions (same ``(lo, hi, offset)`` form)."""
    return [(lo + i, min(lo + i + TILE, hi), off + i) for lo, hi, off in chunks
            for i in range(0, hi - lo, TILE)]


def _pairs(ctx: RingContext, src: int, device):
    """The causal tile pairs of this rank's queries with ``src``'s block: ``(qs, ks, mask)``."""
    for qc in _tiles(mirror_chunks(ctx.rank, ctx.cp, ctx.length)):
        for kc in _tiles(mirror_chunks(src, ctx.cp, ctx.length)):
            run, mask = pair_mask(ctx, qc, kc, device)
            if run:
                yield slice(qc[2], qc[2] + qc[1] - qc[0]), slice(kc[2], kc[2] + kc[1] - kc[0]), mask


# -- the ring ---------------------------------------------------------------------------------------

class RingAttention(torch.autograd.Function):
    """Causal ring attention over the CP group, the mirror layout's ``q`` ``[B, G, R, S_l, hd]``
    and ``k``, ``v`` ``[B, G, 1, S_l, hd]`` in, ``[B, G, R, S_l, hd]`` out. Forward: ``cp`` steps,
    each sending the K/V block to the next CP rank and receiving the previous rank's (posted
    before the step's compute), the blocks merged by log-sum-exp. Backward: the same ring again
    with the scores recomputed per block; the block's dK/dV accumulator is passed on after each
    step's compute and arrives back at the block's owner after the last one. Liu et al. 2023."""

    @staticmethod
    def forward(fctx, q, k, v, ctx: RingContext):
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
        kv = torch.stack([k, v])
        nxt, prev = (ctx.rank + 1) % ctx.cp, (ctx.rank - 1) % ctx.cp
        for t in range(ctx.cp):
            src = (ctx.rank - t) % ctx.cp
            works, arriving = [], None
            if t < ctx.cp - 1:
                arriving = torch.empty_like(kv)
                works = _exchange(ctx, kv, nxt, arriving, prev, _TAG)
            for qs, ks, mask in _pairs(ctx, src, q.device):
                o, l = block_forward(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], mask, ctx.scale)
                _merge(out, lse, o, l, qs)
            for work in works:
                work.wait()
            kv = arriving
        out = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ring = ctx
        return out

    @staticmethod
    def backward(fctx, d_out):
        q, k, v, out, lse = fctx.saved_tensors
        ctx = fctx.ring
        acc = lse.dtype
        d_out = d_out.to(acc)
        delta = (d_out * out.to(acc)).sum(-1)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=acc)
        nxt, prev = (ctx.rank + 1) % ctx.cp, (ctx.rank - 1) % ctx.cp
        for t in range(ctx.cp):
            src = (ctx.rank - t) % ctx.cp
            works, arriving = [], None
            if t < ctx.cp - 1:
                arriving = torch.empty_like(kv)
                works = _exchange(ctx, kv, nxt, arriving, prev, _TAG)
            for qs, ks, mask in _pairs(ctx, src, q.device):
                g = block_backward(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], mask,
                                   ctx.scale, lse[..., qs], d_out[..., qs, :], delta[..., qs])
                dq[..., qs, :] += g[0]
                dkv[0][..., ks, :] += g[1]
                dkv[1][..., ks, :] += g[2]
            grads = torch.empty_like(dkv)
            works += _exchange(ctx, dkv, nxt, grads, prev, _TAG)
            for work in works:
                work.wait()
            kv, dkv = arriving, grads
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(query, key, value, group, cp: int, rank: int, segment_ids=None,
                   scale: Optional[float] = None, comm=None) -> torch.Tensor:
    """Causal attention of the rank's contiguous slice ``query`` ``[B, H, S_l, hd]`` against the
    whole sequence's keys and values (``[B, Hkv, S_l, hd]`` each, Hkv dividing H) by ring
    attention in the mirror layout; ``[B, H, S_l, hd]`` out, in the slice's order.
    ``segment_ids``: ``[B, S]`` sample numbers of packed rows (None: one sample per row)."""
    b, heads, s, hd = query.shape
    g = key.shape[1]
    if segment_ids is not None:
        segment_ids = segment_ids.to(query.device)
    ctx = RingContext(group, cp, rank, s, hd ** -0.5 if scale is None else scale,
                      segment_ids, comm)
    q, k, v = mirror_swap(ctx, query, key, value)
    out = RingAttention.apply(q.view(b, g, heads // g, s, hd), k.unsqueeze(2), v.unsqueeze(2), ctx)
    return mirror_swap(ctx, out.view(b, heads, s, hd))[0]
