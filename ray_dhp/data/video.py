"""Decoding one video (a file, or a list of frame images) the way the family's reference
preprocessing does (its numbers: `ray_dhp.models.prompt_format.VideoRules`, ``VideoSettings.rules``).

Frames are decoded with PyAV (``av`` on PyPI: FFmpeg ships inside its wheels, so no system
FFmpeg is needed, and it is what ``torchvision.io.read_video`` — the reference's fallback reader —
decodes with; torchcodec needs a matching torch build and decord has no maintained wheels).
Sampling and resizing follow the reference's ``fetch_video`` number for number (``r``: the rules):

* frame count: ``n = total_frames / video_fps * fps`` clamped to ``[min_frames, max_frames]``
  (each rounded to a multiple of ``r.frame_factor``, the temporal patch) and to
  ``total_frames``, then floored to that multiple; frames ``linspace(0, total - 1, n).round()``;
* frame size: resized to multiples of ``unit = patch * merge`` with the per-frame area in
  ``[min_pixels, max_pixels]``, where ``max_pixels`` is capped by
  ``max(min(r.max_tokens * unit**2, total_pixels / n * r.frame_factor), r.min_growth *
  min_pixels)``; bicubic, antialiased (torchvision's tensor resize:
  ``torch.nn.functional.interpolate``);
* a list of frame images: each resized as an image (to multiples of ``r.image_factor * unit``),
  padded to a multiple of ``r.frame_factor`` frames by repeating the last, taken at ``fps``
  frames per second.

A file is decoded twice: a first pass counts the decodable frames (the count the reference
samples from is the decoded one, not the container's claim), a second converts only the sampled
frames, so memory holds ``n`` frames, never the whole video.

`video_patches` then turns the frames into the model's ``pixel_values_videos`` rows and grid as
transformers' video processors do (rescale, normalise with the image processor's
mean/std, ``temporal_patch_size`` frames per patch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ray_dhp.models.prompt_format import DEFAULT_PROMPT_FORMAT, VideoRules

__all__ = ["VideoError", "VideoSettings", "DecodedVideo", "smart_nframes", "video_frame_size",
           "load_video", "video_patches", "video_sources", "encode_video"]



class VideoError(ValueError):
    """A video that cannot be used (missing, undecodable, no frames, too large): bad data."""


@dataclass(frozen=True)
class VideoSettings:
    """The reference preprocessing's video keys (None: its default for the model's patch unit).

    Attributes:
        fps: frames sampled per second of video (default 2).
        min_frames / max_frames: bounds of the sampled frame count (4 / 768).
        min_pixels / max_pixels: per-frame area bounds (``rules.min_tokens`` /
            ``rules.max_tokens`` merged patches).
        total_pixels: the whole video's area budget (``rules.seq_len * rules.budget`` merged
            patches).
        rules: the family's `VideoRules` (`PromptFormat.video`; `VLProcessor` sets its own).
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    total_pixels: Optional[int] = None
    rules: VideoRules = DEFAULT_PROMPT_FORMAT.video

    @classmethod
    def of(cls, video) -> "VideoSettings":
        """The settings of the run's ``data.video`` section (`ray_dhp.config.data_section.VideoConfig`)."""
        return cls(fps=video.fps, min_frames=video.min_frames, max_frames=video.max_frames,
                   min_pixels=video.min_pixels, max_pixels=video.max_pixels,
                   total_pixels=video.total_pixels)


@dataclass
class DecodedVideo:
    """Sampled, resized frames ``[T, 3, H, W]`` (float, integer values 0..255), the sampling
    rate ``sample_fps``, the source frame indices and the source frame rate."""

    frames: torch.Tensor
    sample_fps: float
    indices: list
    video_fps: float


def _round(x, f):
    return round(x / f) * f


def _ceil(x, f):
    return math.ceil(x / f) * f


def _floor(x, f):
    return math.floor(x / f) * f


def _smart_resize(height, width, factor, min_pixels, max_pixels, max_ratio) -> tuple[int, int]:
    """The reference's ``smart_resize`` (its image defaults are never used here)."""
    if max(height, width) / min(height, width) > max_ratio:
        raise VideoError(f"video frames of aspect ratio {max(height, width) / min(height, width):.0f} "
                         f"> {max_ratio}")
    h, w = max(factor, _round(height, factor)), max(factor, _round(width, factor))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = _floor(height / beta, factor), _floor(width / beta, factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = _ceil(height * beta, factor), _ceil(width * beta, factor)
    return h, w


def smart_nframes(total_frames: int, video_fps: float, s: VideoSettings) -> int:
    """Frames to sample from a video of ``total_frames`` at ``video_fps`` (see module doc)."""
    factor = s.rules.frame_factor
    lo = _ceil(s.min_frames, factor)
    hi = _floor(min(s.max_frames, total_frames), factor)
    n = min(min(max(total_frames / video_fps * s.fps, lo), hi), total_frames)
    n = _floor(n, factor)
    if not factor <= n <= total_frames:
        raise VideoError(f"too few frames: {total_frames} frame(s) give {n} sampled frames "
                         f"(at least {factor} needed)")
    return n


def video_frame_size(height: int, width: int, nframes: int, unit: int, s: VideoSettings) -> tuple[int, int]:
    """Resized ``(height, width)`` of every frame of an ``nframes``-frame video."""
    r = s.rules
    min_pixels = s.min_pixels if s.min_pixels is not None else r.min_tokens * unit * unit
    total = s.total_pixels if s.total_pixels is not None else r.seq_len * unit * unit * r.budget
    cap = max(min(r.max_tokens * unit * unit, total / nframes * r.frame_factor),
              int(min_pixels * r.min_growth))
    max_pixels = min(s.max_pixels, cap) if s.max_pixels is not None else cap
    return _smart_resize(height, width, unit, min_pixels, max_pixels, r.max_ratio)


def _resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's tensor resize (bicubic, antialias) of uint8 frames, kept integer-valued."""
    out = torch.nn.functional.interpolate(frames.float(), size=size, mode="bicubic",
                                          align_corners=False, antialias=True)
    return out.clamp(0, 255).round()


def _decode_file(path: Path, s: VideoSettings, max_pixels: Optional[int]):
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError(f"no video stream: {path} has no video track (audio only?)")
            stream = container.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            if max_pixels is not None and w * h > max_pixels:
                raise VideoError(f"video too large: {path} frames are {w}x{h} = {w * h} pixels > "
                                 f"max_image_pixels={max_pixels} (not decoded)")
            rate = stream.average_rate
            total = sum(1 for _ in container.decode(stream))  # as read_video: frames decoded
        if total == 0:
            raise VideoError(f"empty video: {path} has no decodable frames")
        if not rate:
            raise VideoError(f"corrupt video: {path} has no frame rate")
        fps = float(rate)
        n = smart_nframes(total, fps, s)
        idx = torch.linspace(0, total - 1, n).round().long().tolist()
        wanted, frames = set(idx), {}
        with av.open(str(path)) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    frames[i] = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                if i >= idx[-1]:
                    break
    except VideoError:
        raise
    except Exception as exc:  # av.error.InvalidDataError, OSError...
        raise VideoError(f"corrupt video: {path}: {type(exc).__name__}: {exc}") from exc
    if len(frames) != len(wanted):
        raise VideoError(f"corrupt video: {path} decoded differently on a second pass")
    return torch.stack([frames[i] for i in idx]), n / total * fps, idx, fps


def _decode_frames(paths: list, s: VideoSettings, unit: int, max_pixels: Optional[int]):
    from ray_dhp.data.images import ImageError, load_image

    r = s.rules
    side = r.image_factor * unit
    min_pixels = s.min_pixels if s.min_pixels is not None else r.image_min * side ** 2
    frame_max = s.max_pixels if s.max_pixels is not None else r.image_max * side ** 2
    frames = []
    for p in paths:
        try:
            img = load_image(p, max_pixels)
        except ImageError as exc:
            raise VideoError(str(exc).replace("image", "video frame", 1)) from exc
        img = img.convert("RGB") if img.mode != "RGBA" else _on_white(img)
        h, w = _smart_resize(img.height, img.width, side, min_pixels, frame_max, r.max_ratio)
        img = img.resize((w, h))
        frames.append(torch.from_numpy(__import__("numpy").asarray(img).copy()).permute(2, 0, 1))
    if not frames:
        raise VideoError("empty video: the frame list is empty")
    if len({tuple(f.shape) for f in frames}) > 1:
        raise VideoError("corrupt video: the frames of the list have different sizes")
    n = _ceil(len(frames), r.frame_factor)
    frames += [frames[-1]] * (n - len(frames))
    return torch.stack(frames), s.fps, list(range(n)), s.fps


def _on_white(img):
    from PIL import Image

    out = Image.new("RGB", img.size, (255, 255, 255))
    out.paste(img, mask=img.split()[3])
    return out


def load_video(source, s: VideoSettings, unit: int, max_pixels: Optional[int] = None) -> DecodedVideo:
    """Decode, sample and resize one video: a file path, or a list of frame image paths.

    Args:
        unit: ``patch_size * merge_size`` of the model (e.g. 28 or 32).
        max_pixels: refuse source frames over this many pixels before decoding them.

    Raises:
        VideoError: missing file, undecodable, no video stream, no frames, frames too large.
    """
    if isinstance(source, (list, tuple)):
        frames, sample_fps, idx, fps = _decode_frames([Path(p) for p in source], s, unit, max_pixels)
    else:
        path = Path(source)
        try:
            exists = path.is_file()
        except (OSError, ValueError) as exc:
            raise VideoError(f"unusable video path: {str(path)[:200]!r}: {exc}") from exc
        if not exists:
            raise VideoError(f"missing video: {path} does not exist")
        frames, sample_fps, idx, fps = _decode_file(path, s, max_pixels)
    h, w = video_frame_size(frames.shape[2], frames.shape[3], frames.shape[0], unit, s)
    return DecodedVideo(_resize(frames, (h, w)), sample_fps, idx, fps)


def video_patches(frames: torch.Tensor, image_processor) -> tuple[torch.Tensor, torch.LongTensor]:
    """``(pixel_values_videos [t*h*w, C*T*P*P] float32, grid [1, 3])`` of ``frames`` ``[T, C, H,
    W]`` (0..255) as transformers' video processors make them."""
    ip = image_processor
    patch, merge, tps = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    mean = torch.tensor(ip.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float32)[:, None, None]
    x = (frames.float() * ip.rescale_factor - mean) / std
    if pad := -x.shape[0] % tps:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    t, c, height, width = x.shape
    gt, gh, gw = t // tps, height // patch, width // patch
    x = x.view(gt, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, c * tps * patch * patch)
    return x.contiguous(), torch.tensor([[gt, gh, gw]], dtype=torch.long)


_FRAME_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _resolve(name: str, data_root: Path) -> Path:
    return Path(name) if Path(name).is_absolute() else Path(data_root) / name


def video_sources(data: dict, data_root: Path, n_placeholders: int) -> list:
    """The record's videos: each a file path or a list of frame image paths. ``"video"`` (or
    ``"videos"``) is a path, a list of them, or — for a record with one ``<video>`` — a list of
    image files (the frames of one video); a list entry may itself be a list of frames."""
    video = data.get("video", data.get("videos"))
    if video is None:
        return []
    if isinstance(video, str):
        return [_resolve(video, data_root)]
    ok = isinstance(video, list) and all(
        isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(f, str) for f in v))
        for v in video)
    if not ok:
        raise VideoError("malformed record: 'video' must be a path, a list of paths or a list of "
                        "frame image lists")
    if (n_placeholders == 1 and len(video) > 1 and all(isinstance(v, str) for v in video)
            and all(v.lower().endswith(_FRAME_EXTENSIONS) for v in video)):
        return [[_resolve(v, data_root) for v in video]]
    return [[_resolve(f, data_root) for f in v] if isinstance(v, list) else _resolve(v, data_root)
            for v in video]


def encode_video(source, image_processor, settings: VideoSettings, timed,
                 max_pixels: Optional[int] = None, *, pad: str) -> tuple:
    """One video of a record as the model sees it: ``(pixel_values_videos rows, grid [1, 3],
    seconds per temporal patch, the text replacing its video pad ``pad``)``. The pads are
    repeated once per merged patch; with ``timed`` (the `PromptFormat` of a processor that
    writes timestamps; None: none) each temporal patch is written as its ``timed_frame``, ``t``
    the mean time of its first and last frame."""
    ip = image_processor
    clip = load_video(source, settings, ip.patch_size * ip.merge_size, max_pixels)
    patches, grid = video_patches(clip.frames, ip)
    per_frame = int(grid[0, 1] * grid[0, 2]) // ip.merge_size**2
    tps = ip.temporal_patch_size
    if timed is None:
        pads = pad * (per_frame * int(grid[0, 0]))
    else:
        idx = list(clip.indices) + [clip.indices[-1]] * (-len(clip.indices) % tps)
        times = [(idx[i] + idx[i + tps - 1]) / 2 / clip.video_fps for i in range(0, len(idx), tps)]
        pads = timed.timed_frames(times, pad * per_frame)
    return patches, grid, tps / clip.sample_fps, pads
