"""Audio records (issue #33 groundwork): PyAV decoding, log-mel features, placeholder expansion
and collation against the stock ``Qwen2_5OmniProcessor`` (bitwise), the audio tower on our
collated features against the stock thinker's ``get_audio_features`` (bitwise), bad clips as
bad samples, and the refusal of audio records before training."""

import json

import numpy as np
import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.audio import (AudioSettings, decode_audio, find_audio_record,
                                refuse_audio)
from ray_dhp.data.collate import pad_text_batch
from ray_dhp.models.qwen2_5_omni import audio_inputs, audio_tokens
from ray_dhp.data.sample import BadSample, _messages
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.demo.audio import make_audio_dataset, tone, write_wav


@pytest.fixture(scope="module")
def audio_set(tmp_path_factory):
    path = make_audio_dataset(tmp_path_factory.mktemp("audio") / "set", num_samples=4)
    return path, read_annotations(path)


def _two_clip_record(root):
    """One record with two clips (16 kHz and 22.05 kHz) around an image, in one user turn."""
    from PIL import Image

    Image.new("RGB", (84, 56), (40, 80, 220)).save(root / "img.png")
    write_wav(root / "a.wav", tone("rising chirp", 0.7), 16000)
    write_wav(root / "b.wav", tone("low tone", 1.1, 22050), 22050)
    return {"audio": ["a.wav", "b.wav"], "image": "img.png", "conversations": [
        {"from": "human", "value": "<audio>\n<image>\nthen <audio>\nWhat do you hear?"},
        {"from": "gpt", "value": "a rising chirp then a low tone"}]}


def test_decode_wav_exact_and_resampled(tmp_path):
    wave = tone("high tone", 0.5)
    write_wav(tmp_path / "t.wav", wave)
    pcm = np.clip(np.round(wave * 32767), -32768, 32767).astype(np.int16)
    assert np.array_equal(decode_audio(tmp_path / "t.wav", 16000), pcm / np.float32(32768))
    write_wav(tmp_path / "r.wav", tone("high tone", 0.5, 22050), 22050)  # resampled to 16 kHz
    got = decode_audio(tmp_path / "r.wav", 16000)
    assert abs(got.size - 8000) <= 32
    peak = np.argmax(np.abs(np.fft.rfft(got))) * 16000 / got.size
    assert abs(peak - 880) < 4


def test_features_and_tokens_equal_the_stock_processor(tmp_path, audio_set, monkeypatch):
    """Our samples' ids and collated features / mask equal ``Qwen2_5OmniProcessor``'s for the
    same text and waveforms, bit for bit (its features run to the extractor's 30 s window; we
    stop at the longest clip: the columns after our mask are not compared, the model reads
    only masked ones, see test_audio_tower_equals_get_audio_features)."""
    from transformers import Qwen2_5OmniProcessor
    from transformers.processing_utils import ProcessorMixin

    path, records = audio_set
    root = resolve_data_root(path)
    (root / "two.jsonl").write_text(json.dumps(_two_clip_record(root)) + "\n")
    recs = [records[0], records[1], read_annotations(root / "two.jsonl")[0]]
    proc = demo.tiny_processor("qwen2_5_omni")
    samples = [proc.process(r, root) for r in recs]
    assert [s.audio_lengths.numel() for s in samples] == [1, 1, 2]
    # Without torchvision the stock class refuses its (unused) video-processor slot's type check.
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
    stock = Qwen2_5OmniProcessor(image_processor=proc.image_processor, video_processor=None,
                                 feature_extractor=proc.feature_extractor, tokenizer=proc.tokenizer)
    texts = [proc.renderer.render(_messages(r.data), proc.system_prompt)[0] for r in recs]
    waves = [decode_audio(root / n, 16000) for r in recs
             for n in ([r.data["audio"]] if isinstance(r.data["audio"], str) else r.data["audio"])]
    from PIL import Image
    images = [Image.open(root / r.data["image"]).convert("RGB") for r in recs if "image" in r.data]
    ref = stock(text=texts, audio=waves, images=images, return_tensors="pt", padding=True,
                padding_side="right")
    for i, s in enumerate(samples):
        n = s.num_tokens
        assert torch.equal(ref["input_ids"][i, :n], s.input_ids)
        assert int(ref["attention_mask"][i].sum()) == n
        assert int((s.mm_token_type_ids == 3).sum()) == int(audio_tokens(s.audio_lengths).sum())
    ours = audio_inputs(samples)
    feats, mask = ours["input_features"], ours["feature_attention_mask"]
    frames = mask.shape[1]
    assert torch.equal(ref["feature_attention_mask"][:, :frames].long(), mask)
    assert not ref["feature_attention_mask"][:, frames:].any()
    keep = mask.bool()[:, None, :].expand_as(feats)
    assert torch.equal(feats[keep], ref["input_features"][:, :, :frames][keep])
    assert torch.equal(pad_text_batch(samples, 0)["pixel_values"], ref["pixel_values"])


def test_audio_tower_equals_get_audio_features(audio_set):
    """The audio tower run on our collated features (`audio_forward`, the future module's
    forward) equals the stock thinker's ``get_audio_features`` on the stock processor's
    window-padded features, bit for bit (same masked columns, same tower)."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from ray_dhp.models.qwen2_5_omni import audio_forward

    path, records = audio_set
    proc = demo.tiny_processor("qwen2_5_omni")
    samples = [proc.process(r, resolve_data_root(path)) for r in records[:3]]
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(demo.tiny_model_config("qwen2_5_omni")).eval()
    ours = audio_inputs(samples)
    clips = [c for s in samples for c in s.audio_features.split(s.audio_lengths.tolist(), 1)]
    window = proc.feature_extractor.nb_max_frames
    stock_feats = torch.zeros(len(clips), 128, window)
    stock_mask = torch.zeros(len(clips), window, dtype=torch.int32)
    for i, c in enumerate(clips):  # the stock layout: every clip padded to the whole window
        stock_feats[i, :, :c.shape[1]], stock_mask[i, :c.shape[1]] = c, 1
        stock_feats[i, :, c.shape[1]:] = -0.5  # any value: unread past the mask
    with torch.no_grad():
        got = audio_forward(model.model.audio_tower, ours["input_features"],
                            ours["feature_attention_mask"])
        ref = model.get_audio_features(stock_feats, stock_mask).last_hidden_state
    assert got.shape == (int(audio_tokens(torch.cat([s.audio_lengths for s in samples])).sum()), 64)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("case,kind", [
    ("missing", "missing audio"), ("corrupt", "corrupt audio"), ("count", "audio count mismatch"),
    ("long", "audio too long"), ("malformed", "malformed record")])
def test_bad_clips_are_bad_samples(tmp_path, case, kind):
    write_wav(tmp_path / "ok.wav", tone("low tone", 0.8))
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVEfmt garbage")
    audio = {"missing": "nope.wav", "corrupt": "bad.wav", "count": ["ok.wav", "ok.wav"],
             "long": "ok.wav", "malformed": 3}[case]
    record = {"audio": audio, "conversations": [{"from": "human", "value": "<audio>\nHear?"},
                                                {"from": "gpt", "value": "a tone"}]}
    proc = demo.tiny_processor("qwen2_5_omni")
    if case == "long":
        proc.audio = AudioSettings(max_seconds=0.5)
    with pytest.raises(BadSample) as err:
        proc.process(record, tmp_path)
    assert err.value.kind == kind, err.value.reason


def test_audio_records_are_refused_before_training(tmp_path, audio_set):
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.config.train_loop import TrainLoopConfig

    text = {"conversations": [{"from": "human", "value": 'say "audio": no'},
                              {"from": "gpt", "value": "no"}]}
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps(text) + "\n")
    assert find_audio_record(clean) is None  # the word inside a value is not the key
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(text) + "\n" + audio_set[0].read_text())
    assert find_audio_record(mixed) == 2
    with pytest.raises(ValueError, match=r"mixed.jsonl:2: .*gives the audio encoder no group: add an 'audio:'"):
        refuse_audio([clean, mixed], "qwen2_5_omni", True)
    with pytest.raises(ValueError, match="the qwen2_5_vl family has no audio encoder"):
        refuse_audio([tmp_path], "qwen2_5_vl", False)
    cfg = TrainLoopConfig(global_batch_size=2, micro_batches=1, num_steps=1)
    sampler = StepSampler(read_annotations(audio_set[0]), demo.tiny_processor("qwen2_5_omni"),
                          resolve_data_root(audio_set[0]), cfg.sampler_config())
    with pytest.raises(ValueError, match="no group: add an 'audio:' section"):
        sampler.next_step()
    sampler.allow_audio = True  # a layout with an audio group (the loader sets it from the topology)
    step = sampler.next_step()
    assert all(s.audio_lengths is not None for mb in step for s in mb)
