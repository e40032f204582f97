"""Expert parallelism in the plan: the token all-to-alls and the expert gradients' reduction.

**All-to-all** (`ray_dhp.parallel.expert`): per sparse layer and micro-batch an EP rank with
``T`` tokens passes two buffers of ``T k`` rows of ``hidden`` values through
``all_to_all_single`` in the forward (dispatch: its tokens' ``k`` assignments; combine: the
expert outputs of the rows it received, ``T k`` on average over the EP group: exactly summed
over the group), the same two again in the backward (their adjoints), and the forward's again
when activation checkpointing recomputes the block::

    buffer = M * L_sparse * (2 + [checkpointing]) * 2 * T * k * hidden * dtype_bytes

which is what the engine records (`CommCounter`, ``all_to_all/text.experts`` and
``.../text.experts.grad``; tests/distributed/test_moe_traffic.py: the sums over the EP group
equal). Of it, ``(ep - 1) / ep`` leaves the rank when routing is balanced (a rank's own experts'
rows stay): that is the "bytes sent" figure (`sent_bytes`). The per-destination counts (``ep``
int64 per layer and pass) and the expert ids (``T k`` int64 per layer and forward) ride along.

**Gradients**: the experts' gradients are summed over the EDP group (``dp / ep`` replicas) only,
the rest of the LM over the text data-parallel group as before (`gradient_split`).
"""

from __future__ import annotations


def sparse_layer_count(config) -> int:
    """Sparse (mixture-of-experts) decoder layers of ``config`` (0 for a dense model)."""
    from ray_dhp.models import family_of

    moe = family_of(config).moe
    return len(moe.sparse_layers(config.text_config)) if moe is not None else 0


def inactive_expert_params(config) -> int:
    """Expert parameters a token does NOT pass (0 for a dense model): per sparse layer the
    ``E - k`` experts outside its top-k, each ``3 * I * H`` (``gate_up_proj`` ``2I x H``,
    ``down_proj`` ``H x I``). The step's FLOPs count the active rest (`ray_dhp.planning.cost_model`)."""
    layers = sparse_layer_count(config)
    if not layers:
        return 0
    from ray_dhp.models.generic_moe import expert_count, expert_widths

    tc = config.text_config  # one token passes top-k of one group (`expert_widths`)
    widths = expert_widths(tc)
    return layers * 3 * tc.hidden_size * (expert_count(tc) * sum(widths)
                                          - tc.num_experts_per_tok * max(widths))


def buffer_bytes(config, tokens: float, micro_batches: int, checkpointing: bool,
                 dtype_bytes: int) -> float:
    """Bytes of the hidden-state all-to-all buffers one EP rank passes per step (module
    docstring), ``tokens``: its tokens per micro-batch (text positions incl. image tokens)."""
    tc = config.text_config
    passes = 3 if checkpointing else 2
    return (micro_batches * sparse_layer_count(config) * passes * 2 * tokens * tc.num_experts_per_tok
            * tc.hidden_size * dtype_bytes)


def sent_bytes(config, tokens: float, ep: int, micro_batches: int, checkpointing: bool,
               dtype_bytes: int) -> float:
    """The part of `buffer_bytes` that leaves the rank under balanced routing: ``(ep-1)/ep``."""
    if ep <= 1:
        return 0.0
    return buffer_bytes(config, tokens, micro_batches, checkpointing, dtype_bytes) * (ep - 1) / ep


def gradient_split(counts, tp: int, ep: int) -> tuple:
    """(dense elements per rank reduced over text DP, expert elements per rank reduced over
    EDP) of the text model's local shards."""
    if ep <= 1:
        return counts.text_per_rank(tp), 0
    experts = sum(q.numel for q in counts.text_sizes if q.expert)
    return counts.text_per_rank(tp) - experts, experts // ep


def expert_degrees(config, text_dp: int) -> list:
    """The EP degrees > 1 a layout with ``text_dp`` replicas admits for ``config``: dividing both
    the replicas and the experts ([] for a dense model, or one whose experts EP refuses,
    `ray_dhp.models.base.MoESpec.ep_refusal`)."""
    from ray_dhp.models import family_of
    from ray_dhp.models.generic_moe import expert_count

    moe = family_of(config).moe
    n = expert_count(config.text_config) if moe is not None and not moe.ep_refusal else 0
    return [e for e in range(2, text_dp + 1) if text_dp % e == 0 and n % e == 0] if n else []
