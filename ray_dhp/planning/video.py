"""Videos in the planner: a video's size as frames x height x width, its patch tokens and its
attention segments, and a search for the longest video that fits (`longest_frames`).

A video of ``F`` sampled frames (``data.video.fps``, default 2 per second) of ``H x W`` pixels is,
for a vision tower of patch ``p``, merge ``m`` and temporal patch ``T`` (2):

* ``ceil(F / T)`` temporal patches (the processor repeats the last frame to fill the last one),
  each ``(H / p) x (W / p)`` patches: ``tokens = ceil(F / T) · (H / p) · (W / p)`` patch tokens,
  ``/ m²`` LLM tokens;
* attention within each temporal patch only (the towers' ``cu_seqlens`` have one segment per
  frame): the full-attention blocks cost ``ceil(F / T)`` segments of ``(H / p)(W / p)``, not one
  span of all the video's patches — `VideoShape.frame_tokens` is the segment
  `ray_dhp.planning.cost_types.Workload.vision_segment` and the memory model take.

``H`` and ``W`` must be multiples of ``p · m`` (what the image processor's resize rule produces; 448 = 16 x 28).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["VideoShape", "parse_videos", "longest_frames"]

_FORM = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class VideoShape:
    """One video as the model sees it: ``frames`` sampled frames of ``height x width`` pixels."""

    frames: int
    height: int
    width: int

    @classmethod
    def parse(cls, text: str) -> "VideoShape":
        """``"FRAMESxHxW"``, e.g. ``"240x448x448"`` (two minutes at 2 fps, 448 px frames)."""
        m = _FORM.match(str(text))
        if not m or min(int(g) for g in m.groups()) < 1:
            raise ValueError(f"{text!r}: give a video as FRAMESxHEIGHTxWIDTH with positive integers, "
                             "e.g. 240x448x448 (240 sampled frames = 2 minutes at 2 fps)")
        return cls(*(int(g) for g in m.groups()))

    def grid(self, vision_config) -> tuple:
        """``(t, h, w)`` in patches (``video_grid_thw``) for the tower ``vision_config``."""
        p, m = vision_config.patch_size, vision_config.spatial_merge_size
        tps = getattr(vision_config, "temporal_patch_size", 2)
        for side, name in ((self.height, "height"), (self.width, "width")):
            if side % (p * m):
                raise ValueError(f"video {self.describe()}: frame {name} {side} is not a multiple of "
                                 f"patch_size x spatial_merge_size = {p * m} (the frame sizes the image "
                                 f"processor's resize rule makes); use e.g. {max(1, round(side / (p * m))) * p * m}")
        return -(-self.frames // tps), self.height // p, self.width // p

    def tokens(self, vision_config) -> int:
        """Patch tokens of the whole video (what ``--vision-tokens`` counts)."""
        t, h, w = self.grid(vision_config)
        return t * h * w

    def frame_tokens(self, vision_config) -> int:
        """Patch tokens of one temporal patch: the attention segment."""
        _, h, w = self.grid(vision_config)
        return h * w

    def describe(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"


def parse_videos(text: str) -> list:
    """``--video``: a comma list of `VideoShape` forms (``"120x448x448,240x448x448"``)."""
    items = [x for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{text!r}: give at least one video, e.g. 240x448x448")
    return [VideoShape.parse(x) for x in items]


def longest_frames(fits, step: int = 2, limit: int = 1 << 16) -> int:
    """The largest multiple of ``step`` frames (up to ``limit``) for which ``fits`` is truthy
    (0 if none); ``fits`` must be monotone (a longer video never fits where a shorter fails)."""
    if not fits(step):
        return 0
    lo, hi = 1, 2  # in units of step: lo fits
    while hi * step <= limit and fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step
