"""The demo's captioning set: coloured shapes drawn with PIL, in LLaVA format, with optional
text-only and spoiled lines for tests (`make_dataset`)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["make_dataset", "BAD_KINDS"]

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
COUNT_WORDS = ("one", "two", "three")
PROMPT = "Describe the image."
BAD_KINDS = ("missing_image", "corrupt_image", "malformed_json", "image_count_mismatch", "no_assistant")


def _caption(count: int, colour: str, shape: str) -> str:
    return f"{COUNT_WORDS[count - 1]} {colour} {shape}{'s' if count > 1 else ''}"


def _draw(size: tuple[int, int], count: int, colour: str, shape: str, rng: random.Random):
    """Draw ``count`` shapes side by side, each in its own horizontal slot, on white."""
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    slot = width / count
    for i in range(count):
        side = max(6, int(min(slot, height) * rng.uniform(0.5, 0.8)))
        x0 = int(i * slot + rng.uniform(0, slot - side))
        y0 = int(rng.uniform(0, height - side))
        box = (x0, y0, x0 + side, y0 + side)
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)], fill=fill)
    return image


def _record(i: int, caption: str, image: str | None) -> dict:
    if image is None:
        human = f"Repeat: {caption}"
        return {"id": f"{i:05d}", "conversations": [
            {"from": "human", "value": human}, {"from": "gpt", "value": caption}]}
    return {"id": f"{i:05d}", "image": image, "conversations": [
        {"from": "human", "value": f"<image>\n{PROMPT}"}, {"from": "gpt", "value": caption}]}


def _apply_bad(record: dict, kind: str, root: Path) -> str | None:
    """Spoil ``record`` in place as ``kind``; return a replacement JSONL line if the line itself is bad."""
    if kind not in BAD_KINDS:
        raise ValueError(f"unknown bad-line kind {kind!r}; choose one of {BAD_KINDS}")
    if kind == "malformed_json":
        return json.dumps(record)[:-7]
    if kind == "no_assistant":
        record["conversations"] = record["conversations"][:1]
        return None
    if "image" not in record:
        raise ValueError(f"bad-line kind {kind!r} needs an image sample, got a text-only one")
    if kind == "missing_image":
        record["image"] = record["image"].replace(".png", "_missing.png")
    elif kind == "corrupt_image":
        (root / record["image"]).write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
    else:  # image_count_mismatch: two placeholders, one image
        record["conversations"][0]["value"] = f"<image>\n<image>\n{PROMPT}"
    return None


def make_dataset(
    path, num_samples: int = 64, seed: int = 0, *,
    image_sizes: Sequence[tuple[int, int]] = ((56, 56), (84, 56), (112, 84)),
    text_only_every: int = 0, bad_lines: Iterable[tuple[int, str]] = (),
) -> Path:
    """Write a small LLaVA-format captioning set of coloured shapes; return its ``data.jsonl``.

    Sample ``i`` shows 1-3 circles, squares or triangles of one colour (red, green, blue,
    yellow) on a plain background, captioned e.g. ``"two red circles"``; image sizes cycle
    through ``image_sizes`` (width, height). Same ``seed`` -> same files, byte for byte.

    Args:
        path: output folder (created); images go to ``path/images/``.
        num_samples: number of JSONL lines.
        seed: seed of the shape/colour/count/position choices.
        image_sizes: (width, height) pairs, cycled over the image samples.
        text_only_every: if ``k > 0``, every k-th sample (i % k == k - 1) is text-only
            ("Repeat: <caption>"), with no ``image`` key and no ``<image>``.
        bad_lines: ``(sample_index, kind)`` pairs spoiling samples for tests; kinds are
            :data:`BAD_KINDS`: ``missing_image`` (path to a file that does not exist),
            ``corrupt_image`` (file with garbage bytes), ``malformed_json`` (truncated line),
            ``image_count_mismatch`` (two ``<image>`` for one image), ``no_assistant`` (no gpt turn).
    """
    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    bad = dict(bad_lines)
    lines = []
    for i in range(num_samples):
        count, colour, shape = rng.randint(1, 3), rng.choice(list(COLOURS)), rng.choice(SHAPES)
        caption = _caption(count, colour, shape)
        image = None
        if not (text_only_every > 0 and i % text_only_every == text_only_every - 1):
            image = f"images/{i:03d}.png"
            size = tuple(image_sizes[i % len(image_sizes)])
            _draw(size, count, colour, shape, rng).save(root / image, format="PNG")
        record = _record(i, caption, image)
        line = _apply_bad(record, bad[i], root) if i in bad else None
        lines.append(line if line is not None else json.dumps(record))
    out = root / "data.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out

