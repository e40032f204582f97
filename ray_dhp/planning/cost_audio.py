"""The audio encoder's group in the cost model (`ray_dhp.planning.cost_model`) and the
recommender: its phases per micro-batch and per step, and the three-module layouts.

**Compute.** Training FLOPs per clip of ``seconds`` (`ray_dhp.planning.memory_audio.clip_shape`:
``T`` encoder tokens, attention inside chunks of ``c`` tokens): ``6 * P_a * T`` for the linears
and convolutions (the conv1 kernel runs over ``2T`` mel frames at ``n_mels`` input width and the
projection over ``T/2`` pooled rows; counting every parameter over ``T`` tokens is within a few
per cent of both), plus attention ``12 * h * T * c`` per layer; x 4/3 with activation
checkpointing. An audio replica gets ``ceil(mb / dp_a)`` clips of a micro-batch (one clip per
sample); the group trains data parallel only, so each rank computes its replica's share.

**Communication.** The boundary: a text rank receives its replica's audio rows (``T/2 + ...``
rows of ``output_dim``, replicated over TP), an audio rank sends its rows to the ``tp`` ranks of
the owning replica; the text ranks receive the vision and the audio features one after the
other, so their transfer times add. End of step: the audio gradients all-reduced over the
audio group (+ the ZeRO-1 parameter broadcast, + the stage-2 difference), and the AdamW update
at ``2 * state_bytes`` per parameter the rank updates over ``hbm_bw``.

**Schedules** (`ray_dhp.planning.cost_model.step_time`): the encoders run on the same micro-batch
independently of each other. Collocated, a rank runs them one after the other (their phase
times add); disjoint, each on workers of its own, concurrently: the encoder stage of a
micro-batch takes the longer of the two, and the pipelined formula of the two-module case
applies with ``vf = max(vision_fwd, audio_fwd)``, ``vb = max(vision_bwd, audio_bwd)``. Without an
audio group every audio phase is 0 and the formulas are the two-module ones, term for term.
"""

from __future__ import annotations

from ray_dhp.planning.links import all_reduce_s, all_to_all_s, link_bw, zero_extra_s
from ray_dhp.planning.memory_audio import clip_shape

__all__ = ["audio_flops", "audio_phases", "audio_layouts"]


def audio_flops(config, audio_params: int, seconds: float, settings) -> float:
    """Training FLOPs of the audio encoder for one clip of ``seconds``."""
    ac = config.audio_config
    c = clip_shape(ac, seconds)
    dense = 6 * audio_params * c.tokens
    attention = 12 * ac.d_model * c.tokens * c.chunk_tokens * ac.encoder_layers
    return (dense + attention) * (4 / 3 if settings.checkpointing else 1.0)


def audio_phases(config, topology, w, hw, nodes) -> dict:
    """``{audio_fwd, audio_bwd, audio_boundary, audio_end}`` seconds on an audio rank of
    ``topology`` for the workload ``w`` (``w.audio_seconds``, ``w.audio_params``: an
    `ray_dhp.planning.memory_audio.AudioCounts`); all 0 without an audio group."""
    a, t = topology.encoder("audio"), topology.text
    if a is None:
        return {"audio_fwd": 0.0, "audio_bwd": 0.0, "audio_boundary": 0.0, "audio_end": 0.0}
    s, params = w.settings, w.audio_params.params
    mb = w.micro_batch_size
    clips = -(-mb // a.dp)
    comp = clips * audio_flops(config, params, w.audio_seconds, s) / hw.flops(s.dtype_bytes)
    fwd_share = 0.25 if s.checkpointing else 1 / 3
    rows = clip_shape(config.audio_config, w.audio_seconds).lm_tokens
    feat = config.audio_config.output_dim * s.dtype_bytes
    boundary = (max(-(-mb // t.dp) * rows * feat, clips * rows * feat * t.inner)
                / link_bw(hw, [a.ranks + t.ranks], nodes) + hw.latency_s)
    bw = link_bw(hw, [a.ranks], nodes)
    zero1 = a.zero_stage > 0 and a.size > 1
    end = (all_reduce_s(hw, params * 4, a.size, bw)
           + (all_to_all_s(hw, params * 4, a.size, bw) if zero1 else 0.0)
           + params / (a.size if zero1 else 1) * 2 * w.state_bytes / hw.hbm_bw
           + zero_extra_s(a.size, a.zero_stage, params * 4, params * s.dtype_bytes, bw))
    return {"audio_fwd": comp * fwd_share, "audio_bwd": comp * (1 - fwd_share),
            "audio_boundary": boundary, "audio_end": end}


def audio_layouts(n: int, micro_batches: int, layout_cls, divisors) -> list:
    """Every three-module layout of ``n`` workers: collocated (audio data parallel over all
    ``n``), and disjoint ``Nv + Na + Nt = n`` (vision ``sp | Nv``, audio ``dp = Na``, text
    ``tp | Nt``; text sequence parallelism with TP > 1; pipelined only when M >= 2)."""
    def sps(tp):
        return (False, True) if tp > 1 else (False,)

    out = [layout_cls("collocated", "sequential", sp, n // sp, tp, n // tp, tsp, audio_dp=n)
           for sp in divisors(n) for tp in divisors(n) for tsp in sps(tp)]
    schedules = ("sequential", "pipelined") if micro_batches > 1 else ("sequential",)
    for na in range(1, n - 1):
        for nv in range(1, n - na):
            nt = n - na - nv
            out += [layout_cls("disjoint", sc, sp, nv // sp, tp, nt // tp, tsp, audio_dp=na)
                    for sp in divisors(nv) for tp in divisors(nt)
                    for sc in schedules for tsp in sps(tp)]
    return out
