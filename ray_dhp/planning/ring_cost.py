"""The planner's view of the LM's ring attention (`ray_dhp.parallel.ring`): the form context
parallelism takes where ``tp x cp`` does not divide the attention heads.

Per layer and CP rank, with ``n`` the rank's tokens (``tokens / cp``), ``d`` the activation
element size, ``a`` the kernel's accumulator size (fp32 at least), ``q`` the query width and
``kv`` one of the key/value widths of the TP rank (``heads x hd / tp``, ``kv heads x hd / tp``):

* working set (`ring_working_bytes`, transient; the swapped q, k, v, the output and the
  log-sum-exp are the saved activations, the same bytes Ulysses' all-to-all outputs are;
  measured within 0.1% at CP3, tests/distributed/test_context_parallel.py): the
  mirror swap's send and receive halves of q, k and v (``n d (q + 2 kv)``), then in the
  backward two K/V blocks and two dK/dV accumulators in flight (``4 x 2 n kv`` at ``a``), the
  dq accumulator (``n q a``) and one tile pair's scores, probabilities and their gradient
  (``3 x rows x heads/tp x min(TILE, S_l / 2)^2 x a``, `ray_dhp.parallel.ring.TILE`). Against
  torch's profiler on the ring alone, with the saved bytes: 13% under the measured peak (the
  interior ranks peak about one K/V block above ranks 0 and cp - 1; not attributed yet; tests/distributed/test_ring_attention.py).
* bytes sent (`ring_sent_bytes`): the forward passes ``cp - 1`` K/V blocks, the backward
  ``cp - 1`` K/V blocks and ``cp`` dK/dV blocks (at ``a``), each way the swap sends half of q,
  k, v and half of the output (their gradients in the backward); the recomputation under
  activation checkpointing runs the forward's again.
"""

from __future__ import annotations

from ray_dhp.parallel.ring import TILE

__all__ = ["ring_form", "ring_sent_bytes", "ring_working_bytes"]


def ring_form(tc, tp: int, cp: int) -> bool:
    """Whether ``text.context_parallel=cp`` runs as ring attention at ``tp``: the TP rank's
    attention heads do not split over cp (`ray_dhp.parallel.context.cp_attention`)."""
    return cp > 1 and (tc.num_attention_heads // tp) % cp != 0


def _widths(tc, tp: int) -> tuple:
    hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return tc.num_attention_heads * hd / tp, max(tc.num_key_value_heads // tp, 1) * hd


def ring_working_bytes(tc, tokens: float, tp: int, cp: int, d: int,
                       sample_tokens: float = None) -> float:
    """One layer's transient bytes of ring attention on one rank (module docstring); ``tokens``
    of the replica, ``sample_tokens`` per row (default: one row)."""
    q, kv = _widths(tc, tp)
    a, n = max(d, 4), tokens / cp
    row = (sample_tokens or tokens) / cp
    tile = min(TILE, row / 2)
    scores = 3 * (n / row) * tc.num_attention_heads / tp * tile ** 2 * a
    return n * d * (q + 2 * kv) + n * a * (8 * kv + q) + scores


def ring_sent_bytes(tc, tokens: float, tp: int, cp: int, d: int, checkpointing: bool) -> float:
    """Bytes one rank sends per layer for ``tokens`` of its replica (forward, backward, and the
    recomputed forward with ``checkpointing``; module docstring)."""
    q, kv = _widths(tc, tp)
    a, n = max(d, 4), tokens / cp
    block = 2 * n * kv
    forward = (cp - 1) * block * d + n / 2 * (2 * q + 2 * kv) * d
    backward = (cp - 1) * block * d + cp * block * a + n / 2 * (2 * q + 2 * kv) * d
    return forward * (2 if checkpointing else 1) + backward
