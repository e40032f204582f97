"""One training sample and what a LLaVA record is read into before processing: `Sample` (the
model inputs of one record), `BadSample` (a record that cannot become one, by `reason_kind`),
`image_grid` (an image's patch grid from its size only), and a record's turns and image paths.
The processor that makes samples: `ray_dhp.data.processing`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ray_dhp.data.images import upright_size

__all__ = ["BadSample", "reason_kind", "Sample", "image_grid", "item_fields", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system"}


class BadSample(Exception):
    """A record that cannot become a training sample; ``reason`` says why, ``where`` locates it.

    Reasons read ``"<kind>: <details>"`` (e.g. ``"missing image: /data/x.png does not exist"``);
    `kind` is the part before the colon, the key bad samples are counted by.
    """

    def __init__(self, reason: str, where: str | None = None):
        self.reason, self.where = reason, where
        super().__init__(f"{where}: {reason}" if where else reason)

    def __reduce__(self):  # pickled by decoding processes: keep reason and location apart
        return BadSample, (self.reason, self.where)

    @property
    def kind(self) -> str:
        return reason_kind(self.reason)


def reason_kind(reason: str) -> str:
    """The category of a bad-sample reason: its text before the first colon."""
    head = str(reason).split(":", 1)[0].strip()
    return head if 0 < len(head) <= 40 else "other"


@dataclass
class Sample:
    """Model inputs of one record (unbatched).

    Attributes:
        index: position of the record in the dataset.
        input_ids: ``[L]`` token ids.
        labels: ``[L]``, -100 except assistant-turn tokens (not shifted).
        mm_token_type_ids: ``[L]``, 1 at image pads, 0 elsewhere.
        pixel_values: ``[num_patches, C*T*P*P]`` float32, the visual items (images and videos)
            concatenated in placeholder order, or None.
        image_grid_thw: ``[num_items, 3]`` grids of those items, or None.
        modalities: ``[num_items]`` 1 (image) or 2 (video) per item; None: all images.
        second_per_grid_ts: ``[num_videos]`` seconds per temporal patch of each video
            (``temporal_patch_size / sample_fps``, for an absolute-time M-RoPE), or None.
        audio_features: ``[n_mels, frames]`` float32 log-mel features of the record's audio
            clips concatenated along time, in placeholder order (`ray_dhp.data.audio`), or None.
        audio_lengths: ``[num_clips]`` frames of each clip, or None.
        image_sizes: ``[num_items, 2]`` each item's original ``(height, width)``, where the
            processor gives them and the rows depend on them (anyres tiling: the item's grid is
            ``(tiles, S/P, S/P)``), or None.
        item_rows: ``[num_items]`` feature rows (placeholder tokens) of each item where they
            are not its grid's ``t*h*w / merge**2``: the processor's own count (anyres), or None.
    """

    index: int
    input_ids: torch.LongTensor
    labels: torch.LongTensor
    mm_token_type_ids: torch.LongTensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.LongTensor | None = None
    modalities: torch.LongTensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    audio_features: torch.Tensor | None = None
    audio_lengths: torch.LongTensor | None = None
    image_sizes: torch.LongTensor | None = None
    item_rows: torch.LongTensor | None = None

    @property
    def num_tokens(self) -> int:
        """Sequence length L."""
        return int(self.input_ids.numel())


def item_fields(visual: tuple, per_image: dict, merge: int) -> dict:
    """`Sample`'s ``image_sizes`` / ``item_rows`` of a record's items in placeholder order
    (``visual``: `VLProcessor._in_placeholder_order`'s) from ``per_image`` (the images' own, in
    their order; ``{}``: none, the grids count the rows): a video's rows its grid's, its size
    its frames'."""
    if not per_image or visual[1] is None:
        return {}
    sizes, rows = iter(per_image["image_sizes"].tolist()), iter(per_image["item_rows"].tolist())
    out_sizes, out_rows = [], []
    for kind, g in zip(visual[2].tolist(), visual[1].tolist()):
        image = kind == 1
        out_sizes.append(next(sizes) if image else [0, 0])
        out_rows.append(next(rows) if image else g[0] * g[1] * g[2] // merge ** 2)
    return {"image_sizes": torch.tensor(out_sizes, dtype=torch.long),
            "item_rows": torch.tensor(out_rows, dtype=torch.long)}


def image_grid(path_or_pil, image_processor, prompt_format=None) -> tuple[int, int, int]:
    """Cheap ``(t, h, w)`` patch grid of one image, from its size only (no pixel decoding; a
    path's EXIF orientation is applied as `ray_dhp.data.images.load_image` does).

    Uses the image processor's resize rule (patch and merge sizes, min/max pixels), as the
    family's `PromptFormat.resize` (None: the default format's) says.
    """
    from PIL import Image

    from ray_dhp.models.prompt_format import DEFAULT_PROMPT_FORMAT

    fmt = prompt_format if prompt_format is not None else DEFAULT_PROMPT_FORMAT

    if isinstance(path_or_pil, (str, Path)):
        with Image.open(path_or_pil) as img:
            width, height = upright_size(img)
    else:
        width, height = path_or_pil.size
    patch, merge = image_processor.patch_size, image_processor.merge_size
    size = image_processor.size
    h, w = fmt.resize(height, width, factor=patch * merge,
                      min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    return 1, h // patch, w // patch


def _messages(data: dict) -> list[tuple[str, str]]:
    """``conversations`` -> ``[(role, text)]`` with roles system/user/assistant; validates shape."""
    convs = data.get("conversations")
    if not isinstance(convs, list) or not convs:
        raise BadSample("malformed record: 'conversations' must be a non-empty list")
    out = []
    for turn in convs:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise BadSample("malformed record: each turn needs 'from' and a string 'value'")
        role = _ROLES.get(turn.get("from"))
        if role is None:
            raise BadSample(f"malformed record: unknown speaker {turn.get('from')!r} "
                            f"(expected one of {sorted(_ROLES)})")
        out.append((role, turn["value"]))
    return out


def _image_paths(data: dict, data_root: Path) -> list[Path]:
    image = data.get("image", data.get("images"))
    if image is None:
        return []
    names = [image] if isinstance(image, str) else image
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadSample("malformed record: 'image' must be a path or a list of paths")
    return [Path(n) if Path(n).is_absolute() else Path(data_root) / n for n in names]
