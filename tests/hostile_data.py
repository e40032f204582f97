"""A generated set of hostile annotation records (for the fuzz tests of the bad-data policy).

`make_hostile_dataset(folder)` writes ``data.jsonl`` holding valid demo records, valid records
with odd characters (BOM, U+2028, U+0085, NUL, CRLF, emoji), and one record of each hostile
class below, with the images they need; it returns the path, the line numbers of the bad
records (with their class) and the line numbers of the odd valid ones.
"""

from __future__ import annotations

import io
import random
import json
import struct
import zlib
from pathlib import Path

from PIL import Image

from ray_dhp import demo


def _png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width x height`` (the pixel data does not match)."""
    raw = bytearray(_png())
    raw[16:24] = struct.pack(">II", width, height)  # IHDR width, height
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))  # IHDR CRC
    return bytes(raw)


def _rec(user: str, answer: str = "a caption", image=None) -> dict:
    r = {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]}
    if image is not None:
        r["image"] = image
    return r


def _bad_records(img: Path) -> list:
    """``(class, JSONL line as bytes)`` for each hostile class."""
    (img / "truncated.png").write_bytes(_png((64, 64))[:40])
    noisy = io.BytesIO()
    Image.frombytes("L", (64, 64), random.Random(0).randbytes(4096)).save(noisy, format="PNG")
    (img / "cut_data.png").write_bytes(noisy.getvalue()[:-200])  # header fine, pixels cut
    (img / "empty.png").write_bytes(b"")
    (img / "huge_header.png").write_bytes(_png_claiming(8000, 8000))  # 64 MP > the 50 MP limit
    (img / "bomb.png").write_bytes(_png_claiming(30000, 30000))  # over Pillow's own bomb guard
    Image.new("RGB", (2020, 10)).save(img / "wide.png")  # aspect ratio 202 > 200
    (img / "text.png").write_text("not an image at all")
    _bad_videos(img)
    dumps = lambda o: json.dumps(o).encode()  # noqa: E731
    vid = lambda name: {**_rec("<video>\nx"), "video": f"images/{name}"}  # noqa: E731
    return [
        ("undecodable video", dumps(vid("junk.mp4"))),
        ("zero-byte video", dumps(vid("empty.mp4"))),
        ("one-frame video", dumps(vid("one.mp4"))),
        ("audio-only file", dumps(vid("audio.m4a"))),
        ("video count mismatch", dumps({**_rec("<video><video>\nx"), "video": "images/one.mp4"})),
        ("video wrong type", dumps({**_rec("<video>\nx"), "video": 5})),
        ("frame list with a missing frame", dumps({**_rec("<video>\nx"),
                                                    "video": ["images/000.png", "images/nope.png"]})),
        ("malformed JSON", b'{"conversations": [{"from": "human"'),
        ("not UTF-8", b'{"conversations": "\xff\xfe"}'),
        ("not an object", b"[1, 2, 3]"),
        ("not an object: string", b'"just a string"'),
        ("empty conversation", dumps({"conversations": []})),
        ("no conversations", dumps({"image": "images/000.png"})),
        ("conversations not a list", dumps({"conversations": {"from": "human", "value": "x"}})),
        ("non-string content", dumps({"conversations": [{"from": "human", "value": 123},
                                                        {"from": "gpt", "value": "x"}]})),
        ("turn not an object", dumps({"conversations": ["hello", "world"]})),
        ("unknown speaker", dumps({"conversations": [{"from": 5, "value": "x"},
                                                     {"from": "gpt", "value": "y"}]})),
        ("image wrong type", dumps(_rec("<image>\nx", image=[1, 2]))),
        ("no assistant turn", dumps({"conversations": [{"from": "human", "value": "x"}]})),
        ("special token in text", dumps(_rec("hi <|im_start|>system"))),
        ("video", dumps({**_rec("<video>\nx"), "video": "v.mp4"})),
        ("image count mismatch", dumps(_rec("<image><image>\nx", image="images/000.png"))),
        ("missing image file", dumps(_rec("<image>\nx", image="images/nope.png"))),
        ("truncated PNG", dumps(_rec("<image>\nx", image="images/truncated.png"))),
        ("PNG cut inside its pixel data", dumps(_rec("<image>\nx", image="images/cut_data.png"))),
        ("zero-size image file", dumps(_rec("<image>\nx", image="images/empty.png"))),
        ("not an image", dumps(_rec("<image>\nx", image="images/text.png"))),
        ("huge header-declared image", dumps(_rec("<image>\nx", image="images/huge_header.png"))),
        ("decompression bomb", dumps(_rec("<image>\nx", image="images/bomb.png"))),
        ("aspect ratio > 200", dumps(_rec("<image>\nx", image="images/wide.png"))),
        ("file name too long", dumps(_rec("<image>\nx", image="x" * 5000 + ".png"))),
        ("NUL in image path", dumps(_rec("<image>\nx", image="images/a\u0000b.png"))),
        ("lone surrogate", b'{"conversations": [{"from": "human", "value": "bad \\ud800 text"}, '
                           b'{"from": "gpt", "value": "x"}]}'),
        ("too many tokens", dumps(_rec("word " * 3000))),
        ("extremely long line", dumps(_rec("y" * 1_100_000))),  # > max_text_chars (1M)
    ]


def write_audio_only(path) -> None:
    """A media file with an audio track only (no video stream)."""
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate = 8000
        for _ in range(4):
            for p in stream.encode(frame):
                out.mux(p)
        for p in stream.encode():
            out.mux(p)


def _bad_videos(img: Path) -> None:
    from ray_dhp.demo.video import moving_square, write_mp4

    (img / "junk.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really" * 20)
    (img / "empty.mp4").write_bytes(b"")
    write_mp4(img / "one.mp4", moving_square("left", 1), 10)  # 1 frame: fewer than 2 to sample
    write_audio_only(img / "audio.m4a")

def _odd_valid_records() -> list:
    """Valid records whose text has characters a careless reader mangles."""
    dumps = lambda o: json.dumps(o, ensure_ascii=False).encode()  # noqa: E731
    return [
        dumps(_rec("line\u2028separator and next\u0085line", "para\u2029graph")),
        dumps(_rec("nul \u0000 inside", "ok")),
        dumps(_rec("emoji \U0001F600 and 漢字", "ünïcödé")),
        dumps(_rec("form\x0cfeed and \x1d group sep", "fine")) + b"\r",  # a CRLF line
    ]


def make_hostile_dataset(folder) -> tuple:
    """Write the set; return ``(data.jsonl path, {line: bad class}, {odd valid lines})``."""
    folder = Path(folder)
    good = demo.make_dataset(folder, num_samples=40, text_only_every=3).read_bytes().split(b"\n")
    good = [g for g in good if g.strip()]
    bad, odd = _bad_records(folder / "images"), _odd_valid_records()
    lines, bad_at, odd_at = [], {}, set()
    for k, line in enumerate(good):  # interleave: 40 good, 35 bad, 4 odd valid ones
        lines.append(line)
        if k < len(bad):
            lines.append(bad[k][1])
            bad_at[len(lines)] = bad[k][0]
        if k < len(odd):
            lines.append(odd[k])
            odd_at.add(len(lines))
        if k == 5:
            lines.append(b"")  # a blank line: not a record
    lines[0] = b"\xef\xbb\xbf" + lines[0]  # a UTF-8 byte-order mark
    path = folder / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, bad_at, odd_at
