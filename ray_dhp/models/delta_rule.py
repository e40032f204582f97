"""The chunked gated delta rule with its recurrent state reset at given chunks: packed rows of a
Gated DeltaNet mixer in the aligned layout (`ray_dhp.parallel.segments.segment_layout`, every
segment starting at a chunk) compute each segment as the stock recurrence computes it alone.

Same per-chunk math as transformers' ``torch_chunk_gated_delta_rule`` (the torch path of
``chunk_gated_delta_rule``, transformers 5.18-5.25: fp32 inputs, optional L2-normalised
``q``/``k``, ``q`` scaled by ``dk ** -0.5``, the sequence zero-padded to whole chunks, the UT
system solved per chunk, a sequential scan over chunks); the one change is in the scan: before
chunk ``i`` of a row whose ``starts`` mark a segment start in that chunk, the row's state is
zero. Inside a chunk everything is causal (lower triangular), so a segment's tokens never read
the tokens after its end that share its last chunk, and its first chunk reads only the zero
state: fp64 outputs and gradients equal the stock function's per segment to rounding (~1e-16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["COMPUTE_DTYPE", "chunk_gated_delta_rule_with_resets", "scan_chunks"]

# transformers' torch recurrence computes in fp32 whatever its inputs' dtype; so does this one.
# Its fp32 backward rounds by the tensors' sizes and layout (one ulp moves with the rows a segment
# sits in), so fp64 exactness tests set float64 here and run it in the stock one's place too.
COMPUTE_DTYPE = torch.float32


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_resets(starts: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, L]`` segment starts -> ``[B, ceil(L / chunk)]``: whether chunk ``i`` starts a
    segment. Refuses a segment that does not start at a chunk (its first chunk would read the
    previous segment's tokens)."""
    b, length = starts.shape
    pad = (chunk_size - length % chunk_size) % chunk_size
    per_chunk = F.pad(starts, (0, pad)).view(b, -1, chunk_size)
    if bool(per_chunk[..., 1:].any()):
        raise ValueError(f"a packed segment starts inside a {chunk_size}-token chunk: lay the rows "
                         f"out with segment_layout(align={chunk_size})")
    return per_chunk[..., 0]


def scan_chunks(state, keep, new_values, k_cumdecay, query, intra, chunk_decay, key):
    """The sequential scan over chunks (dim 2 of the ``[B, H, chunks, ...]`` tensors; ``keep``
    ``[B, chunks]``: 0 where a segment starts, the state zeroed before that chunk). Returns the
    ``[B, H, chunks, chunk, dv]`` outputs and the last state.

    Chunk ``i`` of each tensor comes from one ``unbind`` per tensor, and the outputs are stacked
    once: one autograd node each, whose backward stacks the chunks' gradients. Indexing chunk
    ``i`` (``x[:, :, i]``) and writing into a preallocated output would instead build a full-size
    zero gradient per chunk and tensor, O(chunks²) work a packed row of many chunks pays (the same
    per-chunk arithmetic, so the values are the same bit for bit; `benchmarks/delta_rule_scan.py`)."""
    out = []
    per_chunk = zip(keep.unbind(1), new_values.unbind(2), k_cumdecay.unbind(2), query.unbind(2),
                    intra.unbind(2), chunk_decay.unbind(2), key.unbind(2))
    for kept, values_i, k_cumdecay_i, query_i, intra_i, decay_i, key_i in per_chunk:
        state = state * kept[:, None, None, None]  # a segment starts here: from a zero state
        v_new = values_i - k_cumdecay_i @ state
        out.append(query_i @ state + intra_i @ v_new)
        state = state * decay_i + key_i.transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2), state


def chunk_gated_delta_rule_with_resets(query, key, value, g, beta, starts=None,
                                       chunk_size: int = 64, initial_state=None,
                                       output_final_state: bool = False,
                                       use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """``torch_chunk_gated_delta_rule``'s arguments and results (``[B, L, H, d]`` inputs,
    ``g``/``beta`` ``[B, L, H]``) plus ``starts`` ``[B, L]`` (bool): the recurrent state is zero
    at every chunk holding a segment start (module docstring; None: the stock recurrence)."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("the resetting recurrence takes its segments as starts, not cu_seqlens")
    initial_dtype = query.dtype
    b, length, k_heads, dk = key.shape
    v_heads, dv = value.shape[-2:]
    if k_heads != v_heads:  # grouped values: each q/k head serves v_heads // k_heads value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, decay = [x.transpose(1, 2).to(COMPUTE_DTYPE, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    keep = (torch.ones(b, (length + pad) // chunk_size, dtype=query.dtype, device=query.device)
            if starts is None else (~chunk_resets(starts.to(query.device), chunk_size)).to(query.dtype))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        state = torch.zeros((b, v_heads, dk, dv), dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    out, state = scan_chunks(state, keep, new_values, k_cumdecay, query, intra, chunk_decay, key)
    out = out.reshape(b, v_heads, -1, dv)[:, :, :length]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)
