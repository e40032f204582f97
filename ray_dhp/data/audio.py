"""Audio items of LLaVA-style records: reading, decoding and log-mel features.

A record names its clips under ``"audio"`` (a path, or a list of paths, relative to the data
root) and its user turns hold one ``<audio>`` placeholder per clip, in order::

    {"audio": "clips/0001.wav",
     "conversations": [{"from": "human", "value": "<audio>\\nWhat do you hear?"},
                       {"from": "gpt", "value": "a rising chirp"}]}

* Decoding: PyAV (FFmpeg inside its wheel: wav, flac, mp3, ogg, m4a, ...), the first audio
  stream, down-mixed to mono and resampled by FFmpeg's ``swresample`` to the feature extractor's
  ``sampling_rate``, as float32 in [-1, 1].
* Features: the processor's own feature extractor (a log-mel one: ``n_fft``, ``hop_length``,
  ``feature_size`` mel bins; numpy only, no librosa), called as the model's processor calls it
  (``padding="max_length"``, attention mask on). The clip is padded with zeros to a hop multiple
  at least ``n_fft`` samples past its end instead of to the extractor's 30 s / 300 s window: the
  frames under the mask see the same samples and the same clamp (``max - 8`` of the whole
  spectrogram, which padding frames never raise), so they are the stock values bit for bit
  (``tests/unit/test_audio.py``) at a fraction of the work.
* One clip becomes ``frames = ceil(samples / hop_length)`` feature columns and one audio pad
  (`PromptFormat.pads`) per row the audio encoder makes of them (the family's
  `PromptFormat.clip_rows`), inside the format's audio item.

Bad clips are bad samples (``AudioError`` -> `ray_dhp.data.sample.BadSample`, counted and
skipped like bad images): a missing or unreadable file, no audio stream, an empty clip, a clip
longer than ``AudioSettings.max_seconds`` (default: the extractor's window, which the stock
processor would silently truncate to), or an ``<audio>`` count that differs from the clips'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch


__all__ = ["AUDIO_PLACEHOLDER", "RECORD_KEY", "AudioError", "AudioSettings", "audio_paths",
           "decode_audio", "audio_features", "encode_audio", "find_audio_record",
           "record_audio", "refusal", "refuse_audio"]

AUDIO_PLACEHOLDER = "<audio>"
RECORD_KEY = "audio"  # the record's field naming its clips (what the audio encoder consumes)


class AudioError(Exception):
    """A clip that cannot be used; the message reads ``"<kind>: <details>"``."""


@dataclass(frozen=True)
class AudioSettings:
    """How clips are read.

    Attributes:
        max_seconds: refuse longer clips (a bad sample) instead of truncating them; None: the
            feature extractor's window (``n_samples / sampling_rate``: 30 s for Whisper's
            default, 300 s for the released extractor of an audio-LM family in `ray_dhp.models`).
    """

    max_seconds: Optional[float] = None

    def limit(self, feature_extractor) -> float:
        window = feature_extractor.n_samples / feature_extractor.sampling_rate
        return window if self.max_seconds is None else min(float(self.max_seconds), window)


def audio_paths(data: dict, data_root) -> list[Path]:
    """The record's clips (``"audio"``: a path or a list of paths), resolved against ``data_root``."""
    audio = data.get(RECORD_KEY)
    if audio is None:
        return []
    names = [audio] if isinstance(audio, str) else audio
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise AudioError("malformed record: 'audio' must be a path or a list of paths")
    return [Path(n) if Path(n).is_absolute() else Path(data_root) / n for n in names]


def decode_audio(path, sampling_rate: int) -> np.ndarray:
    """``[samples]`` float32 mono at ``sampling_rate``: the file's first audio stream, down-mixed
    and resampled by FFmpeg (PyAV)."""
    import av

    path = Path(path)
    if not path.is_file():
        raise AudioError(f"missing audio: {path} does not exist")
    chunks = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioError(f"no audio stream: {path} holds no audio")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            for frame in container.decode(stream):
                chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except AudioError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise AudioError(f"corrupt audio: {path}: {type(exc).__name__}: {str(exc)[:200]}") from exc
    wave = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if wave.size == 0:
        raise AudioError(f"empty audio: {path} decodes to no samples")
    return wave


def audio_features(wave: np.ndarray, feature_extractor) -> torch.Tensor:
    """``[n_mels, frames]`` float32 log-mel features of one clip, the columns the stock
    processor's mask keeps (see the module docstring for the shortened padding)."""
    fe = feature_extractor
    hop, n_fft = fe.hop_length, fe.n_fft
    padded = min(fe.n_samples, -(-(wave.size + n_fft) // hop) * hop)
    out = fe([wave], sampling_rate=fe.sampling_rate, padding="max_length", max_length=padded,
             truncation=True, return_attention_mask=True, return_tensors="pt")
    frames = int(out["attention_mask"][0].sum())
    return out["input_features"][0, :, :frames].to(torch.float32).contiguous()


def encode_audio(path, feature_extractor, settings: AudioSettings) -> torch.Tensor:
    """Decode one clip, check its length, return its ``[n_mels, frames]`` features."""
    wave = decode_audio(path, feature_extractor.sampling_rate)
    seconds, limit = wave.size / feature_extractor.sampling_rate, settings.limit(feature_extractor)
    if seconds > limit:
        raise AudioError(f"audio too long: {path} lasts {seconds:.2f} s > {limit:g} s "
                         "(max_audio_seconds, at most the feature extractor's window)")
    return audio_features(wave, feature_extractor)


def find_audio_record(path, chunk: int = 64 << 20) -> Optional[int]:
    """The line (1-based) of the first record of a JSON-lines / JSON file with an ``"audio"``
    key, or None. A byte scan (``"audio"`` then a colon) confirmed by parsing that line, so an
    annotation file is checked at disk speed in the driver, before any worker starts."""
    import json
    import re

    key = re.compile(rb'(?<!\\)"' + RECORD_KEY.encode() + rb'"\s*:')
    path = Path(path)
    with open(path, "rb") as f:
        line, tail = 1, b""
        while True:
            block = f.read(chunk)
            if not block:
                return None
            data = tail + block
            for m in key.finditer(data):
                start = data.rfind(b"\n", 0, m.start()) + 1
                end = data.find(b"\n", m.end())
                text = data[start:] if end < 0 else data[start:end]
                try:
                    obj = json.loads(text.strip().rstrip(b","))
                except ValueError:
                    obj = None  # a JSON array spread over lines: the key is the record's
                if obj is None or (isinstance(obj, dict) and RECORD_KEY in obj):
                    return line + data.count(b"\n", 0, start)
            cut = data.rfind(b"\n") + 1
            line += data.count(b"\n", 0, cut)
            tail = data[cut:]


def record_audio(data: dict, data_root, n_placeholders: int, feature_extractor,
                 settings: AudioSettings, pad: str, clip_rows):
    """A record's clips, checked against its ``<audio>`` count: ``(features [n_mels, frames
    summed over the clips], frames per clip [n_clips], one pad string per clip: ``pad`` once per
    row the audio encoder makes of it, ``clip_rows(frames)``)``, or ``(None, None, [])`` for a
    record without audio."""
    paths = audio_paths(data, data_root)
    if n_placeholders != len(paths):
        raise AudioError(f"audio count mismatch: {n_placeholders} <audio> placeholder(s) but "
                         f"{len(paths)} audio clip(s)")
    if not paths:
        return None, None, []
    if feature_extractor is None:
        raise AudioError("no feature extractor: the record has audio but the processor has no "
                         "audio feature extractor (the processor of a model with an audio "
                         "encoder has one)")
    feats = [encode_audio(p, feature_extractor, settings) for p in paths]
    lengths = torch.tensor([f.shape[1] for f in feats], dtype=torch.long)
    pads = [pad * int(clip_rows(n)) for n in lengths.tolist()]
    return torch.cat(feats, dim=1), lengths, pads


def refusal(where: str, family: Optional[str] = None, has_encoder: bool = True) -> str:
    """Why a record with audio cannot train with the ``family`` model (None: any model): it has
    no audio encoder (``has_encoder=False``) or the layout gives the encoder no group."""
    if has_encoder:
        return (f"{where}: the record has an 'audio' key, but the layout gives the audio encoder "
                "no group: add an 'audio:' section (DHPConfig(audio=ModuleParallel(data_parallel="
                "...))), or drop the 'audio' key and the <audio> placeholders of such records "
                "(or filter them out) to train on the others")
    return (f"{where}: the record has an 'audio' key, but the {family} family has no audio "
            "encoder; drop the 'audio' key and the <audio> placeholders of such records (or "
            "filter them out) to train on the others")


def refuse_audio(paths, family: str, has_encoder: bool) -> None:
    """Driver-side check, before any worker starts: ValueError naming the first record (file and
    line) of the annotation files or folders ``paths`` that has an ``"audio"`` key."""
    from ray_dhp.data.reading import _expand

    for path in _expand(list(paths)):
        line = find_audio_record(path)
        if line is not None:
            raise ValueError(refusal(f"{path}:{line}", family, has_encoder))
