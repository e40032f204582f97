"""Video decoding and frame sampling against Qwen's own ``qwen-vl-utils`` (issue #27).

qwen-vl-utils imports torchvision at module level, and no torchvision wheel admits the test
suite's torch (installing one would replace torch), so the test gives it a stand-in
``torchvision`` with the two functions its torchvision path calls: ``io.read_video`` (a plain
PyAV decode of every frame, which is what torchvision's reader does) and
``transforms.functional.resize`` (torchvision's tensor resize: float bicubic antialiased
``interpolate``, clamped and rounded back to uint8). Everything else — the frame count
(``smart_nframes``), the frame indices, the per-frame pixel budget from ``total_pixels`` and
``smart_resize`` — is qwen-vl-utils' own code, compared with ``ray_dhp.data.video``.
"""

import os
import sys
import types

import numpy as np
import pytest
import torch

from ray_dhp.data.video import VideoError, VideoSettings, load_video, video_patches
from ray_dhp.demo.video import moving_square, write_mp4
from tests.hostile_data import write_audio_only




def _read_video(path, start_pts=0.0, end_pts=None, pts_unit="sec", output_format="TCHW"):
    import av

    with av.open(path) as c:
        s = c.streams.video[0]
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in c.decode(s)]
        fps = float(s.average_rate)
    return torch.stack(frames), None, {"video_fps": fps}


def _resize(video, size, interpolation=None, antialias=True):
    out = torch.nn.functional.interpolate(video.float(), size=size, mode="bicubic",
                                          align_corners=False, antialias=antialias)
    return out.clamp(0, 255).round().to(torch.uint8)


@pytest.fixture(scope="module")
def qwen_vl_utils():
    stub = types.ModuleType("torchvision")
    stub.__version__ = "0.29.0"
    stub.io = types.ModuleType("torchvision.io")
    stub.io.read_video = _read_video
    stub.transforms = types.ModuleType("torchvision.transforms")
    stub.transforms.functional = types.SimpleNamespace(resize=_resize)
    stub.transforms.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic")
    names = ("torchvision", "torchvision.io", "torchvision.transforms")
    saved = {k: sys.modules.get(k) for k in names}
    sys.modules.update(dict(zip(names, (stub, stub.io, stub.transforms))))
    os.environ["FORCE_QWENVL_VIDEO_READER"] = "torchvision"
    try:  # the stand-in is visible only while qwen-vl-utils is imported (it binds the names)
        for k in ("qwen_vl_utils.vision_process", "qwen_vl_utils"):
            sys.modules.pop(k, None)
        vp = pytest.importorskip("qwen_vl_utils.vision_process", reason="pip install qwen-vl-utils")
    finally:
        os.environ.pop("FORCE_QWENVL_VIDEO_READER", None)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    vp.get_video_reader_backend.cache_clear()
    os.environ["FORCE_QWENVL_VIDEO_READER"] = "torchvision"
    vp.FORCE_QWENVL_VIDEO_READER = "torchvision"
    os.environ.pop("FORCE_QWENVL_VIDEO_READER", None)
    yield vp
    for k in ("qwen_vl_utils.vision_process", "qwen_vl_utils"):
        sys.modules.pop(k, None)


# (seconds, source fps, (height, width), settings, patch size): durations 0.4-12 s, source
# rates 5-30 fps, small/large/odd-aspect frames, fps/min/max-frame and pixel-budget keys, the
# Qwen2/2.5-VL (14 px) and Qwen3-VL (16 px) patch units.
CASES = [
    (1.0, 10, (64, 64), {}, 14),
    (3.0, 24, (48, 96), {}, 14),
    (0.4, 10, (64, 64), {}, 14),                       # 4 frames: min_frames = all of them
    (12.0, 5, (64, 48), {}, 14),
    (5.0, 30, (120, 160), {}, 16),
    (2.0, 15, (32, 256), {}, 14),                       # wide
    (4.0, 10, (64, 64), {"fps": 1.0}, 14),
    (6.0, 10, (64, 64), {"max_frames": 6}, 16),
    (1.5, 20, (96, 96), {"min_frames": 8}, 14),
    (3.0, 10, (200, 300), {"total_pixels": 8 * 28 * 28 * 20}, 14),   # the whole-video budget binds
    (2.0, 12, (400, 400), {"max_pixels": 256 * 28 * 28}, 14),
    (2.5, 8, (64, 80), {"min_pixels": 64 * 32 * 32, "fps": 3.0}, 16),
]


def _ele(path, s: VideoSettings):
    ele = {"video": str(path), "fps": s.fps, "min_frames": s.min_frames, "max_frames": s.max_frames}
    for k in ("min_pixels", "max_pixels", "total_pixels"):
        if getattr(s, k) is not None:
            ele[k] = getattr(s, k)
    return ele


@pytest.mark.parametrize("seconds,fps,size,keys,patch", CASES,
                         ids=[f"{c[0]}s-{c[1]}fps-{c[2][0]}x{c[2][1]}-{'-'.join(c[3]) or 'default'}-p{c[4]}"
                              for c in CASES])
def test_sampling_matches_qwen_vl_utils(qwen_vl_utils, tmp_path, seconds, fps, size, keys, patch):
    from ray_dhp.demo import tiny_processor

    path = write_mp4(tmp_path / "v.mp4", moving_square("right", round(seconds * fps), size), fps)
    s = VideoSettings(**keys)
    theirs, sample_fps = qwen_vl_utils.fetch_video(_ele(path, s), image_patch_size=patch,
                                                   return_video_sample_fps=True)
    ours = load_video(path, s, unit=patch * 2)
    assert ours.frames.shape == theirs.shape, (ours.frames.shape, theirs.shape)
    assert ours.frames.shape[2] % (patch * 2) == 0 and ours.frames.shape[3] % (patch * 2) == 0
    assert ours.sample_fps == pytest.approx(sample_fps, rel=1e-12)
    assert torch.equal(ours.frames, theirs)  # same frames picked, same resize
    ip = tiny_processor("qwen3_vl" if patch == 16 else "qwen2_5_vl").image_processor
    pv, grid = video_patches(ours.frames, ip)
    t, h, w = ours.frames.shape[0] // 2, ours.frames.shape[2] // patch, ours.frames.shape[3] // patch
    assert grid.tolist() == [[t, h, w]] and pv.shape == (t * h * w, 3 * 2 * patch * patch)


def test_frame_list_matches_qwen_vl_utils(qwen_vl_utils, tmp_path):
    from PIL import Image

    frames = moving_square("down", 5, (70, 90))
    paths = []
    for i, f in enumerate(frames):
        paths.append(tmp_path / f"f{i}.png")
        Image.fromarray(f).save(paths[-1])
    s = VideoSettings(fps=2.0, min_pixels=64 * 28 * 28, max_pixels=200 * 28 * 28)
    ele = {"video": [str(p) for p in paths], "min_pixels": s.min_pixels, "max_pixels": s.max_pixels,
           "sample_fps": 2.0}
    theirs, sample_fps = qwen_vl_utils.fetch_video(ele, image_patch_size=14, return_video_sample_fps=True)
    ours = load_video(paths, s, unit=28)
    assert ours.frames.shape == theirs.shape and ours.frames.shape[0] == 6  # padded to even
    assert torch.equal(ours.frames, theirs.float()) and ours.sample_fps == sample_fps


def test_video_patches_equal_image_processor_for_a_still():
    """An image is a 2-frame still video: its patches from `video_patches` equal the image
    processor's (the layout of ``pixel_values_videos`` is that of ``pixel_values``)."""
    from PIL import Image

    from ray_dhp.demo import tiny_processor

    ip = tiny_processor().image_processor
    img = Image.fromarray(moving_square("up", 3, (56, 84))[1])
    out = ip(images=[img], return_tensors="pt", do_resize=False)
    frame = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
    pv, grid = video_patches(torch.stack([frame, frame]), ip)
    assert torch.equal(grid, out["image_grid_thw"])
    torch.testing.assert_close(pv, out["pixel_values"].float(), rtol=0, atol=1e-6)


def test_bad_videos(tmp_path):
    s = VideoSettings()
    with pytest.raises(VideoError, match="missing video"):
        load_video(tmp_path / "nope.mp4", s, 28)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00not a video" * 50)
    with pytest.raises(VideoError, match="corrupt video"):
        load_video(junk, s, 28)
    one = write_mp4(tmp_path / "one.mp4", moving_square("left", 1), 10)
    with pytest.raises(VideoError, match="too few frames"):
        load_video(one, s, 28)
    big = write_mp4(tmp_path / "big.mp4", moving_square("left", 4, (64, 64)), 10)
    with pytest.raises(VideoError, match="video too large"):
        load_video(big, s, 28, max_pixels=64 * 63)
    audio = tmp_path / "audio.m4a"
    write_audio_only(audio)
    with pytest.raises(VideoError, match="no video stream"):
        load_video(audio, s, 28)


def _clip(tmp_path, name, n, fps=4, size=(56, 56)):
    return write_mp4(tmp_path / name, moving_square("left", n, size), fps).name


SMALL = {"qwen2_5_vl": 28, "qwen2_vl": 28, "qwen3_vl": 32}


def _processor(family):
    from ray_dhp.demo import tiny_processor

    unit = SMALL[family]
    return tiny_processor(family).configured(
        video=VideoSettings(min_pixels=(2 * unit) ** 2, max_pixels=(2 * unit) ** 2))


def test_record_mixing_videos_and_images_keeps_placeholder_order(tmp_path):
    """``<video> <image> <video>`` (a file and a frame list): items, grids, pixels and pads in
    placeholder order; the collated batch splits them into the model's image and video inputs."""
    from PIL import Image

    from ray_dhp.data.collate import pad_text_batch, row_modalities

    a = _clip(tmp_path, "a.mp4", 12)
    frames = []
    for i, f in enumerate(moving_square("up", 3, (56, 56))):
        frames.append(f"f{i}.png")
        Image.fromarray(f).save(tmp_path / frames[-1])
    Image.fromarray(moving_square("up", 1, (84, 56))[0]).save(tmp_path / "still.png")
    record = {"video": [a, frames], "image": "still.png", "conversations": [
        {"from": "human", "value": "<video> then <image> then <video> ?"},
        {"from": "gpt", "value": "left"}]}
    proc = _processor("qwen2_5_vl")
    s = proc.process(record, tmp_path)
    assert s.modalities.tolist() == [2, 1, 2]
    # a.mp4: 12 frames at 4 fps = 3 s -> 6 frames at 2 fps -> 3 temporal patches of 4x4 patches
    assert s.image_grid_thw.tolist() == [[3, 4, 4], [1, 6, 4], [2, 4, 4]]
    assert s.second_per_grid_ts.tolist() == [pytest.approx(1.0), pytest.approx(1.0)]
    clip = load_video(tmp_path / a, proc.video, 28)
    pv, _ = video_patches(clip.frames, proc.image_processor)
    assert torch.equal(s.pixel_values[:48], pv)
    mm = s.mm_token_type_ids.tolist()
    runs = [(k, len(list(g))) for k, g in __import__("itertools").groupby(mm) if k]
    assert runs == [(2, 12), (1, 6), (2, 8)]  # pads in placeholder order
    batch = pad_text_batch([s], proc.pad_token_id)
    assert batch["image_grid_thw"].tolist() == [[1, 6, 4]]
    assert batch["video_grid_thw"].tolist() == [[3, 4, 4], [2, 4, 4]]
    assert batch["pixel_values_videos"].shape[0] == 48 + 32 and batch["pixel_values"].shape[0] == 24
    assert torch.equal(batch["pixel_values_videos"][:48], pv)
    assert row_modalities([s], 2).tolist() == [2] * 12 + [1] * 6 + [2] * 8


def test_qwen3_vl_timestamps_as_its_processor_renders_them(tmp_path):
    """Qwen3-VL's pads: the text transformers' ``Qwen3VLProcessor.replace_video_token`` writes
    for the same grid, frame indices and fps (its own method, on a stand-in self)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    name = _clip(tmp_path, "b.mp4", 14, fps=5)
    record = {"video": name, "conversations": [{"from": "human", "value": "<video>?"},
                                               {"from": "gpt", "value": "left"}]}
    proc = _processor("qwen3_vl")
    s = proc.process(record, tmp_path)
    clip = load_video(tmp_path / name, proc.video, 32)
    stand_in = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                               vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                               video_token="<|video_pad|>")
    stand_in._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(stand_in, *a)
    meta = VideoMetadata(total_num_frames=14, fps=clip.video_fps, frames_indices=clip.indices)
    want = Qwen3VLProcessor.replace_video_token(
        stand_in, {"video_grid_thw": s.image_grid_thw, "video_metadata": [meta]}, 0)
    text = proc.tokenizer.decode(s.input_ids)
    assert "<|vision_start|>" + want + "<|vision_end|>" in text
    assert "seconds>" in want and s.image_grid_thw[0, 0] == 2


def test_video_keys_reach_the_processor():
    from types import SimpleNamespace

    from ray_dhp.demo import tiny_processor
    from ray_dhp.train.custom_loop import build_processor
    from ray_dhp.config.train_loop import TrainLoopConfig

    ctx = SimpleNamespace(rank=0, dhp_config=SimpleNamespace(processor=tiny_processor(), model=None))
    cfg = TrainLoopConfig(video_fps=1.0, video_max_frames=16, video_total_pixels=10**6)
    assert build_processor(ctx, cfg).video == VideoSettings(fps=1.0, max_frames=16, total_pixels=10**6)
    from ray_dhp.config.checks import ConfigError

    with pytest.raises(ConfigError, match="video_min_frames"):
        TrainLoopConfig(video_min_frames=10, video_max_frames=8).validate()


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_packed_video_samples_equal_padded_fp64(tmp_path, family):
    """Packing computes each video sample's M-RoPE positions alone (video grids, Qwen2.5-VL's
    second_per_grid_ts, Qwen3-VL's per-frame grids): per-token logits equal the padded batch's
    (fp64; only the attention's summation order differs, 1e-12 bound as in test_packing.py)."""
    from ray_dhp.data.collate import pack_text_batch, pad_text_batch
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.demo import tiny_model_config
    from ray_dhp.demo.video import make_video_dataset
    from ray_dhp.models import build_model
    from tests.unit.packed_logits import assert_packed_logits_equal

    path = make_video_dataset(tmp_path / "d", num_samples=4)
    proc, recs = _processor(family), read_annotations(path)
    samples = [proc.process(recs[i], resolve_data_root(path)) for i in range(len(recs))]
    assert [None if s.modalities is None else s.modalities.tolist() for s in samples] == \
        [[2], [1, 2], [2], None]
    model = build_model(tiny_model_config(family), seed=0, dtype=torch.float64).eval()
    padded = pad_text_batch(samples, 0)
    packed = pack_text_batch(samples, 0, rope_index=model.model.get_rope_index)
    common = dict(pixel_values=padded["pixel_values"].double(), image_grid_thw=padded["image_grid_thw"],
                  pixel_values_videos=padded["pixel_values_videos"].double(),
                  video_grid_thw=padded["video_grid_thw"], use_cache=False)
    if family == "qwen2_5_vl":
        common["second_per_grid_ts"] = padded["second_per_grid_ts"]
    assert_packed_logits_equal(model, samples, padded, packed, common)


def test_load_processor_renders_timestamps_for_qwen3_vl_processors(tmp_path):
    import json

    from ray_dhp.data.processing import load_processor
    from ray_dhp.demo import tiny_processor

    tiny_processor("qwen3_vl").save_pretrained(tmp_path)
    assert not load_processor(str(tmp_path)).video_timestamps
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    assert load_processor(str(tmp_path)).video_timestamps
