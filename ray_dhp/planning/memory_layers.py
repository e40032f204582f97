"""What an LM's layers save for backward beyond softmax attention and a dense MLP, for
`ray-dhp plan`'s text activations (`ray_dhp.planning.memory.text_activation_parts`):

* **other token mixers** (the family's `FamilySpec.text_mixer_saved`, e.g. a gated
  delta-rule mixer): those layers save the mixer's bytes in place of attention's q, k, v, output,
  log-sum-exp and per-head norms;
* **more norms** than the pre-norm block's two (post-attention and post-MLP norms, counted from the weights):
  each its fp32 input, ``rsqrt`` and normalised output;
* **sparse MLPs** (a `MoESpec`): in place of the dense ``intermediate_size`` MLP (or the
  replicated top-k width of an LM without one), per sparse layer and token on the rank, the
  router's fp32 probabilities, its top-k indices (int64), weights and their sum; per routed
  row (``top_k`` per token, the experts' share of the rank assumed balanced: the ranks of an EP
  group receive ``tokens x top_k`` rows on average, the measured ranks differ by the routing)
  the expert's input, its gate|up output, the activation and the product (``4 I``), the
  routing weight, two more ``h``-wide rows (the stock experts, ``expert_parallel: 1``,
  transformers' loop over the hit experts: the down projection's output and the weighted
  one; the engine's expert-parallel path, `ray_dhp.parallel.expert`: the rows the all-to-all
  returns and the weighted ones) and the int64 row indices (two per row, four under EP: the
  sorts and their inverses). Measured with ``saved_tensors_hooks`` on a sparse layer of the tiny families,
  stock and EP2 (exact for the router and per routed row), and in the plan-accuracy matrix
  (``benchmarks/plan_accuracy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class TextLayers:
    """The LM's layers that are not attention + dense MLP (module docstring)."""

    mixers: int = 0                         # layers whose token mixer is not attention
    mixer_saved: Optional[Callable] = None  # (text_config, rows, row_tokens, tp, d) -> bytes
    sparse: int = 0                         # layers with a sparse MLP
    experts: int = 0
    top_k: int = 0
    width: int = 0                          # an expert's intermediate width on the rank
    ep: int = 1                             # expert parallelism (1: the stock experts)
    norms: int = 2                          # RMSNorms per layer (`ParamCounts.text_block_norms`)
    sparse_layers: tuple = ()               # the sparse layers' indices


def text_layers(config, topology=None, counts=None) -> TextLayers:
    """`TextLayers` of ``config`` (a model config) under ``topology`` (expert parallelism and
    experts TP-sharded: their width ``1/tp``); ``counts`` (`ParamCounts`): its norms per layer."""
    from ray_dhp.models import family_of
    from ray_dhp.models.generic_moe import expert_widths

    family, tc = family_of(config), config.text_config
    moe = family.moe
    mixers = family.text_mixer_layers(tc) if family.text_mixer_saved else 0
    norms = counts.text_block_norms if counts is not None else 2
    if moe is None:
        return TextLayers(mixers, family.text_mixer_saved, norms=norms)
    tp = topology.text.inner if topology is not None and topology.text_expert_tp else 1
    return TextLayers(mixers, family.text_mixer_saved, len(moe.sparse_layers(tc)),
                      getattr(tc, moe.experts_key), tc.num_experts_per_tok,
                      max(expert_widths(tc)) // tp,  # a token's group: counted the widest
                      topology.text_expert_parallel if topology is not None else 1, norms,
                      tuple(moe.sparse_layers(tc)))


def routed_bytes(layers: TextLayers, h: int, tokens: float, d: int) -> float:
    """Bytes one sparse layer's router and routed experts save for ``tokens`` tokens."""
    e, k = layers.experts, layers.top_k
    return tokens * (4 * e + 12 * k + 4) + routed_rows_bytes(layers, h, tokens, d)


def routed_rows_bytes(layers: TextLayers, h: int, tokens: float, d: int) -> float:
    """The routed rows' part of `routed_bytes` (``top_k`` rows per token, module docstring)."""
    per_row = (32 if layers.ep > 1 else 16) + 3 * h * d + 4 * layers.width * d + d
    return tokens * layers.top_k * per_row


def layer_extra(layers: TextLayers, tc, tokens: float, row_tokens: float, tp: int, d: int,
                attention: float, mlp: float, norm: float, one: bool = False,
                gathered: float = 0.0) -> float:
    """What the LM's layers save beyond ``layers x (two norms + attention + mlp)``:
    ``attention`` and ``mlp``, the bytes one attention mixer and one sparse layer's MLP were
    counted with; ``norm``: one norm's own (its output is not an input a projection keeps:
    the residual's post-norms). ``one``: what the largest single layer saves beyond
    one such layer (the block recomputed at a time under activation checkpointing).
    ``gathered``: under text SP a sparse block runs on the all-gathered sequence, whose whole
    ``h``-wide copy it keeps (the MoE text SP row of `benchmarks/plan_accuracy.py`: text 0.948
    without it, 0.969 with)."""
    norms = (layers.norms - 2) * norm
    mixer = sparse = 0.0
    if layers.mixers:
        mixer = layers.mixer_saved(tc, tokens / row_tokens, row_tokens, tp, d) - attention
    if layers.sparse:
        sparse = routed_bytes(layers, tc.hidden_size, tokens, d) - mlp + gathered
    if one:
        return norms + max(mixer, 0.0) + max(sparse, 0.0)
    return tc.num_hidden_layers * norms + layers.mixers * mixer + layers.sparse * sparse
