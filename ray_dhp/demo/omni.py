"""The demo's mixed set for a model with several encoders (Qwen2.5-Omni's thinker: audio, vision,
text): generated clips, images, a record with both, videos and text-only records in one file."""

from __future__ import annotations

import json
from pathlib import Path

from ray_dhp import demo
from ray_dhp.demo.audio import make_audio_dataset
from ray_dhp.demo.video import make_video_dataset

__all__ = ["make_omni_dataset"]


def make_omni_dataset(path, *, images: int = 6, clips: int = 4, videos: int = 0,
                      seed: int = 0, clip_seconds: tuple = (0.6, 1.0)) -> Path:
    """One LLaVA-format set mixing every input of a Qwen-Omni thinker; returns its
    ``mixed.jsonl``. Records in this order: ``images`` shape images (every third text-only,
    `ray_dhp.demo.make_dataset`), ``clips`` generated clips (`make_audio_dataset`, lasting
    ``clip_seconds`` in turn), one record with an image *and* a clip, then ``videos``
    moving-square videos
    (`ray_dhp.demo.video.make_video_dataset`). Paths are relative to ``path``."""
    root = Path(path)
    parts = [("img", demo.make_dataset(root / "img", num_samples=images, seed=seed,
                                       text_only_every=3, image_sizes=((56, 56), (84, 56)))),
             ("aud", make_audio_dataset(root / "aud", num_samples=clips, seed=seed,
                                        seconds=clip_seconds))]
    records = []
    for sub, listing in parts:
        for line in listing.read_text().splitlines():
            r = json.loads(line)
            r.update({k: f"{sub}/{r[k]}" for k in ("image", "audio") if k in r})
            records.append(r)
    both = json.loads(json.dumps(records[0]))  # an image record, given a clip too
    both["audio"] = f"aud/audio/{min(1, clips - 1):03d}.wav"
    both["conversations"][0]["value"] = "<image>\n<audio>\nDescribe the image and the sound."
    records.append(both)
    if videos:
        vid = make_video_dataset(root / "vid", num_samples=videos, n_frames=4, mix=False, seed=seed)
        for line in vid.read_text().splitlines():
            r = json.loads(line)
            r["video"] = f"vid/{r['video']}"
            records.append(r)
    out = root / "mixed.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out
