"""Which checkpoint gets loaded: completeness rules and the fall-back to the previous one.

Checkpoints here are written in one process (DCP ``no_dist``) with the same files a real save
leaves (``.metadata``, shards, metadata JSON, ``COMMIT``); the multi-rank save/load itself is
covered by tests/distributed/test_checkpoint.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ray_dhp import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _fake_checkpoint(folder, step: int, *, commit: bool = True) -> str:
    d = os.path.join(folder, f"checkpoint_{step:06d}")
    dcp.save({"model": {"w": torch.full((64,), float(step))}}, checkpoint_id=d, no_dist=True)
    with open(os.path.join(d, ckpt.META_FILE), "w") as f:
        json.dump({"format_version": ckpt.FORMAT_VERSION, "step": step}, f)
    if commit:
        with open(os.path.join(d, ckpt.COMMIT_FILE), "w") as f:
            f.write(str(step))
    return d


@pytest.fixture
def run_dir(tmp_path):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    return tmp_path


def test_complete_checkpoints_and_run_folder(run_dir):
    newest = str(run_dir / "checkpoint_000006")
    assert ckpt.is_complete(newest)
    assert ckpt.resolve(newest) == newest
    assert ckpt.resolve(str(run_dir)) == newest  # a folder of checkpoints: its newest complete


@pytest.mark.parametrize("tear", ["no_commit", "missing_shard", "short_shard", "no_metadata"])
def test_torn_checkpoint_falls_back_to_the_previous_complete_one(run_dir, tear):
    torn = run_dir / "checkpoint_000006"
    shard = next(p for p in torn.iterdir() if p.name.endswith(".distcp"))
    if tear == "no_commit":
        (torn / ckpt.COMMIT_FILE).unlink()
    elif tear == "missing_shard":
        shard.unlink()
    elif tear == "short_shard":
        with open(shard, "r+b") as f:
            f.truncate(10)
    else:
        (torn / ".metadata").unlink()
    assert not ckpt.is_complete(str(torn))
    assert ckpt.resolve(str(torn)) == str(run_dir / "checkpoint_000004")
    assert ckpt.resolve(str(run_dir)) == str(run_dir / "checkpoint_000004")


def test_never_falls_forward_or_to_nothing(tmp_path):
    _fake_checkpoint(tmp_path, 4, commit=False)
    _fake_checkpoint(tmp_path, 6)
    # the torn step-4 checkpoint must not silently jump ahead to step 6
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ckpt.resolve(str(tmp_path / "checkpoint_000004"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.resolve(str(tmp_path / "nope"))
