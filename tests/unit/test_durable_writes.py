"""Durable writes: metric history with torn lines, export that never merges into or half-writes
its target and never follows links out of the checkpoint, atomic metadata writes."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest

from ray_dhp.checkpointing import export
from ray_dhp.train.callbacks import HISTORY_FILE, MetricsHistory, read_history
from ray_dhp.checkpointing.integrity import write_atomic


def _ctx(tmp_path):
    return SimpleNamespace(run_config=SimpleNamespace(storage_path=str(tmp_path), name="run"))


def test_metrics_history_survives_a_torn_line(tmp_path, caplog):
    cb, ctx = MetricsHistory(), _ctx(tmp_path)
    cb.after_report(ctx, [{"step": 1, "loss": 2.0}], None)
    path = tmp_path / "run" / HISTORY_FILE
    with open(path, "ab") as f:
        f.write(b'{"step": 2, "lo')  # the driver died mid-append
    with caplog.at_level(logging.WARNING):
        assert [h["step"] for h in read_history(str(tmp_path / "run"))] == [1]
    assert f"{HISTORY_FILE}:2: torn metrics line" in caplog.text
    cb.after_report(ctx, [{"step": 3, "loss": 1.0}], None)  # the resumed run appends
    assert [h["step"] for h in read_history(SimpleNamespace(path=str(tmp_path / "run")))] == [1, 3]


def test_write_atomic_replaces_whole_files_only(tmp_path):
    p = tmp_path / "meta.json"
    write_atomic(str(p), json.dumps({"step": 1}))
    write_atomic(str(p), b'{"step": 2}')
    assert json.loads(p.read_text()) == {"step": 2}
    assert os.listdir(tmp_path) == ["meta.json"]  # no temporary file left behind


def test_export_refuses_a_non_empty_target(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export.export_hf(tmp_path / "no_checkpoint_needed", out)
    assert os.listdir(out) == ["tokenizer_config.json"]  # untouched


def test_staging_replaces_the_target_as_a_whole_or_not_at_all(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.json").write_text("old")
    with pytest.raises(RuntimeError):
        with export._staging(str(out)) as tmp:
            (tmp_path / tmp / "config.json").write_text("half")
            raise RuntimeError("crash mid-export")
    assert sorted(os.listdir(tmp_path)) == ["hf"] and os.listdir(out) == ["stale.json"]
    with export._staging(str(out)) as tmp:
        (tmp_path / tmp / "config.json").write_text("new")
    assert sorted(os.listdir(tmp_path)) == ["hf"] and os.listdir(out) == ["config.json"]


def test_processor_copy_never_follows_links_out_of_the_checkpoint(tmp_path, caplog):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_rsa").write_text("private")
    src = tmp_path / "ckpt" / "processor"
    (src / "sub").mkdir(parents=True)
    (src / "tokenizer.json").write_text("{}")
    (src / "sub" / "x.txt").write_text("x")
    (src / "leak.txt").symlink_to(secret / "id_rsa")
    (src / "leakdir").symlink_to(secret, target_is_directory=True)
    dst = tmp_path / "out"
    dst.mkdir()
    with caplog.at_level(logging.WARNING):
        export.copy_regular_files(str(src), str(dst))
    copied = sorted(os.path.relpath(os.path.join(b, f), dst) for b, _, fs in os.walk(dst) for f in fs)
    assert copied == ["sub/x.txt", "tokenizer.json"]
    assert "leak.txt" in caplog.text and "leakdir" in caplog.text
