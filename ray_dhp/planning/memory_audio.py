"""The audio encoder's group in `ray-dhp plan` (an audio LM's thinker: ``model.audio_tower``, a
Whisper-style encoder; the family's ``audio`` encoder module in `ray_dhp.models`): its parameters,
per-rank model state and activations, and the tokens a clip adds to the language model's sequence.

Tokens of a clip of ``seconds`` (the Whisper-style tower's stock transformers encoder class, the
``audio`` operations' ``tower_class``): the Whisper feature extractor gives 100 log-mel frames
per second (hop 160 at 16 kHz); ``conv2`` (stride 2) halves them into the encoder,
``(frames - 1) // 2 + 1`` tokens (50 per second); after the layers a stride-2 average pool halves
them again into the LM, ``(tokens - 2) // 2 + 1`` rows (25 per second: the thinker's
``position_id_per_seconds``). Attention runs inside chunks of
``2 · n_window`` mel frames (``n_window`` tokens: 100 in the released model); the convolutions see
each clip cut into such chunks, the last padded to the longest chunk.

Model state: the audio group holds the whole tower on every rank (no sequence parallelism yet)
and its ZeRO stage (0-2) partitions the masters and AdamW moments over its ``data_parallel``
ranks with the engine's greedy partition (`ray_dhp.parallel.zero.owners`), as for the ViT. When
the topology has an audio group the tower's parameters leave the text ranks (`without_audio`).

Activations, per encoder token (``d`` the activation element size, ``h`` = ``d_model``, ``i`` =
``encoder_ffn_dim``), as measured with ``saved_tensors_hooks`` on the stock encoder
(``tests/unit/test_plan_audio.py``): per layer ``d·(9h + 2i) + 16 + 4·heads`` (two LayerNorms'
inputs and fp32 mean/rstd, the q/k/v projections' shared input and outputs, the attention output
and the out projection's input, fc1's input and output, fc2's input; the kernel's fp32
log-sum-exp per head; on CUDA's flash path, which skips the per-chunk split and concatenation,
``h`` less: an upper bound there); once per padded mel frame the conv1 input (``n_mels``), conv1's output and
the masked product (``2h``) and the int64 mask, ``h`` per padded conv2 output, the int64 gather
indices, and per pooled row ``ln_post``'s input and statistics and ``proj``'s input. With
activation checkpointing each layer keeps only its input (``d·h``), plus one layer recomputed;
with eager attention the chunk's ``heads × n_window²`` scores and probabilities are added.
Under ``bf16_autocast`` the bf16 copies of the tower's linear and convolution weights that
autocast keeps for backward (`audio_cast_bytes`; without them the audio autocast row of the
plan-accuracy matrix planned 0.946 of the measured activations, with them 0.989).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ray_dhp.models.sizes import owned
from ray_dhp.planning.memory import (STATE_BYTES_PER_PARAM, ActivationSettings,  # noqa: F401
                                     estimate_ranks)
from ray_dhp.planning.memory_state import RankState, _bytes, rank_state

FRAMES_PER_SECOND = 100  # Whisper log-mel frames (hop 160 at 16 kHz)


@dataclass(frozen=True)
class AudioCounts:
    """Parameters of the audio tower: total, frozen, each trained one's size (model order)."""

    params: int
    frozen: int = 0
    sizes: tuple = ()
    largest: int = 0
    cast: int = 0        # weights of its linear and convolution layers (what autocast copies)
    cast_layer: int = 0  # of those, one encoder layer's (the largest ModuleList's member)


def count_audio(config, tuning=None) -> Optional[AudioCounts]:
    """The audio tower's parameters (meta device), or None for a model without one. ``tuning``
    (`ray_dhp.config.tuning.Tuning`): the module ``audio`` frozen or trained (default trained)."""
    from ray_dhp.models import encoder_operations

    ac = getattr(config, "audio_config", None)
    if ac is None:
        return None
    tower = encoder_operations("audio").empty_tower(ac)
    trains = True if tuning is None else tuning.choice("audio").train
    sizes = tuple(p.numel() for p in tower.parameters())
    return AudioCounts(params=sum(sizes), frozen=0 if trains else sum(sizes),
                       sizes=sizes if trains else (), largest=max(sizes), **_cast_weights(tower))


def _cast_weights(tower) -> dict:
    """``cast`` / ``cast_layer`` of `AudioCounts`: the weights autocast copies to bf16 (those of
    linear and convolution layers: not embeddings, norms or biases), the whole tower's and one
    layer's."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)

    def weights(module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, kinds))
    lists = [m for m in tower.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    return {"cast": weights(tower), "cast_layer": weights(layers[0]) if layers is not None else 0}


def audio_cast_bytes(audio: AudioCounts, s: ActivationSettings, layers: int) -> float:
    """The bf16 copies autocast keeps of the tower's weights (`ray_dhp.planning.memory.
    weight_cast_bytes` for the audio tower; none without autocast): 2 B per linear / convolution
    weight; under activation checkpointing the ``layers`` blocks' copies are made again as each
    is recomputed: the rest's plus one block's. Measured by the plan-accuracy matrix's audio
    ``bf16_autocast`` row."""
    if not s.autocast:
        return 0.0
    if not s.checkpointing:
        return 2.0 * audio.cast
    return 2.0 * (audio.cast - layers * audio.cast_layer + audio.cast_layer)


def without_audio(counts):
    """`ray_dhp.models.sizes.ParamCounts` of the model less its audio tower (which the text
    ranks then do not hold): the tower's parameters are never TP-sharded."""
    audio = [q for q in counts.text_sizes if q.audio]
    return dataclasses.replace(
        counts, text=counts.text - sum(q.numel for q in audio),
        text_frozen=counts.text_frozen - sum(q.numel for q in audio if not q.trained),
        text_sizes=tuple(q for q in counts.text_sizes if not q.audio))


def audio_rank_state(a: AudioCounts, layout, rank: int, policy, largest: int = 0) -> RankState:
    """Model-state bytes of the audio tower on ``rank`` of the audio group ``layout`` (a
    `ray_dhp.parallel.topology.ModuleLayout`, ZeRO stage 0-2) under ``policy``; ``largest``: the
    elements of the one full fp32 tensor of the start-up peak (0 when another module's state on
    the same rank already counts it)."""
    if layout.zero_stage == 3:
        raise ValueError("audio.zero_stage=3 is not covered (see DHPConfig).")
    trained = a.params - a.frozen
    n, index = layout.size, rank - layout.offset
    updated = owned(list(a.sizes), index, n) if layout.zero_stage and n > 1 and a.sizes else trained
    off = updated if layout.offload else 0
    copy_bytes = 4 if policy.master else policy.weight_bytes()
    moment = _bytes(policy.moment_dtype)
    masters = 4 * updated if policy.master else copy_bytes * off
    weights = a.params * policy.weight_bytes()
    optimizer = updated * 2 * moment
    saved = masters + (a.params - (updated if policy.master else off)) * policy.weight_bytes()
    return RankState(params=a.params, updated=updated, weights=weights,
                     grads=trained * policy.grad_bytes(), masters=masters, optimizer=optimizer,
                     released=(trained - updated) * policy.grad_bytes(),
                     startup_peak=weights + masters - off * copy_bytes + 4 * largest,
                     staging=saved + optimizer, host=off * (copy_bytes + 2 * moment))


def module_rank_state(counts, audio: Optional[AudioCounts], topology, rank: int,
                      policy, micro_batches: int = 1) -> RankState:
    """`rank_state` of ``rank`` over every module it hosts: the vision and text state of
    `rank_state` (without the audio tower when the topology has an audio group) plus the audio
    group's (`audio_rank_state`). Without an audio group: `rank_state` itself."""
    a_layout = topology.encoder("audio")
    if audio is None or a_layout is None:
        return rank_state(counts, topology, rank, policy, micro_batches)
    if not a_layout.hosts(rank):
        return rank_state(without_audio(counts), topology, rank, policy, micro_batches)
    if topology.hosted(rank) == (a_layout,):  # no other module's state counts the largest tensor
        return audio_rank_state(audio, a_layout, rank, policy, largest=audio.largest)
    base = rank_state(without_audio(counts), topology, rank, policy, micro_batches)
    extra = audio_rank_state(audio, a_layout, rank, policy)
    return RankState(**{f.name: getattr(base, f.name) + getattr(extra, f.name)
                        for f in dataclasses.fields(RankState)})


@dataclass(frozen=True)
class ClipShape:
    """What one clip of ``seconds`` becomes (see the module docstring)."""

    frames: int         # log-mel frames
    padded_frames: int  # frames the convolutions see (chunks padded to the longest)
    tokens: int         # encoder tokens (after conv2)
    lm_tokens: int      # rows handed to the LM (after the pool): its <|AUDIO|> placeholders
    chunk_tokens: int   # encoder tokens per attention chunk (the longest)


def clip_shape(audio_config, seconds: float) -> ClipShape:
    """The frames and tokens of one ``seconds`` clip for ``audio_config``."""
    frames = max(1, round(seconds * FRAMES_PER_SECOND))
    chunk = 2 * audio_config.n_window
    longest = min(chunk, frames)
    padded = -(-frames // chunk) * longest
    tokens = (frames - 1) // 2 + 1
    return ClipShape(frames, padded, tokens, (tokens - 2) // 2 + 1, (longest - 1) // 2 + 1)


def audio_activation_bytes(ac, clips: int, seconds: float, s: ActivationSettings) -> float:
    """Activation bytes of one audio rank for ``clips`` clips of ``seconds`` each (``ac``: the
    audio config; ``s``: an `ActivationSettings`; module docstring)."""
    c = clip_shape(ac, seconds)
    h, i, d = ac.d_model, ac.encoder_ffn_dim, s.dtype_bytes
    heads, layers = ac.encoder_attention_heads, ac.encoder_layers
    per_layer = c.tokens * (d * (9 * h + 2 * i) + 16 + 4 * heads)
    if s.checkpointing:
        blocks = layers * c.tokens * d * h + per_layer
    else:
        blocks = layers * per_layer
    convs = c.padded_frames * (d * ac.num_mel_bins + 2 * d * h + 8) + c.padded_frames // 2 * d * h
    post = 8 * c.tokens + c.lm_tokens * (2 * d * h + 8 + 16)
    total = blocks + convs + post
    if s.attention == "eager":
        chunks = -(-c.tokens // c.chunk_tokens)
        kept = 1 if s.checkpointing else layers
        total += 2 * heads * chunks * c.chunk_tokens ** 2 * d * kept
    return clips * total


def lm_audio_tokens(config, seconds: float) -> int:
    """Tokens one clip adds to the LM's sequence: its audio pads (the family's rule,
    `ray_dhp.models.prompt_format.PromptFormat.clip_rows`) plus the start / end tokens around
    them."""
    from ray_dhp.models import family_of

    frames = clip_shape(config.audio_config, seconds).frames
    return family_of(config).prompt_format.clip_rows(frames) + 2


def estimate_module_ranks(config, topology, counts, audio: Optional[AudioCounts], *,
                          audio_seconds: float, text_tokens: int, samples: int,
                          settings: ActivationSettings, policy=None,
                          audio_samples: Optional[int] = None, lm_tokens_included: bool = False,
                          state_bytes: float = STATE_BYTES_PER_PARAM, **kw) -> list:
    """`ray_dhp.planning.memory.estimate_ranks` over every module: with an audio group, each
    sample also carries one clip of ``audio_seconds`` (its rows lengthen the LM's sequence), the
    audio ranks hold the tower (`module_rank_state`) and its activations (``audio_act``), and
    the text ranks no longer hold it; ``audio_samples``: clips per audio replica (default
    ``samples``, the other modules' per-replica share); ``lm_tokens_included``: ``text_tokens``
    counts the clip's LLM tokens already (the recommender's `Workload`). Without an audio group:
    `estimate_ranks` itself."""
    common = dict(samples=samples, settings=settings, policy=policy, state_bytes=state_bytes, **kw)
    if audio is None or topology.encoder("audio") is None:
        return estimate_ranks(config, topology, counts, text_tokens=text_tokens, **common)
    extra = 0 if lm_tokens_included else lm_audio_tokens(config, audio_seconds)
    rows = estimate_ranks(config, topology, without_audio(counts), text_tokens=text_tokens + extra,
                          **common)
    act = audio_activation_bytes(config.audio_config, audio_samples or samples, audio_seconds,
                                 settings)
    act += audio_cast_bytes(audio, settings, config.audio_config.encoder_layers)
    a_layout, out = topology.encoder("audio"), []
    for m in rows:
        hosts = a_layout.hosts(m.rank)
        if policy is not None:
            state = module_rank_state(counts, audio, topology, m.rank, policy,
                                      kw.get("micro_batches", 1)).device_total
        else:
            state = m.state_bytes + (audio.params * state_bytes if hosts else 0)
        out.append(dataclasses.replace(m, params=m.params + (audio.params if hosts else 0),
                                       state_bytes=state, audio_act=act if hosts else 0.0))
    return out
