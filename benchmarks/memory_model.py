"""Per-rank memory of each contender as a function of layout, model dims and vision length.

Bytes per rank = parameter + gradient + optimizer state (by how each contender shards them)
+ activations saved for backward (+ ZeRO-3's gathered-parameter buffer). Activation counts
per token come from reading what autograd saves in the transformers Qwen2.5-VL blocks (fp32,
SDPA flash kernel: no ``S^2`` term), checked tensor by tensor with `measure.ActivationCounter`:

* ViT block (h, I, H heads):  ``13h + 4I + H + 2`` elements / token — two RMSNorms ``2(3h+1)``,
  fused qkv output ``3h``, rotated q, k ``2h``, attention output + log-sum-exp ``h + H``, ``proj``
  input ``h``, MLP ``4I``. Under uniform TP only the norms stay whole: ``6h + 2 + (7h + H + 4I)/tp``.
* ViT once: pixels ``C·T·P²``, rotary cos/sin ``2·hd``, merger ``3h + 2 + 2h/tp``.
* LLM layer: ``8h + 2·kv·hd + H + 2 + 4I`` (TP: ``6h + 2 + (2h + 2·kv·hd + H + 4I)/tp``); once:
  final norm + ids ``3h + 4``, cos/sin ``2·hd``; loss: fp32 log-softmax ``V/tp`` (4 bytes each).
* Activation checkpointing (``ac=True``): each block keeps its input (``h``) and one block is
  live again during its recompute.

A sample is one image of ``L`` patches plus ``L / merge²`` image tokens and ``text_extra`` text
tokens for the LLM. ``seq_per_rank`` says how many of those tokens each contender holds per rank:
DHP ``L / sp`` vision and all ``T`` text (TP replicates the sequence); uniform TP all ``L`` and
``T``; ZeRO-3 / FSDP2 one whole sample per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1 << 30


@dataclass(frozen=True)
class Dims:
    v_depth: int
    v_hidden: int
    v_heads: int
    v_inter: int
    v_out: int
    v_fullatt: int
    t_hidden: int
    t_layers: int
    t_heads: int
    t_kv: int
    t_inter: int
    vocab: int
    pixel_dim: int = 3 * 2 * 14 * 14
    merge: int = 2

    @classmethod
    def from_config(cls, config) -> "Dims":
        vc, tc = config.vision_config, config.text_config
        return cls(vc.depth, vc.hidden_size, vc.num_heads, vc.intermediate_size, vc.out_hidden_size,
                   len(vc.fullatt_block_indexes), tc.hidden_size, tc.num_hidden_layers,
                   tc.num_attention_heads, tc.num_key_value_heads, tc.intermediate_size, tc.vocab_size,
                   vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, vc.spatial_merge_size)

    @property
    def t_hd(self) -> int:
        return self.t_hidden // self.t_heads

    @property
    def v_hd(self) -> int:
        return self.v_hidden // self.v_heads


# Published Qwen2.5-VL dims (config.json of the released checkpoints).
_VIT = dict(v_depth=32, v_hidden=1280, v_heads=16, v_inter=3456, v_fullatt=4)
QWEN25_VL_7B = Dims(**_VIT, v_out=3584, t_hidden=3584, t_layers=28, t_heads=28, t_kv=4, t_inter=18944, vocab=152064)
QWEN25_VL_32B = Dims(**_VIT, v_out=5120, t_hidden=5120, t_layers=64, t_heads=40, t_kv=8, t_inter=27648, vocab=152064)


# -- parameters: (sharded by TP, replicated under TP) element counts ------------------------------

def vision_params(d: Dims) -> tuple[int, int]:
    h, i = d.v_hidden, d.v_inter
    block_sh = 3 * h * h + 3 * h + h * h + 2 * (h * i + i) + i * h
    block_rep = h + h + 2 * h  # proj bias, down bias, two norms
    m = 4 * h
    merger_sh = m * m + m + m * d.v_out
    merger_rep = h + d.v_out
    return d.v_depth * block_sh + merger_sh, d.v_depth * block_rep + merger_rep + d.pixel_dim * h


def text_params(d: Dims) -> tuple[int, int]:
    h, kvd = d.t_hidden, d.t_kv * d.t_hd
    layer_sh = (h * h + h) + 2 * (h * kvd + kvd) + h * h + 3 * h * d.t_inter
    return d.t_layers * layer_sh + 2 * d.vocab * h, d.t_layers * 2 * h + h


@dataclass(frozen=True)
class Precision:
    param: int = 4
    grad: int = 4
    optim: int = 8      # AdamW m, v (+ fp32 master weights when params are not fp32)
    act: int = 4

    @property
    def state(self) -> int:
        return self.param + self.grad + self.optim


FP32 = Precision(4, 4, 8, 4)
BF16_MIXED = Precision(2, 2, 12, 2)  # bf16 params/grads/activations, fp32 master + Adam m, v


# -- activations: elements per token ---------------------------------------------------------------

def vision_act_elems(d: Dims, tp: int = 1, ac: bool = False) -> float:
    h, i, nh = d.v_hidden, d.v_inter, d.v_heads
    block = 6 * h + 2 + (7 * h + nh + 4 * i) / tp
    once = d.pixel_dim + 2 * d.v_hd + 3 * h + 2 + 2 * h / tp
    return (d.v_depth * h + block if ac else d.v_depth * block) + once


def text_act_elems(d: Dims, tp: int = 1, ac: bool = False, seq_shard: bool = False) -> float:
    """``seq_shard``: ray_dhp's text sequence parallelism (``text.sequence_parallel``): every
    per-token activation of a layer is ``1/tp`` — the norms and residuals run on the local
    tokens, and the column-parallel projections (q/k/v, gate/up, ``lm_head``) keep only the
    sequence shard of their all-gathered input and re-gather it in backward (Megatron-LM; see
    ``ray_dhp.parallel.seq_gather``). With checkpointing every block input is ``h/tp`` (the first
    layer's too: its slice is a copy). Whole on every rank stay only the M-RoPE cos/sin."""
    h = d.t_hidden
    layer = text_layer_elems(d, tp, seq_shard)
    if seq_shard:
        once = (3 * h + 4) / tp + 2 * d.t_hd  # final norm and lm_head input on the shard
        kept = d.t_layers * h / tp
    else:
        once = 3 * h + 4 + 2 * d.t_hd
        kept = d.t_layers * h
    return (kept + layer if ac else d.t_layers * layer) + once


def text_layer_elems(d: Dims, tp: int = 1, seq_shard: bool = False) -> float:
    """Elements per token one LLM layer saves (see ``text_act_elems``)."""
    h, kvd = d.t_hidden, d.t_kv * d.t_hd
    sharded = (2 * h + 2 * kvd + d.t_heads + 4 * d.t_inter) / tp
    # two RMSNorms keep their input and normalised input (2h + 1 each); their outputs are the
    # inputs of q/k/v and gate/up (h each). With seq_shard all of it is on 1/tp of the tokens
    # (the linears keep the shard of their gathered input).
    return (6 * h + 2) / tp + sharded if seq_shard else 6 * h + 2 + sharded


def loss_bytes_per_token(d: Dims, tp: int = 1) -> float:
    return 4 * d.vocab / tp


# -- contenders ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    kind: str           # "dhp", "dhp-disjoint", "tp", "zero3" (= "fsdp2")
    ranks: int
    sp: int = 1         # DHP vision SP degree
    tp: int = 1         # text TP (DHP) or TP of both (uniform TP)
    vision_zero1: bool = True
    text_seq_shard: bool = False  # text.sequence_parallel on (see text_act_elems)


def text_tokens(d: Dims, length: int, text_extra: int) -> int:
    return length // (d.merge ** 2) + text_extra


def per_rank_bytes(d: Dims, lay: Layout, length: int, prec: Precision = FP32, *, samples_per_rank: float = 1.0,
                   text_extra: int = 34, ac: bool = False) -> dict:
    """Per-rank bytes (worst rank) for ``samples_per_rank`` images of ``length`` patches each,
    i.e. the share of the step's images a rank's tokens come from (1 for ZeRO-3; DHP with one
    image per replica and SP = sp holds 1/sp of it)."""
    vs, vr = vision_params(d)
    ts, tr = text_params(d)
    t_tok = text_tokens(d, length, text_extra)
    out = {}
    if lay.kind in ("dhp", "dhp-disjoint"):
        n_v = lay.sp if lay.kind == "dhp-disjoint" else lay.ranks
        v_state = (vs + vr) * (prec.param + prec.grad + prec.optim / (n_v if lay.vision_zero1 else 1))
        t_state = (ts / lay.tp + tr) * prec.state
        v_act = samples_per_rank * length * vision_act_elems(d, 1, ac) * prec.act
        t_act = samples_per_rank * lay.sp * t_tok * (text_act_elems(d, lay.tp, ac, lay.text_seq_shard) * prec.act
                                                     + loss_bytes_per_token(d, lay.tp))
        if lay.kind == "dhp":
            out = dict(state=v_state + t_state, activations=v_act + t_act, vision_act=v_act, text_act=t_act)
        else:  # worst of a vision rank and a text rank
            v_tot, t_tot = v_state + v_act, t_state + t_act
            out = dict(state=v_state if v_tot >= t_tot else t_state,
                       activations=v_act if v_tot >= t_tot else t_act, vision_act=v_act, text_act=t_act)
    elif lay.kind == "tp":
        state = (vs / lay.tp + vr + ts / lay.tp + tr) * prec.state
        v_act = samples_per_rank * length * vision_act_elems(d, lay.tp, ac) * prec.act
        t_act = samples_per_rank * t_tok * (text_act_elems(d, lay.tp, ac) * prec.act + loss_bytes_per_token(d, lay.tp))
        out = dict(state=state, activations=v_act + t_act, vision_act=v_act, text_act=t_act)
    elif lay.kind in ("zero3", "fsdp2"):
        state = (vs + vr + ts + tr) * prec.state / lay.ranks
        h = d.t_hidden
        biggest = max(2 * d.vocab * h, (ts - 2 * d.vocab * h) / d.t_layers)  # root (embed + head) or a layer
        gathered = 2 * biggest * prec.param  # the unit in use + the one prefetched
        v_act = samples_per_rank * length * vision_act_elems(d, 1, ac) * prec.act
        t_act = samples_per_rank * t_tok * (text_act_elems(d, 1, ac) * prec.act + loss_bytes_per_token(d, 1))
        out = dict(state=state + gathered, activations=v_act + t_act, vision_act=v_act, text_act=t_act)
    else:
        raise ValueError(f"unknown layout kind {lay.kind!r}")
    out["total"] = out["state"] + out["activations"]
    return out


def max_length(d: Dims, lay: Layout, budget: float, prec: Precision, *, ac: bool = False,
               text_extra: int = 34, unit: int = 64) -> int:
    """Largest single-image length (patches, multiple of ``unit``) whose step fits ``budget`` bytes
    per rank: one image per micro-batch, spread over the SP ranks for DHP (1/sp of it per rank),
    whole on every rank for uniform TP and on its own rank for ZeRO-3."""
    share = 1.0 / lay.sp if lay.kind.startswith("dhp") else 1.0

    def fits(n):
        return per_rank_bytes(d, lay, n * unit, prec, samples_per_rank=share, text_extra=text_extra,
                              ac=ac)["total"] <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def big_model_table(ranks: int = 8, gpu_gib: float = 80.0, reserve_gib: float = 6.0) -> list:
    """Largest vision length per contender for Qwen2.5-VL-7B/-32B on ``ranks`` x ``gpu_gib``."""
    budget = (gpu_gib - reserve_gib) * GiB
    rows = []
    for name, d in (("Qwen2.5-VL-7B", QWEN25_VL_7B), ("Qwen2.5-VL-32B", QWEN25_VL_32B)):
        for ac in (False, True):
            row = {"model": name, "activation_checkpointing": ac}
            for kind, lay in (("dhp", Layout("dhp", ranks, sp=ranks, tp=ranks)),
                              ("dhp_text_sp", Layout("dhp", ranks, sp=ranks, tp=ranks, text_seq_shard=True)),
                              ("tp", Layout("tp", ranks, tp=ranks)),
                              ("zero3", Layout("zero3", ranks))):
                row[kind] = max_length(d, lay, budget, BF16_MIXED, ac=ac)
                row[f"{kind}_state_gib"] = round(per_rank_bytes(d, lay, 0, BF16_MIXED)["state"] / GiB, 1)
            rows.append(row)
    return rows


def with_sp(lay: Layout, sp: int) -> Layout:
    return replace(lay, sp=sp)
