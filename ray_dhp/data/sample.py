"""One training sample and what a LLaVA record is read into before processing: `Sample` (the
model inputs of one record), `BadSample` (a record that cannot become one, by `reason_kind`),
`image_grid` (an image's patch grid from its size only), and a record's turns and image paths.
The processor that makes samples: `ray_dhp.data.processing`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ray_dhp.data.images import upright_size

__all__ = ["BadSample", "reason_kind", "Sample", "image_grid", "IGNORE_INDEX"]

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

    @property
    def num_tokens(self) -> int:
        """Sequence length L."""
        return int(self.input_ids.numel())


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
