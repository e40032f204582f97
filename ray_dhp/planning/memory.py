"""Per-rank memory estimates for `ray-dhp plan`: parameters from a meta-device model, activations
from the model dims. Nothing is allocated: the model is built under ``accelerate.init_empty_weights``.

Model state per rank (what the engine keeps) comes from the run's `PrecisionPolicy`
(`ray_dhp.step.precision`): weights and gradients in the policy's dtype for every parameter the rank
holds, plus fp32 masters and AdamW moments for every parameter the rank *updates* (at ZeRO stage
1 or 2 each parameter is updated by one of the module's replicas: the same greedy partition as
the engine, `ray_dhp.parallel.zero.owners`, over the local TP shards; at stage 3 each rank holds its FSDP2
shard, ``torch.chunk`` rows of every parameter, `TextParam.fsdp_share`). Below stage 3 the vision
tower is whole on every vision rank (Ulysses shards tokens, not weights); the text model's TP-planned linears, embedding and head are split
``tp`` ways (their row-parallel biases and all norms are replicated). `rank_state` gives the
exact bytes, which the tests compare with the engine's tensors after a step.

Vision activations are the bytes the stock towers save for backward, per block and token
(`ray_dhp.planning.memory_vision`, measured there). Text activations are what a pre-norm
block keeps for backward per token, as measured on the engine (`text_activation_parts`: two
RMSNorms, q, k, v, attention output, the gated MLP's four ``i``-wide tensors, the log-sum-exp),
plus the final norm, rotary tables and logits once. Under
Ulysses SP each vision rank keeps ``1/sp`` of the tokens; under TP the attention and MLP
intermediates are split ``tp`` ways while norms and residuals are replicated, unless the text
sequence parallelism is on (then they hold ``1/tp`` of the tokens). With ``attention="eager"`` the ``heads × s²`` score and probability
matrices of every full-attention layer are added (flash/SDPA kernels keep them out of memory).
With activation checkpointing only each block's input is kept, plus one block recomputed.
The logits of the vocab-parallel loss are fp32, ``vocab/tp`` wide: saved once, their gradient
is transient (both count in the rank's activations).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ray_dhp.models.layer_config import layer_max
from ray_dhp.models.sizes import ParamCounts
from ray_dhp.planning.memory_layers import layer_extra, routed_rows_bytes, text_layers
from ray_dhp.planning.memory_state import rank_state
from ray_dhp.planning.memory_vision import vision_activation_bytes  # noqa: F401
from ray_dhp.planning.packing import text_tokens as packed_text

GIB = 1024 ** 3
STATE_BYTES_PER_PARAM = 16  # fp32 weight + grad + AdamW exp_avg + exp_avg_sq (policy fp32)


@dataclass(frozen=True)
class ActivationSettings:
    """How activations are kept: element bytes, attention kernel, activation checkpointing."""

    dtype_bytes: int = 4           # 4: fp32 (default loop), 2: bfloat16 (weights or autocast)
    attention: str = "flash"       # "flash" (no s² term) or "eager"
    checkpointing: bool = False
    # fp32 weights under bf16 autocast (`bf16_autocast`): every matmul keeps the bf16 copy of its
    # weight it was given (`weight_cast_bytes`) and of its input; the LM's residual stream and
    # norms stay fp32 (`text_activation_parts`)
    autocast: bool = False

    @classmethod
    def of(cls, policy, attention: str = "flash", checkpointing: bool = False) -> "ActivationSettings":
        """The settings a `PrecisionPolicy` implies: 2-byte activations under bf16 weights or
        autocast, `autocast` for fp32 weights under an autocast dtype."""
        import torch

        bf16 = torch.bfloat16 in (policy.param_dtype, policy.autocast_dtype)
        return cls(2 if bf16 else 4, attention, checkpointing,
                   autocast=policy.autocast_dtype is not None
                   and policy.param_dtype != policy.autocast_dtype)


def vision_depth(vc) -> int:
    """ViT blocks: ``depth`` (towers that count blocks as ``depth``), else ``num_hidden_layers``."""
    return getattr(vc, "depth", None) or vc.num_hidden_layers


def merged(config) -> int:
    """Patches per merged feature row of ``config``'s family (`FamilySpec.merge_size` squared)."""
    from ray_dhp.models import family_of

    return family_of(config).merge_size(config) ** 2


def _mlp_widths(tc) -> tuple:
    """(TP-sharded, TP-replicated) MLP width per token: a dense ``intermediate_size``; an MoE LM
    without one (every layer sparse) has its shared expert (TP-sharded) and its top-k routed
    experts' (replicated on the TP ranks, `ray_dhp.models.generic_moe`)."""
    if getattr(tc, "intermediate_size", None):
        return tc.intermediate_size, 0
    from ray_dhp.models.generic_moe import expert_widths

    return (getattr(tc, "shared_expert_intermediate_size", 0),
            tc.num_experts_per_tok * max(expert_widths(tc)))


def text_activation_bytes(tc, tokens: int, tp: int, s: ActivationSettings,
                          sample_tokens: Optional[int] = None, seq_parallel: bool = False,
                          cp: int = 1, head_norms: bool = False, layers=None,
                          probed=None) -> float:
    """Activation bytes of one text TP rank for ``tokens`` tokens of its replica (incl. logits):
    the saved-for-backward bytes plus the transient working set (`text_activation_parts`)."""
    return sum(text_activation_parts(tc, tokens, tp, s, sample_tokens, seq_parallel, cp, head_norms,
                                     layers, probed))


def text_activation_parts(tc, tokens: int, tp: int, s: ActivationSettings,
                          sample_tokens: Optional[int] = None, seq_parallel: bool = False,
                          cp: int = 1, head_norms: bool = False, layers=None,
                          probed=None) -> tuple:
    """``(saved, transient)`` bytes of one text TP rank for ``tokens`` tokens of its replica.

    ``saved``: what autograd keeps from the forward for the backward, per token (``d`` the
    activation element size, ``h`` the width, ``i`` the MLP width, ``kv`` the k and v widths):
    per block two RMSNorms (each its input upcast to fp32, the fp32 ``rsqrt`` and the normalised
    input and output in ``d``: ``4h + 4 + 2dh``), q, k, v and the attention output
    (``d(2h + kv)/tp``) with the kernel's fp32 log-sum-exp (``4 heads/tp``), the gated MLP's gate,
    activation, up and product (``4di/tp``; an MoE's routed experts ``4d`` per routed width,
    replicated); once, the final norm, the rotary ``cos`` and ``sin`` (``d`` each per head dim),
    the int64 ids and labels and the fp32 logits of the vocab-parallel loss (``4·vocab/tp``).
    Measured on the engine at TP 1 and 2 with ``saved_tensors_hooks`` (``benchmarks/plan_accuracy.py``).
    ``head_norms`` (`ParamCounts.text_head_norms`): per-head q and k RMSNorms, each keeping its
    fp32 input, ``rsqrt`` per head and normalised output in ``d`` (measured on the head-norm LMs
    of `benchmarks/plan_accuracy.py`).
    ``transient``: the logits' gradient at the start of the backward (``4·vocab/tp``), the block
    recomputed at a time under activation checkpointing and, under CP, one layer's all-to-all
    buffers. ``layers`` (`ray_dhp.planning.memory_layers.text_layers`): the layers with another
    token mixer or a sparse MLP, counted as what they save (under checkpointing: the largest
    block recomputed).

    ``seq_parallel`` (``text.sequence_parallel``): every per-token activation is ``1/tp`` — norms
    and residuals run on the local tokens, the column-parallel projections keep only the sequence
    shard of their all-gathered input (re-gathered in backward), and every checkpointed block
    input is ``h/tp``. Measured by ``benchmarks/text_sp.py``.

    ``cp`` (``text.context_parallel``, `ray_dhp.parallel.context`): the *saved* activations of
    the rank's slice, each sample padded to a multiple of cp (attention keeps the whole sequence
    for ``1/(tp cp)`` of the heads: the same bytes as its slice for all of its ``1/tp``), plus the
    attention output in the buffer the reverse all-to-all returns it in, which ``o_proj`` keeps
    (the stock path's ``o_proj`` input is SDPA's saved output itself); the slice's own transient
    part. The all-to-all send and receive buffers are CP's transient working set, counted apart
    (`cp_working_bytes`, `RankMemory.text_work`). Measured: within 5% at CP 1/2/4
    (tests/distributed/test_context_parallel.py) and in the plan-accuracy matrix.

    ``probed`` (`text_probe`: a generic family's decoder measured from the model's own code,
    `ray_dhp.models.text_saved.TextSaved`): the layers' saved bytes in place of the block
    formula (the routed rows of a sparse layer whose experts the probe stubbed still by formula,
    `routed_rows_bytes`), the measured
    final norm and rotary tables in place of theirs; ids, labels, logits, eager scores and the
    recomputed block's transient as above."""
    if cp > 1:
        seq = sample_tokens or tokens
        padded = -(-seq // cp) * cp
        mine = tokens / seq * padded / cp  # the rank's tokens
        saved, transient = text_activation_parts(tc, mine, tp, _sdpa(s), padded / cp, seq_parallel,
                                                 head_norms=head_norms, layers=layers,
                                                 probed=probed)
        back = mine * tc.hidden_size / tp * s.dtype_bytes * (1 if s.checkpointing else tc.num_hidden_layers)
        eager = (2 * tc.num_attention_heads / (tp * cp) * tokens * seq * s.dtype_bytes
                 * (1 if s.checkpointing else tc.num_hidden_layers)) if s.attention == "eager" else 0
        return saved + back + eager, transient
    other, h, layers, d = layers, tc.hidden_size, tc.num_hidden_layers, s.dtype_bytes
    i, routed = _mlp_widths(tc)
    heads = tc.num_attention_heads
    hd = layer_max(tc, "head_dim") or h // heads  # the widest layer's (per-layer configs)
    kv_heads = layer_max(tc, "num_key_value_heads")
    kv = 2 * kv_heads * hd
    local = tp if seq_parallel else 1  # norms and residuals on 1/tp of the tokens
    norm = (4 * h + 4 + 2 * d * h) / local
    # autocast over fp32 weights: each norm's normalised input stays fp32, and each projection
    # reading a norm's output keeps its own bf16 copy (q, k and v: 3; the MLP's gate and up: 2)
    cast_norm = (4 - d) * h / local if s.autocast else 0.0
    attention = (d * (2 * heads * hd + kv) + 4 * heads) / tp
    if head_norms:  # q (heads) and k (kv heads): fp32 input + rsqrt per head + output in d
        attention += (heads + kv_heads) * ((4 + d) * hd + 4) / tp
    mlp = 4 * d * i / tp + 4 * d * routed
    per_block = tokens * (2 * norm + attention + mlp
                          + (2 * cast_norm + 3 * d * h / local if s.autocast else 0.0))
    kept = tokens * layers * (4 if s.autocast else d) * h / local  # the residual stream
    # checkpointing: each block's input saved, one block recomputed at a time (transient)
    blocks, recomputed = (kept, per_block) if s.checkpointing else (layers * per_block, 0.0)
    if probed is not None:  # measured per layer (docstring); kept: the residual stream
        measured = _probed_layers(probed, other, tc, tokens, tp, d, seq_parallel)
        blocks, recomputed = (kept, max(measured)) if s.checkpointing else (sum(measured), 0.0)
    elif other is not None:  # mixers besides attention, sparse MLPs (the largest recomputed)
        extra = layer_extra(other, tc, tokens, sample_tokens or tokens, tp, d, tokens * attention,
                            tokens * 4 * d * (routed or i / tp), tokens * (norm - d * h / local),
                            one=s.checkpointing, gathered=tokens * h * d if seq_parallel else 0.0)
        blocks, recomputed = (blocks, recomputed + extra) if s.checkpointing else (blocks + extra, 0.0)
    # once: the final norm, the rotary tables, ids and labels, the fp32 logits
    final = (norm + 2 * d * hd) if probed is None else (
        (probed.outside + d * h) / local + probed.tables)  # + the head's input
    once = tokens * (final + cast_norm + 16 + 4 * tc.vocab_size / tp)
    if s.attention == "eager":
        scores = 2 * heads / tp * tokens * (sample_tokens or tokens) * d
        blocks, recomputed = (blocks, recomputed + scores) if s.checkpointing else (
            blocks + scores * layers, recomputed)
    return blocks + once, recomputed + tokens * 4 * tc.vocab_size / tp


def text_probe(config, s: ActivationSettings, row_tokens: float = 64):
    """A generic family's decoder layers as measured from the model's own code in rows of
    ``row_tokens`` tokens (`ray_dhp.models.text_saved_per_token`, the ``probed`` of
    `text_activation_parts`), or None:
    a hand-written family (its formula is exact), a probe that cannot run, or bf16 autocast over
    fp32 weights (the probe runs in one dtype: the formula's fp32 residual and casts hold)."""
    if s.autocast:
        return None
    from ray_dhp.models import text_saved_per_token

    return text_saved_per_token(config, s.dtype_bytes, int(row_tokens))


def _probed_layers(probed, other, tc, tokens: float, tp: int, d: int, seq_parallel: bool) -> list:
    """Per layer, the bytes one TP rank keeps of the probe's (``replicated + sharded / tp``, all
    ``1/tp`` under text SP), plus the routed rows of a sparse layer whose experts the probe stubbed
    (`routed_rows_bytes`: the whole sequence's under text SP, with its gathered ``h``-wide copy,
    `layer_extra`)."""
    sparse = set(other.sparse_layers) if other is not None and other.sparse else set()
    out = []
    for i, (rep, shard) in enumerate(probed.layers):
        own = tokens * ((rep + shard) / tp if seq_parallel else rep + shard / tp)
        if i in sparse:
            own += (routed_rows_bytes(other, tc.hidden_size, tokens, d) if i in probed.stubbed
                    else 0.0) + (tokens * tc.hidden_size * d if seq_parallel else 0.0)
        out.append(own)
    return out


class WeightCasts(NamedTuple):
    """Bytes of the bf16 weight copies autocast keeps on one rank (`weight_cast_bytes`): saved
    for backward, and made again with each block recomputed under activation checkpointing."""

    vision: float = 0.0
    vision_recomputed: float = 0.0
    text: float = 0.0
    text_recomputed: float = 0.0


def weight_cast_bytes(config, counts: ParamCounts, tp: int, s: ActivationSettings) -> WeightCasts:
    """The bf16 weight copies autocast keeps for backward on one rank
    (`ActivationSettings.autocast`; none otherwise): 2 B per weight a matmul or convolution
    takes, the whole module's (a ZeRO-3 rank casts each all-gathered weight), the text side's
    TP shard; not the input embedding (a lookup, not cast) nor the norms (fp32 multiplies).
    With activation checkpointing the blocks' copies are not kept: each is made again as its
    block is recomputed (one block's at a time); the parts outside the blocks (``lm_head``, the
    tower's patch embedding and merger) keep theirs. Measured on the demo's tiny model (the default
    family of `ray_dhp.demo.configs.tiny_model_config`; `benchmarks/plan_accuracy.py`, the
    ``demo ... bf16_autocast`` rows)."""
    if not s.autocast:
        return WeightCasts()
    from ray_dhp.planning.memory_vision import vision_block_weights

    tc = config.text_config
    h, layers = tc.hidden_size, tc.num_hidden_layers
    tied = getattr(config, "tie_word_embeddings", None) or getattr(tc, "tie_word_embeddings", False)
    head = tc.vocab_size * h / tp  # the vocabulary-parallel lm_head's shard
    norms = h * (layers * counts.text_block_norms + 1)
    text = counts.text_per_rank(tp) - norms - (0 if tied else head)
    vc = config.vision_config
    vision, v_block = counts.vision, vision_block_weights(vc)
    if not s.checkpointing:
        return WeightCasts(2.0 * vision, 0.0, 2.0 * text, 0.0)
    depth = vision_depth(vc)
    return WeightCasts(2.0 * max(vision - depth * v_block, 0), 2.0 * v_block,
                       2.0 * head, 2.0 * (text - head) / layers)


def cp_working_bytes(tc, tokens: float, tp: int, cp: int, s: ActivationSettings,
                     sample_tokens: Optional[float] = None) -> float:
    """The transient per-layer working set of context parallelism on one rank (`ray_dhp.parallel.
    context`): one layer's all-to-all send and receive buffers of q, k, v and the output (KV
    heads repeated to the query heads where they do not split over cp); where the heads do not
    split over ``tp x cp``, ring attention's (`ray_dhp.planning.ring_cost.ring_working_bytes`:
    the K/V blocks and dK/dV accumulators in flight, the swap buffers; ``sample_tokens`` per
    row). Counted in the rank's peak (`RankMemory.total`), not among the saved activations. 0
    without CP."""
    from ray_dhp.planning.ring_cost import ring_form, ring_working_bytes

    if cp == 1:
        return 0.0
    if ring_form(tc, tp, cp):
        return ring_working_bytes(tc, tokens, tp, cp, s.dtype_bytes, sample_tokens)
    hd = tc.hidden_size // tc.num_attention_heads
    kv = layer_max(tc, "num_key_value_heads")
    kv = tc.num_attention_heads if (kv // tp) % cp else kv
    return 2 * tokens / cp * (2 * tc.hidden_size + 2 * kv * hd) / tp * s.dtype_bytes


def _sdpa(s: ActivationSettings) -> ActivationSettings:
    """``s`` with a fused attention kernel (CP's own scores are counted apart)."""
    return dataclasses.replace(s, attention="flash") if s.attention == "eager" else s


@dataclass(frozen=True)
class RankMemory:
    """Estimated bytes of one rank."""

    rank: int
    roles: tuple
    params: int
    state_bytes: float
    vision_act: float
    text_act: float
    audio_act: float = 0.0  # `ray_dhp.planning.memory_audio.estimate_module_ranks`
    text_work: float = 0.0  # CP's transient buffers (`cp_working_bytes`: all-to-all or ring)
    fsdp_work: float = 0.0  # ZeRO-3's unsharded units (`ray_dhp.planning.fsdp_working`)

    @property
    def total(self) -> float:
        return (self.state_bytes + self.vision_act + self.text_act + self.audio_act + self.text_work
                + self.fsdp_work)


def estimate_ranks(config, topology, counts: ParamCounts, *, vision_tokens: int, text_tokens: int,
                   samples: int, settings: ActivationSettings,
                   state_bytes: float = STATE_BYTES_PER_PARAM, policy=None,
                   segment_tokens: Optional[int] = None,
                   text_samples: Optional[int] = None, packing=None, micro_batches: int = 1) -> list:
    """Per-rank `RankMemory` for micro-batches of ``samples`` samples per vision replica and
    ``text_samples`` (default ``samples``) per text replica (each group splits the micro-batch
    over its own data-parallel degree), each with
    ``vision_tokens`` patch tokens and ``text_tokens`` text tokens. With a ``policy`` (a
    `PrecisionPolicy`) the state is `rank_state`'s exact bytes; without, ``state_bytes`` per
    parameter, and with vision ZeRO (stage >= 1) the ViT's AdamW moments (8 of the state bytes)
    are sharded over the whole vision group (the cost model's approximation). ``segment_tokens``:
    patch tokens per attention segment (a video's frame, `ray_dhp.planning.video`; None: the
    sample is one image). ``packing`` (`ray_dhp.planning.packing.Packing`, ``data.packing``):
    the text activations are the replica's packed rows', not its padded samples'. With a
    ``policy``, a rank hosting a module at ZeRO stage 3 also holds that module's unsharded units
    (`ray_dhp.planning.fsdp_working`); ``micro_batches``: the step's (stage 3's gradient shards
    accumulate in fp32 over several under the bf16 policies, `rank_state`)."""
    from ray_dhp.planning.fsdp_working import fsdp_working_bytes

    vc, tc = config.vision_config, config.text_config
    merge = merged(config)
    sp, tp = topology.vision.inner, topology.text.inner
    seq = text_tokens + vision_tokens // merge
    v_act = vision_activation_bytes(vc, samples * vision_tokens, sp, settings,
                                    segment_tokens or vision_tokens, config)
    t_tokens, t_row = packed_text(packing, text_samples or samples, seq)
    t_act = text_activation_bytes(tc, t_tokens, tp, settings, t_row,
                                  seq_parallel=getattr(topology, "text_sequence_parallel", False),
                                  cp=topology.text.cp, head_norms=counts.text_head_norms,
                                  layers=text_layers(config, topology, counts),
                                  probed=text_probe(config, settings, t_row))
    t_work = cp_working_bytes(tc, (text_samples or samples) * seq, tp, topology.text.cp, settings,
                              t_row)
    casts = weight_cast_bytes(config, counts, tp, settings)
    v_act += casts.vision + casts.vision_recomputed
    t_act += casts.text + casts.text_recomputed
    moments = 8 * (1 - 1 / topology.vision.size) if topology.vision.zero_stage else 0
    out = []
    for r in range(topology.world_size):
        on_v, on_t = topology.vision.hosts(r), topology.text.hosts(r)
        v = counts.vision if on_v else 0
        params = v + (counts.text_per_rank(tp) if on_t else 0)
        state = (rank_state(counts, topology, r, policy, micro_batches).device_total if policy is not None
                 else params * state_bytes - v * moments)
        fsdp = fsdp_working_bytes(counts, topology, r, policy) if policy is not None else 0
        out.append(RankMemory(r, topology.roles(r), params, state,
                              v_act if on_v else 0.0, t_act if on_t else 0.0,
                              text_work=t_work if on_t else 0.0, fsdp_work=fsdp))
    return out


def estimate_zero3(config, counts: ParamCounts, world: int, *, vision_tokens: int,
                   text_tokens: int, settings: ActivationSettings,
                   state_bytes: float = STATE_BYTES_PER_PARAM,
                   segment_tokens: Optional[int] = None) -> float:
    """Bytes per GPU of the ZeRO-3 baseline: model state split ``world`` ways, one whole sample
    per GPU (no SP/TP: every activation of that sample stays on its GPU); ``segment_tokens`` as
    in `estimate_ranks`."""
    vc, tc = config.vision_config, config.text_config
    seq = text_tokens + vision_tokens // merged(config)
    state = (counts.vision + counts.text) * state_bytes / world
    return (state + sum(weight_cast_bytes(config, counts, 1, settings))
            + vision_activation_bytes(vc, vision_tokens, 1, settings, segment_tokens, config)
            + text_activation_bytes(tc, seq, 1, settings, layers=text_layers(config, None, counts),
                                    probed=text_probe(config, settings, seq)))
