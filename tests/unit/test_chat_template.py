"""Prompts rendered with the model's own chat template (`ray_dhp.data.chat`), the system prompt
setting, and the image processor's min/max pixels (`ray_dhp.data.pixels`)."""

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ray_dhp.config.checks import ConfigError
from ray_dhp.data import IGNORE_INDEX, BadSample, VLProcessor, image_grid
from ray_dhp.data.processing import load_processor
from ray_dhp.demo import DEFAULT_SYSTEM_PROMPT, build_tokenizer, tiny_model_config, tiny_processor
from ray_dhp.config.train_loop import TrainLoopConfig

DEFAULT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
#: a Qwen-style template without a default system prompt (like Qwen3-VL's)
NO_DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    for name, size in (("wide.png", (150, 60)), ("tall.png", (70, 110))):
        Image.new("RGB", size, (200, 30, 30)).save(root / name)
    return root


def _turns(*pairs):
    return [{"from": who, "value": text} for who, text in pairs]


# Each case: the record, and the same conversation as chat messages (written by hand).
CASES = {
    "image_multi_turn": (
        {"image": "wide.png", "conversations": _turns(
            ("human", "<image>\nDescribe the image."), ("gpt", "one red square"),
            ("human", "How many shapes are there?"), ("gpt", "one"))},
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nDescribe the image."}]},
         {"role": "assistant", "content": "one red square"},
         {"role": "user", "content": "How many shapes are there?"},
         {"role": "assistant", "content": "one"}]),
    "two_images": (
        {"image": ["wide.png", "tall.png"], "conversations": _turns(
            ("human", "<image> and <image>: what is in the picture?"), ("gpt", "two red squares"))},
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "},
                                      {"type": "image"},
                                      {"type": "text", "text": ": what is in the picture?"}]},
         {"role": "assistant", "content": "two red squares"}]),
    "text_only": (
        {"conversations": _turns(("human", "Repeat: two blue circles"), ("gpt", "two blue circles"),
                                 ("human", "Repeat: one"), ("gpt", "one"))},
        [{"role": "user", "content": "Repeat: two blue circles"},
         {"role": "assistant", "content": "two blue circles"},
         {"role": "user", "content": "Repeat: one"}, {"role": "assistant", "content": "one"}]),
}
SYSTEMS = {"default": None, "custom": "Answer in three words.", "empty": ""}


def _expected_ids(proc, messages, grids, system):
    """What transformers' Qwen-VL processors give: ``apply_chat_template(..., tokenize=True)`` of
    the whole conversation, each image pad repeated grid.prod() / merge**2 times."""
    tok = proc.tokenizer
    if system is not None:  # Qwen2-VL's template always writes a system turn: "" is an empty one
        messages = [{"role": "system", "content": system}] + messages
    ids = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    pad, counts = tok.convert_tokens_to_ids("<|image_pad|>"), iter(
        int(g.prod()) // proc.merge_size ** 2 for g in grids)
    return [t for i in ids for t in ([i] * next(counts) if i == pad else [i])]


def _assistant_mask(tok, ids):
    """True exactly at the tokens of each assistant reply and its closing <|im_end|>, found from
    the token ids alone: after ``<|im_start|>`` + the tokens of "assistant\\n", up to the next
    ``<|im_end|>``."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    header = tok("assistant\n", add_special_tokens=False)["input_ids"]
    mask, i = [False] * len(ids), 0
    while i < len(ids):
        if ids[i] == start and ids[i + 1:i + 1 + len(header)] == header:
            j = i + 1 + len(header)
            while ids[j] != end:
                mask[j], j = True, j + 1
            mask[j], i = True, j
        i += 1
    return torch.tensor(mask)


@pytest.mark.parametrize("system", list(SYSTEMS))
@pytest.mark.parametrize("case", list(CASES))
def test_ids_equal_the_templates_rendering_and_labels_are_the_replies(case, system, images):
    record, messages = CASES[case]
    proc = tiny_processor().configured(system_prompt=SYSTEMS[system])
    assert proc.uses_chat_template
    sample = proc.process(record, images)
    grids = [] if sample.image_grid_thw is None else list(sample.image_grid_thw)
    expected = _expected_ids(proc, messages, grids, SYSTEMS[system])
    assert sample.input_ids.tolist() == expected
    trained = sample.labels != IGNORE_INDEX
    assert torch.equal(trained, _assistant_mask(proc.tokenizer, expected))
    assert torch.equal(sample.labels[trained], sample.input_ids[trained])
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert proc.tokenizer.decode(sample.input_ids[trained]) == "".join(replies)
    text = proc.tokenizer.decode(sample.input_ids)
    head = {"default": DEFAULT, "custom": "<|im_start|>system\nAnswer in three words.<|im_end|>\n",
            "empty": "<|im_start|>system\n<|im_end|>\n"}[system]
    assert text.startswith(head + "<|im_start|>user\n")
    assert int((sample.mm_token_type_ids == 1).sum()) == sum(int(g.prod()) // 4 for g in grids)


def test_a_records_own_system_turn_wins(images):
    record = {"conversations": _turns(("system", "Be terse."), ("human", "Repeat: one"), ("gpt", "one"))}
    for system in SYSTEMS.values():
        sample = tiny_processor().configured(system_prompt=system).process(record, images)
        text = build_tokenizer().decode(sample.input_ids)
        assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user")
        assert text.count("<|im_start|>system") == 1


def test_empty_system_prompt_omits_the_turn_where_the_template_allows(images):
    base = tiny_processor()
    proc = VLProcessor(base.tokenizer, base.image_processor, system_prompt="",
                       chat_template=NO_DEFAULT_TEMPLATE)
    record, messages = CASES["image_multi_turn"]
    sample = proc.process(record, images)
    assert proc.renderer.omits_system() and not tiny_processor().renderer.omits_system()
    assert proc.tokenizer.decode(sample.input_ids).startswith("<|im_start|>user\n<|vision_start|>")
    ids = proc.tokenizer.apply_chat_template(messages, chat_template=NO_DEFAULT_TEMPLATE)["input_ids"]
    assert sample.num_tokens == len(ids) - 1 + int(sample.image_grid_thw.prod()) // 4
    assert torch.equal(sample.labels != IGNORE_INDEX, _assistant_mask(proc.tokenizer, sample.input_ids.tolist()))


def test_without_a_template_our_own_format_gives_the_same_tokens_as_the_template(images):
    tok = build_tokenizer()
    bare = type(tok)(tokenizer_object=tok.backend_tokenizer, pad_token="<|endoftext|>",
                     eos_token="<|im_end|>")  # the same vocabulary, no chat template
    assert bare.chat_template is None
    own = VLProcessor(bare, tiny_processor().image_processor, system_prompt=DEFAULT_SYSTEM_PROMPT)
    templated = tiny_processor()  # default system prompt = the same text
    assert not own.uses_chat_template and templated.uses_chat_template
    for record, _ in CASES.values():
        a, b = own.process(record, images), templated.process(record, images)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    no_system = VLProcessor(bare, None).process(CASES["text_only"][0], images)
    assert bare.decode(no_system.input_ids).startswith("<|im_start|>user\nRepeat")


def test_a_template_that_cannot_be_split_into_turns_makes_a_bad_sample(images):
    record = {"conversations": _turns(("gpt", "one"), ("human", "Repeat: one"), ("gpt", "one"))}
    with pytest.raises(BadSample, match="chat template"):
        tiny_processor().process(record, images)


@pytest.mark.parametrize("limits", [dict(min_pixels=28 * 28 * 16), dict(max_pixels=28 * 28 * 5),
                                    dict(min_pixels=28 * 28 * 12, max_pixels=28 * 28 * 20)])
def test_min_max_pixels_change_the_grid_as_the_processor_does(limits, images):
    record = CASES["two_images"][0]
    base = tiny_processor()
    default = base.process(record, images)
    proc = base.configured(**limits)
    sample = proc.process(record, images)
    size = base.image_processor.size
    reference = Qwen2VLImageProcessorPil(
        min_pixels=limits.get("min_pixels", size["shortest_edge"]),
        max_pixels=limits.get("max_pixels", size["longest_edge"]), patch_size=14, merge_size=2,
        temporal_patch_size=2)
    pics = [Image.open(images / n).convert("RGB") for n in ("wide.png", "tall.png")]
    out = reference(images=pics, return_tensors="pt")
    assert torch.equal(sample.image_grid_thw, out["image_grid_thw"])
    assert torch.equal(sample.pixel_values, out["pixel_values"].float())
    assert not torch.equal(sample.image_grid_thw, default.image_grid_thw)
    assert [image_grid(images / n, proc.image_processor) for n in ("wide.png", "tall.png")] == \
        [tuple(g) for g in out["image_grid_thw"].tolist()]
    assert int((sample.mm_token_type_ids == 1).sum()) == int(out["image_grid_thw"].prod(-1).sum()) // 4
    assert base.image_processor.size == size  # the original is not changed


def test_saved_processor_keeps_template_and_pixel_limits(tmp_path, images):
    proc = tiny_processor().configured(min_pixels=28 * 28 * 12, max_pixels=28 * 28 * 20)
    proc.save_pretrained(tmp_path)
    loaded = load_processor(str(tmp_path))
    assert loaded.renderer.chat_template == proc.renderer.chat_template
    assert dict(loaded.image_processor.size) == dict(proc.image_processor.size)
    record = CASES["image_multi_turn"][0]
    assert torch.equal(loaded.process(record, images).input_ids, proc.process(record, images).input_ids)


# --- driver-side validation -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(min_pixels=5000, max_pixels=4000), "train_loop_config.min_pixels=5000 > train_loop_config.max_pixels"),
    (dict(min_pixels=0), "train_loop_config.min_pixels"),
    (dict(max_pixels="many"), "train_loop_config.max_pixels"),
    (dict(system_prompt="<image> is a picture"), "train_loop_config.system_prompt"),
])
def test_loop_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainLoopConfig.from_dict(kwargs)


def test_trainer_rejects_max_pixels_below_one_patch_unit_before_workers_start(tmp_path):
    from ray_dhp import DHPConfig, DisaggregatedTrainer

    (tmp_path / "x.json").write_text("[]")
    dhp = DHPConfig(model=tiny_model_config(), processor=tiny_processor())
    with pytest.raises(ConfigError, match=r"train_loop_config.max_pixels=500: below one merged patch unit \(28x28"):
        DisaggregatedTrainer(dhp_config=dhp, train_loop_config={"max_pixels": 500}, datasets={"train": str(tmp_path / "x.json")})
    with pytest.raises(ConfigError, match="train_loop_config.min_pixels=20000 > the image processor's max_pixels=12544"):
        DisaggregatedTrainer(dhp_config=dhp, train_loop_config={"min_pixels": 20000}, datasets={"train": str(tmp_path / "x.json")})


def test_run_file_keys_and_errors():
    from ray_dhp.run_file import run_file_from_dict

    rf = run_file_from_dict({"processor": {"system_prompt": "", "min_pixels": 3136, "max_pixels": 6272}})
    loop = rf.train_loop_config()["processor"]
    assert (loop["system_prompt"], loop["min_pixels"], loop["max_pixels"]) == ("", 3136, 6272)
    for data, match in [
        ({"processor": {"max_pixels": 100}}, "processor.max_pixels=100: below one merged patch unit"),
        ({"processor": {"min_pixels": 20000}}, "processor.min_pixels=20000 > the image processor's"),
        ({"processor": {"min_pixels": 9000, "max_pixels": 4000}}, "processor.min_pixels=9000 > processor.max_pixels"),
        ({"processor": {"system_promt": "x"}}, "did you mean 'processor.system_prompt'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            run_file_from_dict(data)


def test_processor_pickles_with_its_template_and_limits(images):
    """Data-worker processes get the processor pickled: same template, system prompt and size."""
    import pickle

    proc = tiny_processor().configured(system_prompt="Be terse.", max_pixels=28 * 28 * 5)
    copy = pickle.loads(pickle.dumps(proc))
    record = CASES["two_images"][0]
    a, b = proc.process(record, images), copy.process(record, images)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.image_grid_thw, b.image_grid_thw)


def test_a_template_that_refuses_a_conversation_makes_a_bad_sample(images):
    strict = ("{% for m in messages %}{% if m['role'] == 'user' and loop.index0 % 2 == 1 %}"
              "{{ raise_exception('roles must alternate') }}{% endif %}"
              "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    proc = VLProcessor(build_tokenizer(), None, chat_template=strict)
    ok = {"conversations": _turns(("human", "Repeat: one"), ("gpt", "one"))}
    assert proc.tokenizer.decode(proc.process(ok, images).input_ids) == \
        "<|im_start|>user\nRepeat: one<|im_end|>\n<|im_start|>assistant\none<|im_end|>\n"
    two_users = {"conversations": _turns(("human", "Repeat:"), ("human", "one"), ("gpt", "one"))}
    with pytest.raises(BadSample, match="chat template: TemplateError: roles must alternate"):
        proc.process(two_users, images)


def test_the_train_loop_applies_the_settings_and_workers_do_not_warn(caplog):
    import logging
    from types import SimpleNamespace

    from ray_dhp.train.custom_loop import build_processor

    def ctx(processor, rank=0):
        return SimpleNamespace(rank=rank, dhp_config=SimpleNamespace(processor=processor, model=None))

    cfg = TrainLoopConfig(system_prompt="Be terse.", min_pixels=28 * 28 * 12, max_pixels=28 * 28 * 20)
    proc = build_processor(ctx(tiny_processor()), cfg)
    assert proc.system_prompt == "Be terse." and proc.uses_chat_template
    assert (proc.image_processor.size["shortest_edge"], proc.image_processor.size["longest_edge"]) == (9408, 15680)
    kept = VLProcessor(build_tokenizer(), None, system_prompt="Mine.")
    assert build_processor(ctx(kept), TrainLoopConfig()).system_prompt == "Mine."  # unset keeps it
    tok = build_tokenizer()
    bare = type(tok)(tokenizer_object=tok.backend_tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    with caplog.at_level(logging.WARNING, logger="ray_dhp.train.custom_loop"):
        build_processor(ctx(VLProcessor(bare, None)), TrainLoopConfig())
        build_processor(ctx(VLProcessor(bare, None), rank=1), TrainLoopConfig())
    assert not caplog.records  # the driver says it, once (tests/unit/test_processor_fit.py)
