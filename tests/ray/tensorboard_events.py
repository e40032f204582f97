"""Read TensorBoard event files back without TensorBoard: `test_mixture.py` here and
``tests/unit/test_tracking.py`` compare what they hold with the metrics reported."""

import glob
import os
import struct


def read_scalars(logdir: str) -> dict:
    """``{tag: {step: value}}`` from tensorboardX event files (TFRecord framing: u64 length,
    u32 crc, payload, u32 crc), parsed with tensorboardX's own Event proto."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out
