"""The cost model of a training step: predicted seconds of every phase on one rank, for one
layout (`Layout`) of a `Workload` on a `Hardware`; `ray_dhp.planning.recommend` ranks layouts by it.
Plain arithmetic: nothing here touches torch.distributed or Ray.

**Compute.** Training FLOPs per sample (forward + backward = 3x forward; 4x with activation
checkpointing, which recomputes the forward):

* vision: ``6 * P_v * L_v`` for the linears over ``L_v`` patch tokens (the merger, ``merge²``
  times narrower in tokens, is counted per merged row), plus attention ``12 * h_v * L_v * s`` per
  block, ``s = L_v`` in full-attention blocks and the window (``(window_size / patch_size)²``
  patches) in a windowed tower's window blocks (those not in ``fullatt_block_indexes``); a video
  attends per frame, ``s`` = its frame's patches (``Workload.vision_segment``,
  `ray_dhp.planning.video`);
* text: ``6 * P_t * L_t`` over ``L_t = text tokens + L_v / merge²`` (image tokens after the
  merge; the input embedding is a lookup, not counted), plus causal attention ``6 * d * L_t²``
  per layer (half of the full ``12 * d * L_t²``). A mixture-of-experts LM counts its *active*
  parameters: a token passes only its top-k experts, so ``P_t`` leaves out the other
  ``E - k`` experts of every sparse layer (router and shared expert counted in full;
  `ray_dhp.planning.experts.inactive_expert_params`).

A rank's share: a vision replica gets ``ceil(mb / dp_v)`` of a micro-batch's ``mb`` samples and
each of its ``sp`` ranks computes ``1/sp`` of them (Ulysses splits tokens for the linears and
heads for attention); a text rank computes ``ceil(mb / dp_t) / tp``. With a resolution mix
(``Workload.vision_mix``, e.g. 70% 256-, 25% 4096-, 5% 16384-patch images) samples are shared
out by cost (``balance: cost``), so a replica computes the mean share ``mb · E[FLOPs] / dp``, but
at least the largest sample when the micro-batch holds one (`replica_share`); memory plans for
the largest size.
Time = FLOPs / (``peak_flops * efficiency``).

**Communication** (bytes / bandwidth + a fixed latency per collective; NVLink bandwidth when the
collective's ranks share a node, the inter-node bandwidth otherwise; activations in the run's
dtype, gradients fp32):

* Ulysses (``sp > 1``): per full-attention block two all-to-alls forward (q, k, v to head
  sharding; the output back), the same two backward (and again in the recompute), each moving
  ``(sp - 1) / sp`` of its ``[tokens / sp, 3h or h]`` input; window blocks need none;
* TP (``tp > 1``): two all-reduces of ``[tokens, hidden]`` per layer forward, two backward (two
  more when recomputing) and one for the vocab-parallel embedding; ring cost ``2 (tp - 1) / tp``;
* boundary, each way per micro-batch: a text rank receives its replica's features (replicated
  over TP), a vision rank sends its rows to the ``tp`` ranks of the owning replica; the larger
  of the two sets the time (the gradients' way back, sent by one TP rank only, is costed the same);
* end of step: the vision gradients all-reduced over the whole vision group (+ the ZeRO-1
  parameter broadcast), the text gradients over the text DP group, and the AdamW update, memory
  bound at ``2 * state_bytes`` per parameter the rank updates over ``hbm_bw``.

**Schedules** (`ray_dhp.step.schedule`, per-micro-batch phases ``vf`` vision forward, ``vb`` vision
backward, ``t`` text forward + backward, ``c`` one boundary transfer, ``M`` micro-batches):

* sequential, and every collocated layout: ``M * (vf + vb + t + 2c)``;
* pipelined (disjoint, ``M >= 2``): the order ``V0 S0 | T0·V1 S1 | R0 T1·V2 S2 | R1 ...`` gives
  ``vf + max(t, vf) + (M - 2) * max(t, vf + vb) + max(t, vb) + vb + 2Mc``: vision's first
  forward and last backward are not overlapped, in between text runs ``T(k)`` while vision runs
  ``B(k-1)`` and ``F(k+1)``. With ``v = vf + vb = t`` (balanced groups, ``c = 0``) it is
  ``(M + 1) * v``, i.e. ``(M + 1) / M * max(V, T)`` for the step totals ``V = Mv``, ``T = Mt``
  against ``V + T`` sequential; each ``max(a, b) <= a + b``, so it never exceeds sequential.

plus the end of step (added for collocated layouts, whose ranks do both modules' work; the
larger of the two for disjoint ones). Per-group idle fraction = 1 - busy / step, busy being the
group's compute, its own collectives and the boundary transfers.

The defaults (`Hardware`) are H100/H200 SXM with NVLink 4: they set the compute-to-communication
balance, so the ranking matters more than the absolute seconds. The schedule part is checked
against measured CPU phase times in benchmarks/schedule_model.py and docs/placement.md.
"""

from __future__ import annotations

from typing import Optional

from ray_dhp.planning.cost_types import Hardware, Layout, PhaseTimes, Workload
from ray_dhp.planning.links import all_reduce_s as _all_reduce
from ray_dhp.planning.links import all_to_all_s as _all_to_all
from ray_dhp.planning.links import link_bw as _bw
from ray_dhp.planning.links import zero_extra_s as _zero_extra
from ray_dhp.planning.memory import ActivationSettings, merged, vision_depth
from ray_dhp.models.layer_config import layer_max
from ray_dhp.models.sizes import vision_width
from ray_dhp.parallel.nodes import fill_nodes

__all__ = ["phase_times", "step_time", "schedule_time", "vision_flops", "text_flops",
           "text_tokens_per_sample", "replica_share"]


# -- FLOPs ---------------------------------------------------------------------------------------

def _recompute(settings: ActivationSettings) -> float:
    return 4 / 3 if settings.checkpointing else 1.0


def _vision_spans(vc) -> tuple:
    """(full-attention blocks, window-attention blocks, patches per window) as ray_dhp.planning.memory
    counts them: a windowed tower lists its full blocks (``fullatt_block_indexes``), the other
    towers attend fully everywhere."""
    depth = vision_depth(vc)
    full = len(getattr(vc, "fullatt_block_indexes", None) or range(depth))
    window = (getattr(vc, "window_size", 0) // vc.patch_size) ** 2 if full < depth else 0
    return full, depth - full, window


def vision_flops(config, vision_params: int, vision_tokens: int,
                 settings: ActivationSettings = ActivationSettings(),
                 segment: Optional[int] = None) -> float:
    """Training FLOPs of the vision tower for one sample of ``vision_tokens`` patches, attending
    within segments of ``segment`` patches (a video's frames; None: one image, one segment)."""
    from ray_dhp.models import family_of

    vc, family = config.vision_config, family_of(config)
    h, merge = vision_width(vc), merged(config)
    m = merge * h  # the merger's input width
    merger = min(vision_params, (m * m + m * family.vision_out_dim(config))
                 * (1 + family.num_deepstack(config)))
    dense = 6 * (vision_params - merger) * vision_tokens + 6 * merger * vision_tokens / merge
    full, windowed, window = _vision_spans(vc)
    seg = min(segment or vision_tokens, vision_tokens)
    span = full * seg + windowed * min(window or seg, seg)
    return (dense + 12 * h * vision_tokens * span) * _recompute(settings)


def text_tokens_per_sample(config, vision_tokens: int, text_tokens: int) -> int:
    return text_tokens + vision_tokens // merged(config)


def text_flops(config, text_params: int, vision_tokens: int, text_tokens: int,
               settings: ActivationSettings = ActivationSettings()) -> float:
    """Training FLOPs of the language model for one sample (its image tokens included)."""
    tc = config.text_config
    s = text_tokens_per_sample(config, vision_tokens, text_tokens)
    tied = getattr(config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False)
    from ray_dhp.planning.experts import inactive_expert_params

    matmul = text_params - (0 if tied else tc.vocab_size * tc.hidden_size) - inactive_expert_params(config)
    d = tc.num_attention_heads * (layer_max(tc, "head_dim") or tc.hidden_size // tc.num_attention_heads)
    return (6 * matmul * s + 6 * tc.num_hidden_layers * d * s * s) * _recompute(settings)


def replica_share(w: Workload, dp: int, per_sample) -> float:
    """Sum of ``per_sample(vision_tokens)`` over one data-parallel replica's share of a
    micro-batch. One size: ``ceil(mb / dp)`` samples. A mix, shared out by cost
    (``balance: cost``, `ray_dhp.parallel.balance`): the mean share ``mb · E[per_sample] / dp``,
    but at least the largest sample whenever the micro-batch holds one (a sample is never split
    over replicas): ``max(mean, P(one in mb) · per_sample(largest))``, an expected value."""
    if w.vision_mix is None:
        return -(-w.micro_batch_size // dp) * per_sample(w.vision_tokens)
    mb = w.micro_batch_size
    mean = mb * sum(f * per_sample(v) for v, f in w.vision_mix) / dp
    largest, f_max = max(w.vision_mix)
    return max(mean, (1 - (1 - f_max) ** mb) * per_sample(largest))


def _packed_padding(config, w: Workload, dp: int) -> int:
    """Padding tokens of a text replica's packed rows (``Workload.packing``,
    `ray_dhp.planning.packing`: the rows padded to the longest); 0 without packing or with a
    resolution mix (rows of mixed samples fill up: counted as without padding)."""
    if w.packing is None or w.vision_mix is not None:
        return 0
    n, seq = -(-w.micro_batch_size // dp), text_tokens_per_sample(config, w.vision_tokens, w.text_tokens)
    return w.packing.text_tokens(n, seq)[0] - n * seq


# -- communication ----------------------------------------------------------------------------

def phase_times(config, counts, layout: Layout, w: Workload, hw: Hardware) -> PhaseTimes:
    """Per-rank seconds of every phase of one step for ``layout`` (see the module docstring)."""
    from ray_dhp.models import family_of

    topo, s = layout.topology(), w.settings
    v, t = topo.vision, topo.text
    vc, tc = config.vision_config, config.text_config
    flops = hw.flops(s.dtype_bytes)
    ckpt = s.checkpointing
    # per replica and micro-batch (a resolution mix: the balanced share, see replica_share)
    v_tokens = replica_share(w, v.dp, lambda vt: vt)
    t_tokens = replica_share(w, t.dp, lambda vt: text_tokens_per_sample(config, vt, w.text_tokens))
    # vision: compute split 1 : 2 (forward : backward), 1 : 3 with the forward recomputed
    v_comp = replica_share(w, v.dp, lambda vt: vision_flops(config, counts.vision, vt, s,
                                                            w.vision_segment)) \
        / v.inner / flops
    fwd_share = 0.25 if ckpt else 1 / 3
    x = v_tokens / v.inner * vision_width(vc) * s.dtype_bytes  # [tokens/sp, h]
    nodes = fill_nodes(topo, hw.gpus_per_node)  # as the backend will order the ranks
    bw_sp = _bw(hw, v.inner_groups(), nodes)
    a2a = _vision_spans(vc)[0] * (_all_to_all(hw, 3 * x, v.inner, bw_sp)
                                  + _all_to_all(hw, x, v.inner, bw_sp))
    v_comm = a2a * (3 if ckpt else 2)
    # text: compute + 4 all-reduces of [tokens, hidden] per layer (6 when recomputing) + embedding;
    # text SP turns each into an all-gather + reduce-scatter (same bytes) and re-gathers in backward
    tok = t_tokens / t.cp  # context parallelism: each CP rank runs its slice (heads, for attention)
    t_comp = replica_share(w, t.dp, lambda vt: text_flops(config, counts.text, vt, w.text_tokens, s)) \
        / t.inner / t.cp / flops
    pad = _packed_padding(config, w, t.dp)
    if pad:  # the packed rows' padded tail: linears on its tokens, attention as a segment
        tok += pad / t.cp
        t_comp += text_flops(config, counts.text, 0, pad, s) / t.inner / t.cp / flops
    n_ar = tc.num_hidden_layers * (6 if ckpt else 4) + 1
    if layout.text_sp:  # + the projection inputs all-gathered again in backward (2 x half an all-reduce)
        n_ar += tc.num_hidden_layers + 0.5
    t_comm = n_ar * _all_reduce(hw, tok * tc.hidden_size * s.dtype_bytes, t.inner,
                                _bw(hw, t.inner_groups(), nodes))
    if t.cp > 1:  # CP: q, k, v and the output re-sharded per layer, forward + backward (+ recompute)
        from ray_dhp.planning.memory import cp_working_bytes
        from ray_dhp.planning.ring_cost import ring_form, ring_sent_bytes

        bw_cp = _bw(hw, t.cp_groups(), nodes)
        if ring_form(tc, t.inner, t.cp):  # ring attention: its point-to-point, not overlapped
            steps = (3 if ckpt else 2) * (t.cp + 1)  # the ring's steps and the swaps, each a latency
            t_comm += tc.num_hidden_layers * (ring_sent_bytes(tc, t_tokens, t.inner, t.cp,
                                                              s.dtype_bytes, ckpt) / bw_cp
                                              + steps * hw.latency_s)
        else:
            t_comm += tc.num_hidden_layers * (3 if ckpt else 2) * _all_to_all(
                hw, cp_working_bytes(tc, t_tokens, t.inner, t.cp, s) / 2, t.cp, bw_cp)
    ep = topo.text_expert_parallel
    if ep > 1:  # the experts' dispatch / combine all-to-alls (`ray_dhp.planning.experts`)
        from ray_dhp.parallel.expert import ep_groups
        from ray_dhp.planning.experts import buffer_bytes

        t_comm += _all_to_all(hw, buffer_bytes(config, tok, 1, ckpt, s.dtype_bytes), ep,
                              _bw(hw, ep_groups(t, ep), nodes))
    # boundary: features of the replica's samples, replicated over TP
    feat = family_of(config).feature_dim(config) * s.dtype_bytes / merged(config)
    boundary_bw = _bw(hw, [v.ranks + t.ranks], nodes)
    boundary = max(replica_share(w, t.dp, lambda vt: vt) * feat,
                   v_tokens * feat / v.inner * t.inner) / boundary_bw + hw.latency_s
    # end of step: gradient reduction (fp32 under every policy: the bf16 ones accumulate and
    # reduce in fp32) + AdamW update
    g = 4
    zero1 = v.zero_stage > 0 and v.size > 1
    bw_v = _bw(hw, [v.ranks], nodes)
    v_end = (_all_reduce(hw, counts.vision * g, v.size, bw_v)
             + (_all_to_all(hw, counts.vision * 4, v.size, bw_v) if zero1 else 0.0)
             + counts.vision / (v.size if zero1 else 1) * 2 * w.state_bytes / hw.hbm_bw)
    t_rank = counts.text_per_rank(t.inner)
    from ray_dhp.planning.experts import gradient_split

    dense, experts = gradient_split(counts, t.inner, ep)  # experts: summed over EDP only
    t_end = (_all_reduce(hw, dense * g, t.dp * t.cp, _bw(hw, t.dp_groups(), nodes))
             + t_rank * 2 * w.state_bytes / hw.hbm_bw)
    if experts:  # + the experts' owners' broadcast over their replicas (ZeRO 1-2)
        from ray_dhp.parallel.expert import edp_groups, replica_groups
        from ray_dhp.parallel.zero import replica_bytes

        t_end += _all_reduce(hw, experts * g, t.dp * t.cp // ep, _bw(hw, edp_groups(t, ep), nodes))
        if t.zero_stage in (1, 2):
            reps = replica_groups(t, ep)
            t_end += replica_bytes(len(reps[0]), 1, 0, experts * 4) / _bw(hw, reps, nodes)
    # ZeRO stages 2-3 (chosen by `ray_dhp.planning.recommend` where the default does not fit):
    # their traffic beyond the all-reduce above (`ray_dhp.parallel.zero.replica_bytes`)
    v_end += _zero_extra(v.size, v.zero_stage, counts.vision * g, counts.vision * s.dtype_bytes,
                         bw_v, w.micro_batches)
    t_end += _zero_extra(t.dp * t.cp, t.zero_stage, t_rank * g, t_rank * s.dtype_bytes,
                         _bw(hw, t.dp_groups(), nodes), w.micro_batches)
    from ray_dhp.planning.cost_audio import audio_phases

    return PhaseTimes(vision_fwd=v_comp * fwd_share + a2a, vision_bwd=v_comp * (1 - fwd_share)
                      + v_comm - a2a, text=t_comp + t_comm, boundary=boundary, vision_end=v_end,
                      text_end=t_end, vision_comm=v_comm, text_comm=t_comm,
                      **audio_phases(config, topo, w, hw, nodes))


# -- schedules -----------------------------------------------------------------------------------

def schedule_time(schedule: str, micro_batches: int, vision_fwd: float, vision_bwd: float,
                  text: float, boundary: float = 0.0) -> float:
    """Seconds of the micro-batch part of a step (see the module docstring for the derivation)."""
    m, vf, vb, t, c = micro_batches, vision_fwd, vision_bwd, text, boundary
    if schedule == "sequential" or m == 1:
        return m * (vf + vb + t + 2 * c)
    if schedule != "pipelined":
        raise ValueError(f"schedule={schedule!r}: use 'sequential' or 'pipelined'.")
    return vf + max(t, vf) + (m - 2) * max(t, vf + vb) + max(t, vb) + vb + 2 * m * c


def step_time(layout: Layout, p: PhaseTimes, micro_batches: int) -> tuple:
    """(step seconds, {group: idle fraction}) of ``layout`` with phase times ``p``. The encoders
    (vision, audio) of one micro-batch run one after the other on collocated ranks and
    concurrently on disjoint ones (`ray_dhp.planning.cost_audio`); the text ranks receive both
    encoders' features (their transfers add)."""
    sched = "sequential" if layout.placement == "collocated" else layout.schedule
    m, c = micro_batches, p.boundary + p.audio_boundary
    if layout.placement == "collocated":
        body = schedule_time(sched, m, p.vision_fwd + p.audio_fwd, p.vision_bwd + p.audio_bwd,
                             p.text, c)
        return body + p.vision_end + p.audio_end + p.text_end, \
            {"+".join(x.name for x in layout.topology().modules): 0.0}
    body = schedule_time(sched, m, max(p.vision_fwd, p.audio_fwd), max(p.vision_bwd, p.audio_bwd),
                         p.text, c)
    step = body + max(p.vision_end, p.audio_end, p.text_end)
    busy = {"vision": m * (p.vision_fwd + p.vision_bwd) + 2 * m * p.boundary + p.vision_end,
            "text": m * p.text + 2 * m * c + p.text_end}
    if layout.audio_dp:
        busy["audio"] = m * (p.audio_fwd + p.audio_bwd) + 2 * m * p.audio_boundary + p.audio_end
    return step, {g: max(0.0, 1 - b / step) for g, b in busy.items()}
