"""Demo builders (tokenizer, tiny configs, processor, dataset) and the LLaVA data pipeline."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ray_dhp.data import (
    IGNORE_INDEX,
    BadSample,
    Sample,
    VLProcessor,
    as_vl_processor,
    image_grid,
    pad_text_batch,
    read_annotations,
    resolve_data_root,
)
from ray_dhp.demo import (
    FAMILIES,
    SPECIAL_TOKENS,
    build_tokenizer,
    make_dataset,
    tiny_model_config,
    tiny_processor,
)

REPO = Path(__file__).resolve().parents[2]
CONVERSATION = {
    "id": "known",
    "image": "images/000.png",
    "conversations": [
        {"from": "human", "value": "<image>\nDescribe the image."},
        {"from": "gpt", "value": "two red circles"},
    ],
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """12 samples, every 4th text-only, image sizes cycling through 3 shapes."""
    return make_dataset(tmp_path_factory.mktemp("shapes"), num_samples=12, text_only_every=4)


@pytest.fixture(scope="module")
def records(dataset):
    return read_annotations(dataset)


@pytest.fixture(scope="module")
def processor():
    return tiny_processor()


def _model_class(family):
    import transformers

    return {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
    }[family]


# --- tokenizer -------------------------------------------------------------------------------

_FINGERPRINT = (
    "import hashlib, json; from ray_dhp.demo import build_tokenizer; t = build_tokenizer(); "
    "print(hashlib.sha256(json.dumps([sorted(t.get_vocab().items()), "
    "t('two red circles<|im_end|>')['input_ids']]).encode()).hexdigest())"
)


def test_tokenizer_special_tokens_and_size():
    tok = build_tokenizer()
    assert build_tokenizer() is tok  # cached
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert len(tok) <= 512
    ids = tok("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>")["input_ids"]
    assert ids == [3, 5, 5, 4]  # special tokens are never split or merged
    assert tok.decode(tok("two red circles")["input_ids"]) == "two red circles"


def test_tokenizer_is_deterministic_across_processes():
    out = subprocess.run([sys.executable, "-c", _FINGERPRINT], cwd=REPO, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    tok = build_tokenizer()
    local = hashlib.sha256(json.dumps([sorted(tok.get_vocab().items()),
                                       tok("two red circles<|im_end|>")["input_ids"]]).encode())
    assert out.stdout.strip() == local.hexdigest()


def test_chat_template_renders_qwen_format():
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
        {"role": "assistant", "content": "two red circles"},
    ]
    text = build_tokenizer().apply_chat_template(messages, tokenize=False)
    body = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image."
            "<|im_end|>\n<|im_start|>assistant\ntwo red circles<|im_end|>\n")
    # Qwen2-VL's rule: a conversation without a system message gets the default one
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + body
    own = build_tokenizer().apply_chat_template([{"role": "system", "content": "Be brief."}] + messages,
                                                tokenize=False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n" + body


# --- tiny configs and models -----------------------------------------------------------------

QWEN_FAMILIES = tuple(f for f in FAMILIES if f.startswith("qwen"))


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_tiny_config_shapes_and_ids(family):
    config, tok = tiny_model_config(family), build_tokenizer()
    text, vision = config.text_config, config.vision_config
    assert text.vocab_size % 8 == 0 and len(tok) <= text.vocab_size < len(tok) + 8
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert text.pad_token_id == tok.pad_token_id and text.eos_token_id == tok.eos_token_id
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (64, 4, 4)
    rotary = text.rope_parameters.get("partial_rotary_factor", 1.0)  # Qwen3.5: half-rotary heads
    assert sum(text.rope_parameters["mrope_section"]) == int(64 // 4 * rotary) // 2
    assert text.attention_dropout == 0 and not config.tie_word_embeddings
    assert vision.num_heads == 4 and vision.depth == 4
    image_proc = tiny_processor(family).image_processor
    assert (image_proc.patch_size, image_proc.merge_size, image_proc.temporal_patch_size) == (
        vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    if family == "qwen2_5_vl":
        assert list(vision.fullatt_block_indexes) == [1, 3]
    if family == "qwen3_vl":
        assert list(vision.deepstack_visual_indexes) == [1, 2]
    if family.startswith("qwen3_5"):
        assert set(text.layer_types) == {"linear_attention", "full_attention"}


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_tiny_model_forward_backward(family, records, dataset):
    processor = tiny_processor(family)
    samples = [processor.process(r, resolve_data_root(dataset)) for r in records[:4]]
    assert samples[3].pixel_values is None  # the text-only one rides along
    batch = pad_text_batch(samples, processor.pad_token_id)
    torch.manual_seed(0)
    model = _model_class(family)(tiny_model_config(family))
    assert next(model.parameters()).dtype == torch.float32
    if family == "qwen3_vl":
        assert hasattr(model.model.language_model.layers[0].self_attn, "q_norm")
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    patch_grad = model.model.visual.patch_embed.proj.weight.grad
    assert patch_grad is not None and torch.isfinite(patch_grad).all() and patch_grad.abs().sum() > 0


def test_tiny_internvl_tiles_and_stock_forward(records, dataset):
    """The tiny InternVL: 56-px tiles of 4x4 patches, 2x2 feature rows per tile; the tile
    processor's patch rows turned back into tiles (`stock_pixels`) feed the stock model, whose
    placeholder count (``tiles * 4`` per image) matches the expanded pad tokens."""
    from transformers import InternVLForConditionalGeneration

    from ray_dhp.models.vision_internvl import stock_pixels

    config, tok = tiny_model_config("internvl"), build_tokenizer()
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert (config.vision_config.image_size, config.downsample_ratio) == ((56, 56), 0.5)
    processor = tiny_processor("internvl")
    samples = [processor.process(r, resolve_data_root(dataset)) for r in records[:4]]
    grids = torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None])
    assert (grids[:, 1:] == 4).all() and int(grids[:, 0].max()) > 1  # several tiles somewhere
    for s in samples[:3]:
        assert int((s.input_ids == config.image_token_id).sum()) == int(s.image_grid_thw[:, 0].sum()) * 4
        assert s.pixel_values.shape == (int(s.image_grid_thw.prod(-1).sum()), 3 * 14 * 14)
    batch = pad_text_batch(samples, processor.pad_token_id)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config)
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"],
                 pixel_values=stock_pixels(config, batch["pixel_values"], batch["image_grid_thw"])).loss
    loss.backward()
    grad = model.model.vision_tower.embeddings.patch_embeddings.projection.weight.grad
    assert torch.isfinite(loss) and grad is not None and grad.abs().sum() > 0


def test_tiny_internvl3_5_is_internvl_with_a_qwen3_lm():
    """``model.demo: internvl3_5``: the tiny InternVL (same tower, tiles and token ids) with a
    Qwen3 LM (head_dim 16, per-head q/k norms), read as the ``internvl`` family; its processor is
    InternVL's tiler."""
    from transformers import InternVLForConditionalGeneration

    from ray_dhp.data.tiles import TileImageProcessor
    from ray_dhp.models import family_of

    v3, v35 = tiny_model_config("internvl"), tiny_model_config("internvl3_5")
    assert (v3.text_config.model_type, v35.text_config.model_type) == ("qwen2", "qwen3")
    assert v35.text_config.head_dim == 16 and family_of(v35).name == "internvl"
    assert v35.vision_config.to_dict() == v3.vision_config.to_dict()
    assert v35.image_token_id == v3.image_token_id and v35._attn_implementation == "sdpa"
    assert isinstance(tiny_processor("internvl3_5").image_processor, TileImageProcessor)
    with torch.device("meta"):
        model = InternVLForConditionalGeneration(v35)
    assert model.model.language_model.layers[0].self_attn.q_norm.weight.shape == (16,)


def test_mrope_positions_are_2d_on_image_tokens(processor, records, dataset):
    sample = processor.process(records[2], resolve_data_root(dataset))  # 112x84 -> grid 6x8
    model = _model_class("qwen2_5_vl")(tiny_model_config())
    pos, _ = model.model.get_rope_index(sample.input_ids[None], sample.mm_token_type_ids[None],
                                        image_grid_thw=sample.image_grid_thw)
    image = sample.mm_token_type_ids == 1
    rows, cols = pos[1, 0, image], pos[2, 0, image]
    assert (rows.max() - rows.min() + 1, cols.max() - cols.min() + 1) == (3, 4)  # merged grid


def test_window_attention_has_several_windows():
    from transformers.vision_utils import get_vision_window_index

    vision = tiny_model_config("qwen2_5_vl").vision_config
    _, cu = get_vision_window_index(torch.tensor([[1, 8, 8]]), vision.spatial_merge_size,
                                    vision.window_size, vision.patch_size)
    assert len(cu) - 1 == 4


# --- processing ------------------------------------------------------------------------------

def test_label_masking_trains_exactly_the_assistant_turn(processor, dataset):
    tok = build_tokenizer()
    sample = processor.process(CONVERSATION, resolve_data_root(dataset))
    trained = sample.labels != IGNORE_INDEX
    assert tok.decode(sample.input_ids[trained]) == "two red circles<|im_end|>"
    assert torch.equal(sample.labels[trained], sample.input_ids[trained])  # unshifted
    assert not trained[sample.mm_token_type_ids == 1].any()
    prompt_end = int(trained.nonzero()[0])
    assert tok.decode(sample.input_ids[:prompt_end]).endswith("Describe the image.<|im_end|>\n"
                                                                "<|im_start|>assistant\n")
    assert not trained[prompt_end - 1] and not trained[-1]  # header and trailing newline


def test_label_masking_multi_turn_and_system(dataset):
    tok = build_tokenizer()
    proc = VLProcessor(tok, tiny_processor().image_processor, system_prompt="You are a helpful assistant.")
    record = dict(CONVERSATION, conversations=CONVERSATION["conversations"] + [
        {"from": "human", "value": "How many shapes are there?"}, {"from": "gpt", "value": "two"}])
    sample = proc.process(record, resolve_data_root(dataset))
    assert tok.decode(sample.input_ids).startswith("<|im_start|>system\nYou are a helpful assistant.")
    trained = sample.labels != IGNORE_INDEX
    assert tok.decode(sample.input_ids[trained]) == "two red circles<|im_end|>two<|im_end|>"


def test_image_pad_count_matches_grid_for_mixed_sizes(processor, records, dataset):
    tok, grids = build_tokenizer(), set()
    for record in records:
        sample = processor.process(record, resolve_data_root(dataset))
        if sample.image_grid_thw is None:
            continue
        (t, h, w), = sample.image_grid_thw.tolist()
        grids.add((t, h, w))
        pads = (sample.input_ids == tok.convert_tokens_to_ids("<|image_pad|>")).nonzero().flatten()
        assert len(pads) == t * h * w // 4 == int(sample.mm_token_type_ids.sum())
        assert pads[-1] - pads[0] + 1 == len(pads)  # one contiguous run
        assert sample.input_ids[pads[0] - 1] == 3 and sample.input_ids[pads[-1] + 1] == 4
        assert sample.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
        assert (t, h, w) == image_grid(resolve_data_root(dataset) / record.data["image"],
                                       processor.image_processor)
    assert grids == {(1, 4, 4), (1, 4, 6), (1, 6, 8)}


def test_text_only_sample(processor, records, dataset):
    sample = processor.process(records[3], resolve_data_root(dataset))
    assert sample.pixel_values is None and sample.image_grid_thw is None
    assert not sample.mm_token_type_ids.any() and sample.index == 3
    trained = sample.labels != IGNORE_INDEX
    assert build_tokenizer().decode(sample.input_ids[trained]) == records[3].data[
        "conversations"][1]["value"] + "<|im_end|>"


def test_processing_is_deterministic(records, dataset):
    a = tiny_processor().process(records[1], resolve_data_root(dataset))
    b = tiny_processor().process(records[1], resolve_data_root(dataset))
    for name in ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(getattr(a, name), getattr(b, name))


def test_pad_text_batch(processor, records, dataset):
    samples = [processor.process(r, resolve_data_root(dataset)) for r in records[:4]]
    batch = pad_text_batch(samples, pad_id=0, pad_to_multiple_of=4)
    lengths = [s.num_tokens for s in samples]
    assert batch["input_ids"].shape == (4, -(-max(lengths) // 4) * 4)
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for i, (n, s) in enumerate(zip(lengths, samples)):
        assert torch.equal(batch["input_ids"][i, :n], s.input_ids) and not batch["input_ids"][i, n:].any()
        assert (batch["labels"][i, n:] == IGNORE_INDEX).all() and not batch["mm_token_type_ids"][i, n:].any()
    assert torch.equal(batch["image_grid_thw"], torch.cat([s.image_grid_thw for s in samples[:3]]))
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    text_only = pad_text_batch([samples[3]], pad_id=0)
    assert text_only["pixel_values"] is None and text_only["image_grid_thw"] is None


# --- bad data --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, reason", [
    ("missing_image", "missing image"),
    ("corrupt_image", "corrupt image"),
    ("image_count_mismatch", "2 <image> placeholder(s) but 1 image(s)"),
    ("no_assistant", "no trainable tokens"),
    ("malformed_json", "malformed JSON"),
])
def test_bad_records_raise_bad_sample(tmp_path, processor, kind, reason):
    path = make_dataset(tmp_path, num_samples=3, bad_lines=[(1, kind)])
    records = read_annotations(path)
    assert len(records) == 3 and records[0].ok and records[2].ok
    assert records[1].ok == (kind != "malformed_json")
    with pytest.raises(BadSample) as info:
        processor.process(records[1], resolve_data_root(path))
    assert reason in info.value.reason
    assert info.value.where == f"{path}:2" and str(info.value).startswith(f"{path}:2: ")


@pytest.mark.parametrize("record, reason", [
    ({"conversations": "hi"}, "'conversations' must be a non-empty list"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown speaker 'robot'"),
    ({"conversations": [{"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "a<|im_end|>b"}]}, "special token <|im_end|>"),
    ({"image": 3, "conversations": [{"from": "human", "value": "<image>"},
                                    {"from": "gpt", "value": "x"}]}, "'image' must be a path"),
    ({"conversations": [{"from": "human", "value": "Repeat: one red circle"},
                        {"from": "gpt", "value": "one red circle"}]}, "too long"),
    ({"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>"},
                                             {"from": "gpt", "value": "x"}]}, "missing video"),
])
def test_malformed_and_too_long_records(processor, tmp_path, record, reason):
    with pytest.raises(BadSample) as info:
        processor.process(record, tmp_path, max_tokens=8)
    assert reason in info.value.reason


def test_malformed_json_line_reports_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 1, "conversations": []}\n\n{"id": 2,\n[1, 2]\n')
    records = read_annotations(path)
    assert [(r.line, r.ok) for r in records] == [(1, True), (3, False), (4, False)]
    assert records[1].where == f"{path}:3" and "malformed JSON" in records[1].error
    assert "not a JSON object" in records[2].error and records[2].index == 2


def test_read_json_array_folder_and_data_root(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps([CONVERSATION, 5]))
    (tmp_path / "a.jsonl").write_text(json.dumps(CONVERSATION) + "\n")
    records = read_annotations(tmp_path)
    assert [(Path(r.source).name, r.line, r.ok) for r in records] == [
        ("a.jsonl", 1, True), ("b.json", 0, True), ("b.json", 1, False)]
    assert records[2].where == f"{tmp_path / 'b.json'}[item 1]"
    assert resolve_data_root(tmp_path / "a.jsonl") == tmp_path.resolve()
    assert resolve_data_root([tmp_path / "a.jsonl"], "/data") == Path("/data")
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ValueError, match="bad.json"):
        read_annotations(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        read_annotations(tmp_path / "nope.jsonl")


def test_as_vl_processor_adapts_transformers_processors(processor, dataset):
    assert as_vl_processor(processor) is processor
    full = SimpleNamespace(tokenizer=build_tokenizer(), image_processor=processor.image_processor)
    adapted = as_vl_processor(full)
    sample = adapted.process(CONVERSATION, resolve_data_root(dataset))
    assert isinstance(sample, Sample) and sample.image_grid_thw is not None
    text_only = as_vl_processor(build_tokenizer())
    with pytest.raises(BadSample, match="no image processor"):
        text_only.process(CONVERSATION, resolve_data_root(dataset))
    with pytest.raises(TypeError, match="cannot use"):
        as_vl_processor(object())


# --- dataset ---------------------------------------------------------------------------------

def _tree_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*"))
            if p.is_file()}


def test_make_dataset_is_deterministic(tmp_path):
    a = make_dataset(tmp_path / "a", num_samples=8, seed=3, text_only_every=3)
    b = make_dataset(tmp_path / "b", num_samples=8, seed=3, text_only_every=3)
    c = make_dataset(tmp_path / "c", num_samples=8, seed=4, text_only_every=3)
    assert _tree_bytes(a.parent) == _tree_bytes(b.parent)
    assert a.read_bytes() != c.read_bytes()
    lines = [json.loads(line) for line in a.read_text().splitlines()]
    assert ["image" in r for r in lines] == [True, True, False] * 2 + [True, True]
    for r in lines:
        words = r["conversations"][1]["value"].split()
        assert words[0] in ("one", "two", "three") and len(words) == 3
        assert words[1] in ("red", "green", "blue", "yellow")
        assert words[2].rstrip("s") in ("circle", "square", "triangle")
        assert ("<image>" in r["conversations"][0]["value"]) == ("image" in r)
