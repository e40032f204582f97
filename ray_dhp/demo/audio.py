"""The demo's audio side: a tiny Qwen2.5-Omni thinker, its processor, and a generated clip set.

* `omni_tokenizer` / `omni_config` / `omni_processor`, called by
  ``demo.tiny_model_config("qwen2_5_omni")`` / ``demo.tiny_processor("qwen2_5_omni")`` with the
  demo's own parts (this module does not import `ray_dhp.demo`): the *thinker* of Qwen2.5-Omni
  (``Qwen2_5OmniThinkerForConditionalGeneration``: Whisper-style audio encoder, the Qwen2.5-VL
  ViT, the Qwen2 LM) at the demo's tiny size, built offline from the demo tokenizer plus the
  three Omni audio tokens; the processor adds a Whisper log-mel feature extractor.
* `write_wav` / `tone` / `make_audio_dataset`: 16-bit PCM wav clips synthesised with numpy
  (steady tones and rising / falling chirps), captioned with their label (mixed with images,
  videos and text-only records: `ray_dhp.demo.omni`).
"""

from __future__ import annotations

import copy
import functools
import json
import random
import wave
from pathlib import Path

import numpy as np

__all__ = ["AUDIO_TOKENS", "QWEN3_OMNI_AUDIO_TOKENS", "omni_template", "omni_tokenizer",
           "omni_config", "omni3_config", "omni_processor", "tone", "write_wav",
           "make_audio_dataset", "SOUNDS"]

#: Qwen2.5-Omni's audio tokens (pad, start, end), appended after the demo tokenizer's
#: vocabulary (ids 371-373).
AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
#: Qwen3-Omni's (its tokenizer's names; the same ids in the demo tokenizer)
QWEN3_OMNI_AUDIO_TOKENS = ("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>")
SOUNDS = ("low tone", "high tone", "rising chirp", "falling chirp")
_FREQS = {"low tone": (220.0, 220.0), "high tone": (880.0, 880.0),
          "rising chirp": (200.0, 1600.0), "falling chirp": (1600.0, 200.0)}
PROMPT = "What do you hear?"


def omni_template(chat_template: str, tokens: tuple = AUDIO_TOKENS) -> str:
    """The demo's chat template with an audio branch (before its text branch), writing a clip as
    the model's template does (start, pad, end of ``tokens``: Qwen2.5-Omni's
    ``<|audio_bos|><|AUDIO|><|audio_eos|>``)."""
    anchor = "{% elif 'text' in item %}"
    assert chat_template.count(anchor) == 1
    pad, start, end = tokens
    branch = f"{{% elif item['type'] == 'audio' or 'audio' in item %}}{start}{pad}{end}"
    return chat_template.replace(anchor, branch + anchor)


@functools.lru_cache(maxsize=None)
def omni_tokenizer(base, chat_template: str, tokens: tuple = AUDIO_TOKENS):
    """``base`` (the demo tokenizer: same ids) plus the audio ``tokens`` (pad, start, end:
    `AUDIO_TOKENS` or `QWEN3_OMNI_AUDIO_TOKENS`) as special tokens, with the attributes the Omni
    processors read (``audio_token``, ``vision_bos_token``, ...) and `omni_template` of
    ``chat_template``. Cached: do not modify it."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(base._tokenizer), pad_token=base.pad_token,
        eos_token=base.eos_token, chat_template=omni_template(chat_template, tokens),
        model_max_length=32768,
        extra_special_tokens={
            "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
            "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
            "audio_token": tokens[0], "audio_bos_token": tokens[1], "audio_eos_token": tokens[2]})
    assert [tok.convert_tokens_to_ids(t) for t in tokens] == list(range(len(base), len(base) + 3))
    return tok


def omni_config(tok, ids: dict, text: dict, vision: dict):
    """A tiny ``Qwen2_5OmniThinkerConfig`` from the demo's parts: ``tok`` (`omni_tokenizer`),
    ``ids`` (the demo's special-token ids), ``text`` and ``vision`` (the Qwen2.5-VL tiny text and
    vision config dicts: Qwen2 LM hidden 64, 4+4 heads, 2 layers; windowed ViT hidden 32, 4 heads,
    depth 4, full attention in blocks 1 and 3), and an audio encoder of 128 mel bins, d_model
    32, 4 heads, 2 layers, ``n_window`` 25 (attention chunks of 50 feature frames, so a 1 s clip
    spans two), output 64. fp32, dropout 0, sdpa."""
    from transformers import Qwen2_5OmniThinkerConfig

    text = {k: v for k, v in text.items() if k != "dtype"}
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "d_model": 32, "output_dim": 64, "n_window": 25,
             "max_source_positions": 1500, "dropout": 0.0, "attention_dropout": 0.0,
             "activation_dropout": 0.0}
    vision = {k: v for k, v in vision.items() if k != "tokens_per_second"}
    a_id, bos, eos = (tok.convert_tokens_to_ids(t) for t in AUDIO_TOKENS)
    config = Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        audio_token_index=a_id, audio_start_token_id=bos, audio_end_token_id=eos,
        image_token_index=ids["image_token_id"], video_token_index=ids["video_token_id"],
        user_token_id=tok.convert_tokens_to_ids("user"))
    return _finished(config, ids)


def omni3_config(tok, ids: dict, text: dict, vision: dict):
    """A tiny ``Qwen3OmniMoeThinkerConfig`` from the demo's parts: ``tok`` (`omni_tokenizer` with
    `QWEN3_OMNI_AUDIO_TOKENS`), ``ids`` (the demo's special-token ids), ``text`` (the tiny
    Qwen3-VL-MoE LM dict: hidden 64, 4+4 heads of 16, 2 layers of 8 experts, top-2) and
    ``vision`` (the tiny Qwen3-VL ViT dict: deepstack after blocks 1 and 2), and a Qwen3-Omni
    audio tower of 128 mel bins, convs of 8 channels, d_model 32, 4 heads, 2 layers, output 64,
    the released ``n_window`` 50 (chunks of 100 feature frames: 13 rows each) and
    ``n_window_infer`` 100 (attention windows of one chunk's rows, so a clip over 1 s spans
    several). fp32, dropout 0, sdpa, the per-expert loop."""
    from transformers import Qwen3OmniMoeThinkerConfig

    text = {k: v for k, v in text.items() if k != "dtype"}
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "d_model": 32, "output_dim": 64, "n_window": 50,
             "n_window_infer": 100, "downsample_hidden_size": 8, "max_source_positions": 1500,
             "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
    a_id, start, _ = (tok.convert_tokens_to_ids(t) for t in QWEN3_OMNI_AUDIO_TOKENS)
    config = Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, audio_token_id=a_id,
        audio_start_token_id=start, image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"], user_token_id=tok.convert_tokens_to_ids("user"))
    config._experts_implementation = "eager"  # transformers' grouped_mm has no fp64
    return _finished(config, ids)


def _finished(config, ids: dict):
    """A tiny thinker config's common tail: the vision / pad / eos token ids from ``ids``, fp32
    everywhere, sdpa."""
    config.vision_start_token_id, config.vision_end_token_id = (ids["vision_start_token_id"],
                                                                ids["vision_end_token_id"])
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    for sub in (config, config.text_config, config.vision_config, config.audio_config):
        sub.dtype = "float32"
    config._attn_implementation = "sdpa"
    return config


def omni_processor(tok, images, *, max_audio_seconds=None, prompt_format=None):
    """`ray_dhp.data.VLProcessor` for `omni_config` (or `omni3_config` with its
    ``prompt_format``): ``tok`` (`omni_tokenizer`), ``images`` (the PIL image processor of the
    tiny ViT) and a Whisper feature extractor (128 mel bins, 16 kHz, hop 160, n_fft 400: the
    Omni thinkers') with a 30 s window."""
    from transformers import WhisperFeatureExtractor

    from ray_dhp.data.audio import AudioSettings
    from ray_dhp.data.processing import VLProcessor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                 chunk_length=30, n_fft=400, return_attention_mask=True)
    return VLProcessor(tok, images, feature_extractor=fe,
                       audio=AudioSettings(max_seconds=max_audio_seconds),
                       prompt_format=prompt_format)


def tone(label: str, seconds: float, rate: int = 16000, amplitude: float = 0.5) -> np.ndarray:
    """``[samples]`` float32: a steady tone or a linear chirp (`SOUNDS`), faded in and out."""
    f0, f1 = _FREQS[label]
    t = np.arange(int(round(seconds * rate))) / rate
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * max(seconds, 1e-9)))
    fade = np.minimum(1.0, np.minimum(t, seconds - t) / 0.01)
    return (amplitude * fade * np.sin(phase)).astype(np.float32)


def write_wav(path, samples: np.ndarray, rate: int = 16000) -> Path:
    """Write mono float samples in [-1, 1] as a 16-bit PCM wav (standard library ``wave``)."""
    path = Path(path)
    pcm = np.clip(np.round(np.asarray(samples) * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return path


def make_audio_dataset(path, num_samples: int = 8, seed: int = 0, *,
                       seconds=(0.6, 1.0, 1.3), rates=(16000, 22050)) -> Path:
    """Write a LLaVA-format set of generated clips; return its ``data.jsonl``.

    Sample ``i`` is one clip (`SOUNDS`: low / high tone, rising / falling chirp) of
    ``seconds[i % len]`` seconds at ``rates[i % len]`` Hz (clips off the feature extractor's
    16 kHz are resampled when read), asked "What do you hear?" and answered with its label.
    Same ``seed`` -> same files, byte for byte.
    """
    root = Path(path)
    (root / "audio").mkdir(parents=True, exist_ok=True)
    rng, lines = random.Random(seed), []
    for i in range(num_samples):
        label, rate = rng.choice(SOUNDS), rates[i % len(rates)]
        name = f"audio/{i:03d}.wav"
        write_wav(root / name, tone(label, seconds[i % len(seconds)], rate), rate)
        record = {"id": f"{i:05d}", "audio": name, "conversations": [
            {"from": "human", "value": f"<audio>\n{PROMPT}"}, {"from": "gpt", "value": label}]}
        lines.append(json.dumps(record))
    out = root / "data.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out

