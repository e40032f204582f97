"""Export's honest edges (`ray_dhp.checkpointing.export`): a source directory that is gone is
said with what the export lacks, ``--lora adapter`` on a run without LoRA is refused, a non-empty
target is a plain error, the tokenizer config carries no load-time keys, and every sub-config
names the dtype the weights are written in.

The checkpoint is one process's DCP save of a tiny model's parameters plus the processor files
the train loop keeps; `_write_export` is what `export_hf` runs on a resolved checkpoint."""

import json
import logging
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ray_dhp.checkpointing import checkpoint as ckpt
from ray_dhp.checkpointing import export
from ray_dhp.cli import main
from ray_dhp.data.processing import load_processor
from ray_dhp.demo import tiny_model_config, tiny_processor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def source_and_checkpoint(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("export")
    config = tiny_model_config("qwen2_5_vl")
    model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config)
    source = root / "source"
    model.save_pretrained(source)
    tiny_processor("qwen2_5_vl").save_pretrained(source)
    d = root / "checkpoint_000002"
    dcp.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}},
             checkpoint_id=str(d), no_dist=True)
    load_processor(str(source)).save_pretrained(d / ckpt.PROCESSOR_DIR)  # as the train loop does
    cfg_path = d / ckpt.PROCESSOR_DIR / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(is_local=True, local_files_only=True)  # what a tokenizer loaded from disk saves
    cfg_path.write_text(json.dumps(cfg))
    meta = {"family": "qwen2_5_vl", "model_config": config.to_json_string(), "modules": None}
    return source, str(d), meta


@pytest.mark.parametrize("template_in_checkpoint", [True, False])
def test_a_gone_source_is_said_and_the_rest_is_clean(template_in_checkpoint, source_and_checkpoint,
                                                     tmp_path, caplog):
    source, d, meta = source_and_checkpoint
    if not template_in_checkpoint:
        d = shutil.copytree(d, tmp_path / "checkpoint")
        (d / ckpt.PROCESSOR_DIR / "chat_template.jinja").unlink()
    out = tmp_path / "hf"
    out.mkdir()
    with caplog.at_level(logging.WARNING, logger="ray_dhp.checkpointing.export"):
        export._write_export(str(d), meta, str(out), torch.bfloat16, str(tmp_path / "moved"))
    said = [r.message for r in caplog.records]
    assert len(said) == 1 and str(tmp_path / "moved") in said[0]
    assert "generation_config.json" in said[0] and "--source" in said[0]
    assert ("chat template" in said[0]) is not template_in_checkpoint
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert not set(export.RUNTIME_KEYS) & set(tok)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert cfg["text_config"]["dtype"] == "bfloat16" and cfg["vision_config"]["dtype"] == "bfloat16"


def test_a_source_there_is_copied_without_a_word(source_and_checkpoint, tmp_path, caplog):
    source, d, meta = source_and_checkpoint
    out = tmp_path / "hf"
    out.mkdir()
    with caplog.at_level(logging.WARNING, logger="ray_dhp.checkpointing.export"):
        export._write_export(d, meta, str(out), None, str(source))
    assert not caplog.records
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert {cfg["dtype"], cfg["text_config"]["dtype"], cfg["vision_config"]["dtype"]} == {"float32"}


def test_lora_adapter_without_lora_is_refused(source_and_checkpoint, tmp_path):
    _, d, meta = source_and_checkpoint
    with pytest.raises(ValueError, match="trained no LoRA adapters"):
        export._write_export(d, meta, str(tmp_path / "hf"), None, None, lora="adapter")


def test_cli_errors_are_plain(source_and_checkpoint, tmp_path, capsys):
    _, d, _ = source_and_checkpoint
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("mine")
    assert main(["export", d, str(out)]) == 1
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "--overwrite" in err and "Traceback" not in err
    assert (out / "x").read_text() == "mine"
    shutil.rmtree(out)
