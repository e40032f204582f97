"""The Qwen-Omni thinkers' packed rows in one process: each sample's logits from the packed rows
equal its padded row's (`ray_dhp.data.collate.pack_text_batch` with the family's
`FamilySpec.rope_index`; the engine's packed runs are tests/distributed/test_omni_packing.py)."""

import pytest
import torch

from ray_dhp.data import pack_text_batch, pad_text_batch
from ray_dhp.data.collate import pack_rows
from ray_dhp.demo import tiny_model_config
from ray_dhp.models import build_model
from tests.unit.packed_logits import assert_packed_logits_equal


@pytest.mark.parametrize("family, video", [("qwen2_5_omni", False), ("qwen3_omni_moe", False),
                                           pytest.param("qwen3_omni_moe", True, marks=pytest.mark.slow)])
def test_omni_thinker_packed_forward_equals_padded_fp64(tmp_path, family, video):
    """The Qwen-Omni thinkers (`FamilySpec.rope_index`: their own ``get_rope_index`` behind the
    Qwen-VL signature, each sample's clip lengths handed in): an image, a clip, a record with an
    image and a clip, and text-only records pack into rows whose audio placeholders take the
    clips in order (Qwen3-Omni: and whose image rows take their deepstack rows); each sample's
    logits equal its padded row's within 1e-12 (measured: equal bitwise). Positions that ignored
    the image (the 1-D fallback for the image + clip record) are O(1) off. A record with its clip
    before its image (``AUDIO_FIRST``) needs the clip's length to place the image.
    ``video`` (slow: a 335-token video, ~20 s): Qwen3-Omni's video frames sit at fractional
    temporal positions (0.5 s per temporal patch x 25 per second), kept unrounded (rounded: 2e-2
    of the video sample's logits)."""
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.models import FAMILIES
    from ray_dhp.models.qwen2_5_omni import audio_inputs
    from tests.distributed.omni_cases import AUD, AUDIO_FIRST, BOTH, IMG, TXT, VID, omni_records

    records = omni_records(tmp_path, TrainLoopConfig(), audio_first=True, family=family)
    samples = [records[i] for i in (IMG[0], AUD[0], BOTH, TXT[0], AUDIO_FIRST, IMG[1])]
    samples += [records[VID[0]], records[TXT[1]]] if video else []
    assert records[AUDIO_FIRST].audio_lengths is not None
    spec, config = FAMILIES[family], tiny_model_config(family)
    model = build_model(config, seed=0, dtype=torch.float64).eval()
    padded = pad_text_batch(samples, 0)
    max_tokens = 420 if video else 180
    packed = pack_text_batch(samples, 0, max_tokens, rope_index=spec.rope_index(model))
    assert pack_rows([s.num_tokens for s in samples], max_tokens) == (
        [range(0, 6), range(6, 8)] if video else [range(0, 3), range(3, 6)])
    audio = audio_inputs(samples)
    common = dict(pixel_values=padded["pixel_values"].double(), image_grid_thw=padded["image_grid_thw"],
                  input_features=audio["input_features"].double(),
                  feature_attention_mask=audio["feature_attention_mask"], use_cache=False)
    if video:
        common.update(pixel_values_videos=padded["pixel_values_videos"].double(),
                      video_grid_thw=padded["video_grid_thw"],
                      **{spec.video_seconds_key: padded["second_per_grid_ts"]})
        frames = packed["position_ids"][1, packed["sample_ids"] == 6]
        assert not torch.equal(frames, frames.round())  # fractional times, kept
    assert_packed_logits_equal(model, samples, padded, packed, common)
    both = packed["position_ids"][1:, packed["sample_ids"] == 2]  # the image + clip record
    assert not torch.equal(both, torch.arange(both.shape[1]).expand(3, -1))
