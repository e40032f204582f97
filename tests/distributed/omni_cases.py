"""The hand-composed steps of the tiny Qwen-Omni tests (`test_omni_audio.py`,
`test_omni_eval.py`, the Qwen3-Omni rows of `family_rows.py`) over the records of
``make_omni_dataset(root, videos=2)``: every modality, then no audio, then no image (so each
module once gets no input)."""

import dataclasses
import json

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.demo.omni import make_omni_dataset

# record indices of `omni_records`: images, text-only, audio clips, image + audio, videos
IMG, TXT, AUD, BOTH, VID = (0, 1, 3, 4), (2, 5), (6, 7, 8, 9), 10, (11, 12)
AUDIO_FIRST = 13  # `omni_records(..., audio_first=True)`: BOTH with its clip before its image
STEPS = (
    ((IMG[0], AUD[0], BOTH, TXT[0]), (IMG[1], AUD[1], VID[0], AUD[2])),  # every modality
    ((IMG[3], TXT[0], VID[1], TXT[1]), (IMG[1], TXT[1], IMG[2], TXT[0])),  # no audio
    ((AUD[0], TXT[0], AUD[3], TXT[1]), (AUD[1], AUD[2], TXT[0], AUD[3])),  # no image
)


#: the clips' lengths per family: Qwen3-Omni's tower cuts a clip into 1 s chunks (100 frames),
#: so its set has a 2.3 s clip (two whole chunks and a tail, three attention windows)
CLIP_SECONDS = {"qwen3_omni_moe": (0.6, 2.3)}


def omni_records(root, cfg, audio_first: bool = False, family: str = "qwen2_5_omni") -> list:
    """The processed `Sample` of every record of `make_omni_dataset` under ``root`` (images with
    text-only records, clips, one record with both, two videos: the indices above), processed
    under the loop configuration ``cfg``; ``audio_first``: one more record (`AUDIO_FIRST`), the
    image + clip record with its clip before its image; ``family``: whose tiny processor."""
    path = make_omni_dataset(root, videos=2, clip_seconds=CLIP_SECONDS.get(family, (0.6, 1.0)))
    if audio_first:
        lines = path.read_text().splitlines()
        record = json.loads(lines[BOTH])
        record["conversations"][0]["value"] = "<audio>\n<image>\nDescribe the sound and the image."
        path.write_text("\n".join(lines + [json.dumps(record)]) + "\n")
    sampler = StepSampler(read_annotations(path), demo.tiny_processor(family),
                          resolve_data_root(path), cfg.sampler_config())
    sampler.allow_audio = True
    return [sampler.process(i) for i in range(len(path.read_text().splitlines()))]


def omni_steps(tmp_path, family: str, cfg) -> list:
    """`STEPS` as `Sample` micro-batches of ``family``'s tiny processor (a `family_rows.Row`
    ``make``): 3 steps of 2 micro-batches of 4, indices distinct per step position."""
    samples = omni_records(tmp_path, cfg, family=family)
    assert samples[BOTH].audio_lengths is not None and samples[BOTH].image_grid_thw is not None
    return [[[dataclasses.replace(samples[i], index=n * 8 + k * 4 + j) for j, i in enumerate(mb)]
             for k, mb in enumerate(step)] for n, step in enumerate(STEPS)]
