"""Qwen3.5 (dense): Qwen3-VL-style ViT (learned position table, no deepstack); a hybrid LM whose
layers are Gated DeltaNet linear attention (``config.layer_types == "linear_attention"``) or
gated full attention (``"full_attention"``, by default every 4th layer).

Tensor parallelism shards both mixers by heads:

* full attention as Qwen3's: ``q_proj`` holds ``[query | gate]`` *per head* (the model views it
  as ``[..., heads, 2 * head_dim]``), so a column split on head boundaries is right; the
  per-head ``q_norm``/``k_norm`` are replicated with partial gradients.
* Gated DeltaNet: ``in_proj_qkv`` concatenates ``[q (all key heads) | k | v (all value heads)]``
  and the depthwise ``conv1d`` runs over those concatenated channels, so a plain column split
  would give rank 0 only query channels. transformers' own ``base_model_tp_plan`` sidesteps this
  with ``colwise_gather_output`` everywhere (every rank then runs the conv and the recurrence
  of all heads). Here `RankChannels` keeps the projection column-sharded, all-gathers its output
  and gives each rank its key heads' ``q|k`` and its value heads' ``v`` channels (value head
  ``j`` reads key head ``j // (V/K)``, and contiguous head blocks keep that pairing); the conv
  weight, ``dt_bias`` and ``A_log`` are replicated and seen through the rank's channels
  (partial gradients); ``in_proj_z``/``in_proj_b``/``in_proj_a`` are per value head already
  (column-parallel), the gated norm's weight is shared by all heads (partial gradient) and
  ``out_proj`` is row-parallel. The convolution and the recurrence therefore see exactly the
  rank's channels and heads.

Packing: the gated attention layers keep packed samples apart through the mask transformers
builds from the packed position ids (as Qwen-VL's); the Gated DeltaNet layers carry state along
the sequence (the causal ``conv1d`` window and the delta rule's recurrent state), and the torch
path of transformers' layer takes no sequence boundaries, so each runs on the packed rows laid
out chunk-aligned, with a gated delta rule that resets its state where a sample starts
(`STATEFUL_MIXERS`, `ray_dhp.models.segments`, `ray_dhp.models.delta_rule`): every sample
starts from a zero conv window and a zero state, and ``out_proj`` sees the packed rows. Under TP the layer's input is
replicated (whole sequence, the rank's heads); under text SP it is gathered along the sequence
before the layer (``text_sp_plan``), so the segments always index the whole row.
"""

from ray_dhp.models.base import FamilySpec
from ray_dhp.models.delta_rule import chunk_gated_delta_rule_with_resets
from ray_dhp.models.segments import StatefulMixer
from ray_dhp.models.text_plans import sequence_parallel_text_plan, standard_text_plan


def _widths(tc) -> tuple:
    k = tc.linear_num_key_heads * tc.linear_key_head_dim
    return k, tc.linear_num_value_heads * tc.linear_value_head_dim


def _linear_attention(tc):
    """The `RankChannels` style of one Gated DeltaNet block (segments: q, k, v channels)."""
    from ray_dhp.parallel.channels import RankChannels

    k, v = _widths(tc)
    heads = (tc.linear_num_value_heads,)
    return RankChannels(gather_outputs={"in_proj_qkv": (k, k, v)},
                        params={"conv1d.weight": (k, k, v), "dt_bias": heads, "A_log": heads},
                        attrs=("key_dim", "value_dim", "conv_dim", "num_k_heads", "num_v_heads"))


_COLUMN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def cp_mixers(tc) -> tuple:
    """Context parallelism (`ray_dhp.parallel.context_mixers`): each Gated DeltaNet block runs the
    whole sequence for ``1 / cp`` of its heads; its segments and per-head parameters are the
    TP split's (`_linear_attention`), its per-value-head projections plain head blocks."""
    from ray_dhp.parallel.context_mixers import MixerHeads

    k, v = _widths(tc)
    hv = (tc.linear_num_value_heads,)
    return (("linear_attn", MixerHeads(
        inputs={"in_proj_qkv": (k, k, v), "in_proj_z": (v,), "in_proj_b": hv, "in_proj_a": hv},
        output="out_proj", params={"conv1d.weight": (k, k, v), "dt_bias": hv, "A_log": hv},
        attrs=("key_dim", "value_dim", "conv_dim", "num_k_heads", "num_v_heads"),
        heads=text_tp_divisors(tc), packing=STATEFUL_MIXERS[0])),)

# The Gated DeltaNet layers (``layers.*.linear_attn``) carry state; ``out_proj`` maps their
# channels back to the residual stream per token; their forward calls the chunked recurrence
# (64-token chunks) as the global ``torch_chunk_gated_delta_rule`` (transformers 5.25; an
# instance attribute ``chunk_gated_delta_rule`` in earlier versions), after a causal conv1d of
# ``conv_kernel_size`` taps.
STATEFUL_MIXERS = (StatefulMixer("linear_attn", "out_proj",
                                 recurrence=("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                                 resetting=chunk_gated_delta_rule_with_resets, chunk=64,
                                 window="conv_kernel_size"),)


def text_tp_plan(tc, prefix: str = "model.language_model") -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = f"{prefix}.layers.*.linear_attn"
    return {**standard_text_plan(prefix),
            **{f"{layer}.{p}": ColwiseParallel() for p in _COLUMN_PROJECTIONS},
            f"{layer}.out_proj": RowwiseParallel(),
            layer: _linear_attention(tc)}


def text_sp_plan(tc, prefix: str = "model.language_model") -> dict:
    """`sequence_parallel_text_plan` (gated attention, MLP, norms on the sequence shard) plus the
    Gated DeltaNet layers: their input is all-gathered along the sequence (DTensor
    ``PrepareModuleInput``; the module masks padding on the whole sequence before projecting,
    so `GatheredColwise`'s saved-shard economy does not apply: each projection keeps the gathered
    input and all-reduces its input gradient, as without SP); the conv and the recurrence run
    on the whole sequence of the rank's heads, and ``out_proj`` reduce-scatters into the shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from ray_dhp.parallel.channels import Styles

    layer = f"{prefix}.layers.*.linear_attn"
    gather = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                use_local_output=True)
    return {**sequence_parallel_text_plan(prefix),
            **{f"{layer}.{p}": ColwiseParallel() for p in _COLUMN_PROJECTIONS},
            f"{layer}.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            layer: Styles(gather, _linear_attention(tc))}


def linear_attention_layers(tc) -> int:
    return sum(t == "linear_attention" for t in tc.layer_types)


def linear_attention_saved(tc, rows: float, row_tokens: float, tp: int, d: int) -> float:
    """Bytes one Gated DeltaNet layer saves for backward on a text TP rank (its ``1/tp`` of the
    key and value heads) for ``rows`` rows of ``row_tokens`` tokens, ``d`` bytes per activation,
    as transformers' torch path runs it (``causal_conv1d`` and ``chunk_gated_delta_rule``
    without their CUDA kernels: what CPU runs, and a GPU without flash-linear-attention), in
    place of attention's q, k, v and output. Per row of ``S`` tokens, ``P`` padded to the
    64-token chunk, ``n = P / 64`` chunks, ``H`` value heads (the key heads repeated to them),
    ``K`` key heads: the conv's input and output (``S + kernel - 1`` long) over the ``q|k|v``
    channels; the gates (``b``'s sigmoid, ``a``'s softplus in fp32, per head); the fp32 query
    and key before their L2 norm with the norms; the chunked recurrence in fp32: padded
    ``beta``, ``k``, ``v``, five ``64 x 64`` matrices per chunk and head (the decays, the UT
    system, the intra-chunk scores), the two matmul operand copies, the triangular solves'
    outputs, the decayed q and k, the decays; per chunk the state ``dk x dv`` and the corrected
    values; the gated RMSNorm (fp32 input, ``rsqrt``, gate, activation) and ``out_proj``'s input.
    Measured with ``saved_tensors_hooks`` within 2% of transformers 5.25's layer for rows not a
    multiple of 64 tokens (a whole number of chunks saves ~6% less: no padding copies)."""
    c, kern = 64, tc.linear_conv_kernel_dim
    h, k = tc.linear_num_value_heads / tp, tc.linear_num_key_heads / tp
    dk, dv = tc.linear_key_head_dim, tc.linear_value_head_dim
    s = row_tokens
    p = -(-s // c) * c
    n = p // c
    conv = 2 * k * dk + h * dv
    per_row = (d * conv * (2 * s + kern - 1)                      # conv input and output
               + h * s * (d + 8) + 4 * h * s * (2 * dk + 2)       # gates; q, k and their L2 norms
               + 4 * h * (p * (1 + dv + dk) + 5 * p * c + 2 * p * dk + 3 * p + 2 * p * (dk + dv) + n)
               + 4 * h * n * (dk * dv + c * dv)                     # per chunk: state, corrected v
               + h * s * (dv * (16 + 2 * d) + 4))                  # gated norm; out_proj input
    return rows * per_row + 8 * h + c * c


def text_tp_divisors(tc) -> tuple:
    return (("linear-attention key heads", tc.linear_num_key_heads),
            ("linear-attention value heads", tc.linear_num_value_heads))


SPEC = FamilySpec(
    name="qwen3_5",
    model_type="qwen3_5",
    model_class="Qwen3_5ForConditionalGeneration",
    text_tp_plan=text_tp_plan,
    text_sp_plan=text_sp_plan,
    tp_partial_grad_suffixes=("self_attn.q_norm.weight", "self_attn.k_norm.weight",
                              "linear_attn.norm.weight", "linear_attn.conv1d.weight",
                              "linear_attn.dt_bias", "linear_attn.A_log"),
    tp_divisors=text_tp_divisors,
    stateful_mixers=STATEFUL_MIXERS,
    cp_mixers=cp_mixers,
    text_mixer_layers=linear_attention_layers,
    text_mixer_saved=linear_attention_saved,
)
