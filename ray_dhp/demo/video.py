"""Small generated videos: an mp4 writer (PyAV) and the demo's moving-square video set.

`write_mp4` encodes ``[T, H, W, 3]`` uint8 frames as H.264 (yuv420p, so even sides) at a given
frame rate; `moving_square` draws a square crossing the frame left, right, up or down.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

__all__ = ["write_mp4", "moving_square", "DIRECTIONS"]

DIRECTIONS = ("left", "right", "up", "down")


def write_mp4(path, frames: np.ndarray, fps: float) -> Path:
    """Encode ``frames`` (``[T, H, W, 3]`` uint8, even H and W) into an mp4 at ``fps``."""
    import av

    path = Path(path)
    frames = np.asarray(frames, dtype=np.uint8)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "ultrafast"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def moving_square(direction: str, n_frames: int, size=(64, 64), side: int = 16,
                  colour=(220, 40, 40)) -> np.ndarray:
    """``[n_frames, H, W, 3]`` frames of a square moving ``direction`` across a light frame."""
    h, w = size
    frames = np.full((n_frames, h, w, 3), 245, dtype=np.uint8)
    for t in range(n_frames):
        a = t / max(1, n_frames - 1)
        x, y = (w - side) // 2, (h - side) // 2
        if direction in ("left", "right"):
            x = int(round((1 - a if direction == "left" else a) * (w - side)))
        else:
            y = int(round((1 - a if direction == "up" else a) * (h - side)))
        frames[t, y:y + side, x:x + side] = colour
    return frames


def make_video_dataset(out_dir, num_samples: int = 8, *, seed: int = 0, n_frames: int = 8,
                       fps: float = 4.0, size=(56, 56), mix: bool = True) -> Path:
    """A LLaVA ``train.jsonl`` of moving-square clips ("Which way does the square move?" ->
    the direction); with ``mix``, every third record also holds an image (a still of the clip,
    ``<image>`` before ``<video>``), every fourth is text-only. Returns the annotation path."""
    import json
    import random

    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = []
    for i in range(num_samples):
        direction = DIRECTIONS[rng.randrange(len(DIRECTIONS))]
        if mix and i % 4 == 3:
            records.append({"conversations": [
                {"from": "human", "value": "Which way can a square move?"},
                {"from": "gpt", "value": "left, right, up or down"}]})
            continue
        frames = moving_square(direction, n_frames + 2 * (i % 3), size)
        name = f"clip_{i:04d}.mp4"
        write_mp4(out / name, frames, fps)
        record = {"video": name, "conversations": [
            {"from": "human", "value": "<video>\nWhich way does the square move?"},
            {"from": "gpt", "value": direction}]}
        if mix and i % 3 == 1:
            still = f"still_{i:04d}.png"
            Image.fromarray(frames[len(frames) // 2]).save(out / still)
            record["image"] = still
            record["conversations"][0]["value"] = "<image>\nA still, then the clip: <video>\nWhich way does the square move?"
        records.append(record)
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
