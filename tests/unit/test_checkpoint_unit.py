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

from ray_dhp.checkpointing import checkpoint as ckpt
from ray_dhp.checkpointing import compat, integrity
from ray_dhp.checkpointing.hashing import HashingWriter, VerifyingReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((64,), float(step)), "v": torch.arange(10.0) * step},
            "sched": {"last_epoch": step}}


def _fake_checkpoint(folder, step: int, *, commit: bool = True) -> str:
    """The files `ckpt.save` leaves, written by the same helpers (checksummed DCP writer, file
    list, COMMIT)."""
    d = os.path.join(folder, f"checkpoint_{step:06d}")
    writer = HashingWriter(d)
    dcp.save(_state(step), storage_writer=writer, no_dist=True)
    torch.save({"torch": torch.get_rng_state()}, os.path.join(d, "rng_rank0.pt"))
    files = integrity.file_records(d, [n for n in os.listdir(d)], writer.chunks)
    meta = {"format_version": ckpt.FORMAT_VERSION, "step": step, "files": files}
    if commit:
        integrity.commit(d, meta)
    else:
        integrity.write_atomic(os.path.join(d, ckpt.META_FILE), json.dumps(meta))
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


def test_a_flipped_bit_falls_back_to_the_previous_intact_checkpoint(run_dir):
    newest = run_dir / "checkpoint_000006"
    shard = next(p for p in newest.iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the content hash can tell
    shard.write_bytes(bytes(raw))
    assert ckpt.is_complete(str(newest))  # the cheap scan still accepts it...
    assert integrity.verify(str(newest)) == [shard.name]  # ...the hash does not
    assert ckpt.resolve(str(newest)) == str(run_dir / "checkpoint_000004")
    assert ckpt.resolve(str(run_dir)) == str(run_dir / "checkpoint_000004")
    assert ckpt.resolve(str(run_dir), verify=False) == str(newest)


@pytest.mark.parametrize("damage", ["torn_json", "edited_json", "not_an_object"])
def test_corrupt_metadata_with_commit_present_falls_back(run_dir, damage):
    meta = run_dir / "checkpoint_000006" / ckpt.META_FILE
    text = meta.read_text()
    meta.write_text({"torn_json": text[: len(text) // 2],
                     "edited_json": text.replace('"step": 6', '"step": 7'),
                     "not_an_object": "[6]"}[damage])
    assert not ckpt.is_complete(str(meta.parent))
    assert ckpt.resolve(str(run_dir)) == str(run_dir / "checkpoint_000004")


def test_scanning_reads_no_pickle(run_dir, monkeypatch):
    """Finding the latest complete checkpoint reads JSON and file sizes only: DCP's pickled
    .metadata is not opened (it is read by the load itself)."""
    def refuse(*a, **k):
        raise AssertionError("DCP metadata (a pickle) read during a scan")

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", refuse)
    assert ckpt.resolve(str(run_dir)) == str(run_dir / "checkpoint_000006")


def test_one_format_a_checkpoint_without_a_file_list_is_not_complete(tmp_path):
    d = _fake_checkpoint(tmp_path, 2)
    meta = json.loads(open(os.path.join(d, ckpt.META_FILE)).read())
    del meta["files"]
    integrity.commit(d, meta)
    assert not ckpt.is_complete(d)


def test_checksums_are_the_stored_items_and_are_checked_while_loading(run_dir):
    """The writer's chunks are exactly DCP's stored items (offset, length); the verifying
    reader loads the same values as DCP's own reader and refuses a flipped bit."""
    d = str(run_dir / "checkpoint_000006")
    meta = ckpt.read_meta(d)
    chunks = integrity.shard_chunks(meta)
    items = dcp.FileSystemReader(d).read_metadata().storage_data
    assert sorted((i.relative_path, i.offset, i.length) for i in items.values()) == \
        sorted((f, off, n) for f, rows in chunks.items() for off, n, _ in rows)
    got = {"model": {"w": torch.zeros(64), "v": torch.zeros(10)}, "sched": {"last_epoch": 0}}
    dcp.load(got, storage_reader=VerifyingReader(d, chunks), no_dist=True)
    want = _state(6)
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["v"], want["model"]["v"])
    assert got["sched"]["last_epoch"] == 6
    (shard,) = chunks
    raw = bytearray(open(os.path.join(d, shard), "rb").read())
    off, n, _ = max(chunks[shard], key=lambda c: c[1])
    raw[off + n // 2] ^= 0x10
    open(os.path.join(d, shard), "wb").write(bytes(raw))
    with pytest.raises(BaseException) as e:  # DCP wraps it in a CheckpointException
        dcp.load(got, storage_reader=VerifyingReader(d, chunks), no_dist=True)
    assert ckpt._corrupt_chunk(e.value) is not None and "checksum mismatch" in str(e.value)


def test_rng_state_is_read_without_unpickling_code(tmp_path):
    import pickle
    import random

    path = tmp_path / "rng_rank0.pt"
    torch.save(ckpt._rng_state(), path)
    expect = (torch.rand(3), random.random())
    ckpt._set_rng_state(torch.load(path, weights_only=True))  # what `load` does
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1]

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path.write_bytes(pickle.dumps({"torch": Evil()}))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference():
    from types import SimpleNamespace

    from ray_dhp import demo

    deep = demo.tiny_model_config("qwen2_5_vl")
    deep.text_config.num_hidden_layers = 2
    shallow = demo.tiny_model_config("qwen2_5_vl")
    shallow.text_config.num_hidden_layers = 1
    shallow.text_config.attention_dropout = 0.1  # not a different model: ignored
    meta = {"model_config": deep.to_json_string(use_diff=False)}
    with pytest.raises(ValueError, match=r"text_config\.num_hidden_layers is 2 in the checkpoint "
                                         r"but 1 in this run"):
        compat.check_same_model(meta, SimpleNamespace(config=shallow))
    compat.check_same_model(meta, SimpleNamespace(config=deep))  # the same model: accepted
