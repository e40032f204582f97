"""Images decoded as transformers decodes them (`ray_dhp.data.images`): every PIL mode, odd
shapes and an EXIF-rotated JPEG give the pixels of ``transformers.image_utils.load_image`` + the
model's image processor (images without transparency) and of the image processor on the upright
image in its own mode (all: alpha composited on white, as ``convert_to_rgb`` does)."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.image_utils import load_image as hf_load_image

from ray_dhp.data import image_grid
from ray_dhp.demo import tiny_processor


def _gradient(size, channels):
    w, h = size
    x = np.linspace(0, 255, w)[None, :, None]
    y = np.linspace(0, 255, h)[:, None, None]
    c = np.arange(channels)[None, None, :] * 40
    return ((x + 2 * y + c) % 256).astype(np.uint8)


def _rgba(size):
    arr = np.concatenate([_gradient(size, 3), np.full((*size[::-1], 1), 255, np.uint8)], -1)
    arr[: size[1] // 2, :, :] = 0  # the top half: transparent black (what PNG editors store)
    arr[size[1] // 2:, : size[0] // 3, 3] = 128  # a half-transparent block
    return Image.fromarray(arr, "RGBA")


def _palette(transparent: bool):
    index = (_gradient((90, 70), 1)[..., 0] // 16).astype(np.uint8)  # 16 colours
    index[:, :30] = 0  # the transparent colour, when there is one
    img = Image.fromarray(index, "L").convert("P")
    img.putpalette([v for i in range(16) for v in (i * 16, 255 - i * 16, (i * 53) % 256)])
    if transparent:
        img.info["transparency"] = 0
    return img


def _exif_rotated(path):
    img = Image.fromarray(_gradient((160, 90), 3), "RGB")  # stored landscape, shown portrait
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 (cw) to view
    img.save(path, exif=exif, quality=95)


IMAGES = {  # name: (file name, writer, whether load_image loses its transparency)
    "rgb": ("rgb.png", lambda p: Image.fromarray(_gradient((120, 80), 3), "RGB").save(p), False),
    "rgba": ("rgba.png", lambda p: _rgba((100, 84)).save(p), True),
    "la": ("la.png", lambda p: _rgba((64, 96)).convert("LA").save(p), True),
    "l": ("l.png", lambda p: Image.fromarray(_gradient((84, 84), 1)[..., 0], "L").save(p), False),
    "p": ("p.png", lambda p: _palette(False).save(p), False),
    # (load_image's RGB copy keeps info["transparency"], so the processor still composites it)
    "p_transparent": ("pt.png", lambda p: _palette(True).save(p, transparency=0), False),
    "cmyk": ("cmyk.jpg", lambda p: Image.frombytes(
        "CMYK", (96, 64), _gradient((96, 64), 4).tobytes()).save(p), False),
    "i16": ("i16.png", lambda p: Image.frombytes("I;16", (80, 60), (
        _gradient((80, 60), 1)[..., 0].astype("<u2") * 257).tobytes()).save(p), False),
    "strip": ("strip.png", lambda p: Image.fromarray(_gradient((2000, 60), 3), "RGB").save(p), False),
    "icon": ("icon.png", lambda p: Image.fromarray(_gradient((10, 10), 3), "RGB").save(p), False),
    "exif_rotated": ("exif.jpg", _exif_rotated, False),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    for file, write, _ in IMAGES.values():
        write(root / file)
    return root


@pytest.fixture(scope="module")
def processor():
    return tiny_processor()


def _record(file):
    return {"image": file, "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                            {"from": "gpt", "value": "a picture"}]}


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_equal_transformers_loading(name, folder, processor):
    file, _, transparent = IMAGES[name]
    sample = processor.process(_record(file), folder)
    ip = processor.image_processor
    own_mode = ip(images=[ImageOps.exif_transpose(Image.open(folder / file))], return_tensors="pt")
    assert torch.equal(sample.image_grid_thw, own_mode["image_grid_thw"])
    assert torch.equal(sample.pixel_values, own_mode["pixel_values"].float())
    assert tuple(sample.image_grid_thw[0].tolist()) == image_grid(folder / file, ip)  # header-only
    hf = ip(images=[hf_load_image(str(folder / file))], return_tensors="pt")
    assert torch.equal(sample.image_grid_thw, hf["image_grid_thw"])
    if transparent:  # load_image drops alpha (transparent pixels keep their stored black)
        assert not torch.equal(sample.pixel_values, hf["pixel_values"].float())
    else:
        assert torch.equal(sample.pixel_values, hf["pixel_values"].float())


def test_exif_rotation_and_white_transparency(folder, processor):
    ip = processor.image_processor
    rotated = processor.process(_record("exif.jpg"), folder).image_grid_thw[0].tolist()
    with Image.open(folder / "exif.jpg") as img:
        stored = ip(images=[img.convert("RGB")], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert rotated[1] > rotated[2] and stored[1] < stored[2]  # portrait as shown, not as stored
    assert rotated == [stored[0], stored[2], stored[1]]
    # the transparent half of the RGBA image reaches the model as white, as with a white canvas
    img = Image.open(folder / "rgba.png")
    canvas = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img)
    want = ip(images=[canvas.convert("RGB")], return_tensors="pt")["pixel_values"].float()
    assert torch.equal(processor.process(_record("rgba.png"), folder).pixel_values, want)
