"""What the skip policy has skipped, and the summary a run fails with when too much is bad.

A `BadDataLedger` counts bad samples by kind (the text of their reason before the first colon,
see `ray_dhp.data.sample.reason_kind`), keeps the first few examples with their
``file:line``, and turns them into one message: counts per reason, examples, and the most
likely fix for the commonest reason (a wrong ``data_root`` shows as missing images).
"""

from __future__ import annotations

from collections import Counter

from ray_dhp.data.sample import reason_kind

__all__ = ["BadDataLedger", "MIN_JUDGED"]

#: the bad-data budget is judged once this many records (or the whole dataset) have been drawn
MIN_JUDGED = 200
_EXAMPLES = 5

_FIXES = {
    "missing image": "image paths are resolved against {root}: check data_root (or the image "
                     "paths of the annotation file)",
    "unusable image path": "fix the image paths of the annotation file",
    "corrupt image": "re-encode or drop the damaged image files",
    "image too large": "downscale the images, or raise max_image_pixels",
    "image processor refused the image(s)": "drop or crop images the processor cannot resize "
                                            "(e.g. an aspect ratio over 200:1)",
    "too long": "raise max_tokens / max_text_chars, or split these conversations",
    "malformed JSON": "fix the annotation file at the lines above (one JSON object per line "
                      "in .jsonl, one array in .json)",
    "not UTF-8": "re-encode the annotation file as UTF-8",
    "not an object": "every record must be a JSON object in the LLaVA format",
    "malformed record": "records need 'conversations': [{'from': ..., 'value': ...}, ...] "
                        "(LLaVA format)",
    "tokenizer refused the text": "clean the text (e.g. lone surrogate escapes like \\ud800)",
    "image count mismatch": "each <image> placeholder needs exactly one entry in 'image'",
    "missing video": "video paths are resolved against {root}: check data_root (or the video "
                     "paths of the annotation file)",
    "missing video frame": "frame paths are resolved against {root}: check data_root",
    "corrupt video": "re-encode or drop the damaged video files",
    "empty video": "drop the videos without frames",
    "too few frames": "videos need at least 2 decodable frames; drop the shorter ones",
    "no video stream": "drop the audio-only files from the 'video' entries",
    "video too large": "downscale the videos, or raise max_image_pixels (it bounds a frame too)",
    "video count mismatch": "each <video> placeholder needs exactly one entry in 'video'",
    "missing audio": "audio paths are resolved against {root}: check data_root (or the audio "
                     "paths of the annotation file)",
    "corrupt audio": "re-encode or drop the damaged audio files",
    "audio too long": "cut the clips, or raise the audio length limit (at most the feature "
                      "extractor's window)",
    "audio count mismatch": "each <audio> placeholder needs exactly one entry in 'audio'",
    "no trainable tokens": "every conversation needs an assistant ('gpt') turn",
}


class BadDataLedger:
    """Counts per kind and the first examples of the bad samples this process has seen."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.examples: list = []  # (where, reason)
        self.roots: dict = {}     # kind -> data root of its first example

    def add(self, where: str, reason: str, root=None) -> None:
        kind = reason_kind(reason)
        self.counts[kind] += 1
        self.roots.setdefault(kind, root)
        if len(self.examples) < _EXAMPLES:
            self.examples.append((where, reason))

    def summary(self, bad: int, drawn: int, max_bad_fraction: float) -> str:
        """One message: totals, counts per reason, the first examples and the likely fix."""
        frac = bad / drawn if drawn else 1.0
        head = (f"{bad} of the {drawn} records drawn so far are bad ({frac:.0%}; "
                f"max_bad_fraction={max_bad_fraction:g})")
        if not self.counts:
            return head + "."
        by = ", ".join(f"{k}: {n}" for k, n in self.counts.most_common())
        seen = sum(self.counts.values())
        note = f" (the {seen} found by this process)" if seen != bad else ""
        first = "; ".join(f"{w}: {r[:300]}" for w, r in self.examples)
        msg = f"{head}. By reason{note}: {by}. First: {first}."
        top = self.counts.most_common(1)[0][0]
        fix = _FIXES.get(top)
        if fix:
            msg += " Likely fix: " + fix.format(root=self.roots.get(top)) + "."
        return msg
