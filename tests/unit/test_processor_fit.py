"""A model directory's processor as transformers finds it (`ray_dhp.data.processor_dir`) and the
driver's check that it fits the model (`ray_dhp.data.compat`), through ``ray-dhp plan``,
``config`` and ``train``: each mismatch is a configuration error naming the file and field,
before Ray starts."""

import json
import logging
import shutil

import pytest

from ray_dhp.cli import EXIT_CONFIG, main
from ray_dhp.data.processing import load_processor
from ray_dhp.data.processor_dir import find_chat_template
from ray_dhp.demo import CHAT_TEMPLATE, DEFAULT_SYSTEM_PROMPT, tiny_model_config, tiny_processor

RECORD = {"conversations": [{"from": "human", "value": "Repeat: one"}, {"from": "gpt", "value": "one"}]}
OTHER = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL saved with save_pretrained: config, weights, tokenizer (template in
    chat_template.jinja), preprocessor_config.json."""
    import transformers

    root = tmp_path_factory.mktemp("fit") / "model"
    transformers.Qwen2_5_VLForConditionalGeneration._from_config(
        tiny_model_config("qwen2_5_vl")).save_pretrained(root)
    tiny_processor("qwen2_5_vl").save_pretrained(root)
    return root


def _copy(model_dir, tmp_path, name="m"):
    out = tmp_path / name
    shutil.copytree(model_dir, out)
    return out


def _move_template(folder, to: str):
    """The template out of chat_template.jinja / tokenizer_config.json, into file ``to`` only."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if to == "tokenizer_config.json":
        cfg["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if to == "chat_template.json":  # as Hub VL repos ship it
        (folder / to).write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    if to == "processor_config.json":
        (folder / to).write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json",
                                   "tokenizer_config.json", "processor_config.json"])
def test_the_template_is_found_in_each_file(where, model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    if where != "chat_template.jinja":
        _move_template(folder, where)
    assert find_chat_template(str(folder)) == (CHAT_TEMPLATE, where)
    proc = load_processor(str(folder))
    assert proc.uses_chat_template and proc.chat_source == str(folder / where)
    text = proc.tokenizer.decode(proc.process(RECORD, folder).input_ids)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>")


def test_transformers_precedence(model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": OTHER}))
    assert find_chat_template(str(folder))[1] == "chat_template.jinja"  # the raw file wins
    (folder / "processor_config.json").write_text(json.dumps({"chat_template": OTHER}))
    assert find_chat_template(str(folder)) == (OTHER, "processor_config.json")


def test_no_template_is_said_once_by_the_driver(model_dir, tmp_path, caplog):
    from ray_dhp import DHPConfig, DisaggregatedTrainer

    folder = _copy(model_dir, tmp_path)
    _move_template(folder, "none")
    assert find_chat_template(str(folder)) == (None, None)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    with caplog.at_level(logging.WARNING, logger="ray_dhp.train.trainer"):
        DisaggregatedTrainer(dhp_config=DHPConfig(model=str(folder)), datasets={"train": str(data)},
                             train_loop_config={"global_batch_size": 1, "num_steps": 1})
    notes = [r.message for r in caplog.records if "no chat template" in r.message]
    assert len(notes) == 1 and str(folder) in notes[0] and "chat_template.json" in notes[0]


def _edit_json(path, **changes):
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        sub, _, field = key.rpartition("__")
        (cfg[sub] if sub else cfg)[field] = value
    path.write_text(json.dumps(cfg))


def _break(folder, case, model):
    """Make the processor ``folder`` (or the ``model`` directory's config.json) not fit."""
    if case == "patch":
        _edit_json(folder / "preprocessor_config.json", patch_size=16)
    elif case == "temporal":
        _edit_json(folder / "preprocessor_config.json", temporal_patch_size=1)
    elif case == "merge":
        _edit_json(folder / "preprocessor_config.json", merge_size=1)
    elif case in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        _edit_json(model / "config.json", **{case: 7})  # another token's id
    elif case == "vocab":
        tok = load_processor(str(folder)).tokenizer
        tok.add_tokens([f"<extra_{i}>" for i in range(10)])  # 381 tokens > 376 rows
        tok.save_pretrained(folder)
    elif case == "no_image_processor":
        (folder / "preprocessor_config.json").unlink()
    elif case == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    elif case == "template_token":
        (folder / "chat_template.jinja").write_text(OTHER.replace("<|im_end|>", "<|eot_id|>"))
    elif case == "special_token":  # a tokenizer without <|im_start|>
        for name in ("tokenizer.json", "tokenizer_config.json"):
            text = (folder / name).read_text()
            (folder / name).write_text(text.replace("<|im_start|>", "<|start|>"))


MISMATCHES = {  # case: what the error names
    "patch": "preprocessor_config.json patch_size=16 but",
    "temporal": "preprocessor_config.json temporal_patch_size=1 but",
    "merge": "vision_config.spatial_merge_size=2",
    "image_token_id": "(config.json) image_token_id=7",
    "video_token_id": "(config.json) video_token_id=7",
    "vision_start_token_id": "(config.json) vision_start_token_id=7",
    "vision_end_token_id": "(config.json) vision_end_token_id=7",
    "vocab": "text_config.vocab_size=376",
    "no_image_processor": "preprocessor_config.json is missing",
    "no_tokenizer": "has no tokenizer files",
    "template_token": "(chat_template.jinja) writes <|eot_id|>, which is not a token",
    "special_token": "tokenizer has no <|im_start|> token",
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_each_mismatch_fails_in_the_driver(case, model_dir, tmp_path, capsys):
    folder, model = _copy(model_dir, tmp_path, "proc"), _copy(model_dir, tmp_path, "model")
    _break(folder, case, model)
    args = [f"model.path={model}", f"processor.path={folder}", "model.demo=null"]
    run = tmp_path / "run.yaml"
    run.write_text("{}\n")
    for command in (["plan", str(run)], ["config", str(run)]):
        assert main(command + args) == EXIT_CONFIG
        err = capsys.readouterr().err
        assert "configuration error: processor.path=" in err and MISMATCHES[case] in err, err


def test_train_refuses_before_ray_and_plan_checks_paths(model_dir, tmp_path, capsys, monkeypatch):
    import ray

    started = []  # Ray may already run in this pytest process (other tests): watch ray.init
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    folder = _copy(model_dir, tmp_path, "proc")
    _break(folder, "merge", None)
    run = tmp_path / "run.yaml"
    run.write_text("{}\n")
    base = [f"model.path={model_dir}", "model.demo=null", f"run.storage_path={tmp_path}"]
    assert main(["train", str(run), *base, f"processor.path={folder}"]) == EXIT_CONFIG
    assert "merge_size=1" in capsys.readouterr().err and not started
    for command in ("plan", "config", "train"):
        assert main([command, str(run), *base, f"processor.path={tmp_path}/nowhere"]) == EXIT_CONFIG
        assert "processor.path" in capsys.readouterr().err
        assert main([command, str(run), *base, f"data.train={tmp_path}/trian.jsonl"]) == EXIT_CONFIG
        assert f"data.train: {tmp_path}/trian.jsonl does not exist" in capsys.readouterr().err
    assert main(["plan", str(run), *base]) == 0  # the model directory's own processor fits


def test_internvl_processor_fits_its_model_through_the_public_config():
    """InternVL's config keeps ``vision_config.patch_size`` as ``(14, 14)`` where its image
    processor says ``14``: the matching pair must pass the driver's check (it was refused with
    "the processor belongs to another model"), and a different patch still fails."""
    import copy

    import pytest

    from ray_dhp import DHPConfig, ModuleParallel, demo
    from ray_dhp.config.checks import ConfigError
    from ray_dhp.data.compat import check_run_processor

    model = demo.tiny_model_config(family="internvl")
    assert tuple(model.vision_config.patch_size) == (14, 14)
    proc = demo.tiny_processor(family="internvl")
    cfg = DHPConfig(model=model, processor=proc, vision=ModuleParallel(sequence_parallel=2),
                    text=ModuleParallel(tensor_parallel=2))
    assert isinstance(check_run_processor(cfg), list)
    other = copy.deepcopy(model)
    other.vision_config.patch_size = (16, 16)
    with pytest.raises(ConfigError, match="patch_size=14 but .*vision_config.patch_size=.16, 16."):
        check_run_processor(DHPConfig(model=other, processor=proc,
                                      vision=ModuleParallel(sequence_parallel=2),
                                      text=ModuleParallel(tensor_parallel=2)))
