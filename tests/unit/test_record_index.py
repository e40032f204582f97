"""The memory-mapped record index (`ray_dhp.data.index`) and the Ray Dataset spool
(`ray_dhp.data.spool`): the same records as parsing the file whole, re-indexed when the file
changes, chunk boundaries, JSON arrays converted once, pickling by path, and the spool's rows and
resume (no Ray cluster: a stand-in iterator yields the batches)."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa

import pytest

from ray_dhp.data import index as index_mod
from ray_dhp.data.reading import parse_record, read_annotations
from ray_dhp.data.spool import spool_dataset
from tests.hostile_data import make_hostile_dataset


def _reference(raw: bytes):
    """(line, data, error) of every non-blank line, parsing the whole file the plain way."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    out = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            blank = not line.decode("utf-8").strip()
        except UnicodeDecodeError:
            blank = False
        if not blank:
            out.append((number, *parse_record(line)))
    return out


def test_the_index_gives_every_record_of_the_hostile_set_exactly(tmp_path):
    path, bad_at, odd_at = make_hostile_dataset(tmp_path / "h")
    raw = path.read_bytes()
    with open(path, "ab") as f:  # blank lines of every kind, and a last line without "\n"
        f.write(b"\n  \t\r\n\xc2\x85\xe2\x80\xa8\n\xe3\x80\x80\n\x0c\n" + b'{"last": 1}')
    recs = read_annotations(path)
    ref = _reference(path.read_bytes())
    assert [(r.line, r.data, r.error) for r in recs] == ref
    assert {r.line for r in recs if not r.ok} <= set(bad_at)
    assert recs[-1].data == {"last": 1} and raw.count(b"\n") < recs[-1].line
    assert [r.index for r in recs] == list(range(len(recs)))
    assert len(index_mod.ENTRY.descr) == 3 and index_mod.ENTRY.itemsize == 16  # bytes a record


def test_lines_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "_CHUNK", 7)  # most lines span two or three chunks
    lines = [json.dumps({"i": i, "t": "x" * (i % 5)}) for i in range(50)]
    lines[10], lines[20] = "", "   "
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    recs = read_annotations(path)
    assert [r.data["i"] for r in recs] == [i for i in range(50) if i not in (10, 20)]
    assert [r.line for r in recs] == [i + 1 for i in range(50) if i not in (10, 20)]


def test_a_changed_file_is_indexed_again_and_an_unchanged_one_is_read_back(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    path.write_text('{"v": 1}\n{"v": 2}\n')
    assert [r.data["v"] for r in read_annotations(path)] == [1, 2]
    built = []
    real = index_mod._scan
    monkeypatch.setattr(index_mod, "_scan", lambda *a, **k: built.append(a) or real(*a, **k))
    assert len(read_annotations(path)) == 2 and not built  # warm: read back
    path.write_text('{"v": 3}\n{"v": 4}\n{"v": 5}\n')
    os.utime(path, ns=(1, 10 ** 18))  # and a new modification time
    assert [r.data["v"] for r in read_annotations(path)] == [3, 4, 5] and len(built) == 1
    assert sorted(p.name.split(".")[-1] for p in (tmp_path / ".ray_dhp_index").iterdir()) == [
        "idx", "lock"]  # written to a temporary name, renamed: nothing else left


def test_json_arrays_are_converted_once_and_keep_item_numbers(tmp_path):
    path = tmp_path / "b.json"
    items = [{"v": "\ud800 lone"}, 2, {"v": [1.5, None, "x\u2028y"]}, "s"]
    path.write_text(json.dumps(items))
    recs = read_annotations(path, index_dir=tmp_path / "ix")
    assert [(r.where, r.ok, r.data) for r in recs] == [
        (f"{path}[item 0]", True, items[0]), (f"{path}[item 1]", False, None),
        (f"{path}[item 2]", True, items[2]), (f"{path}[item 3]", False, None)]
    assert recs[1].error == "not an object: item is a int, not a JSON object"


def test_records_pickle_by_path_and_parse_on_demand(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(1000)))
    recs = read_annotations(path)
    blob = pickle.dumps(recs)
    assert len(blob) < 1000  # names and counts only, not the records
    again = pickle.loads(blob)
    assert again[999].data == {"i": 999} and again[-1] == recs[999] and again == recs


class _Shard:
    """Stand-in for a Ray Data ``DataIterator``: batches of rows as pyarrow tables."""

    def __init__(self, rows, batch=3):
        self.rows, self.batch, self.passes = rows, batch, 0

    def iter_batches(self, batch_size, batch_format):
        assert batch_format == "pyarrow"
        self.passes += 1
        for k in range(0, len(self.rows), self.batch):
            yield pa.Table.from_pylist(self.rows[k:k + self.batch])


def test_a_ray_dataset_is_spooled_once_per_run_with_its_rows_in_order(tmp_path):
    rows = [{"id": i, "image": None if i % 2 else f"{i}.png", "v": np.int64(i).item()}
            for i in range(10)]
    shard = _Shard(rows)
    ix = spool_dataset(shard, "train", tmp_path, key="run1")
    from ray_dhp.data.reading import Annotations

    recs = Annotations([ix])
    assert len(recs) == 10 and shard.passes == 1
    assert recs[3].data == {"id": 3, "v": 3}  # None columns dropped (a text-only sample)
    assert recs[4].data == {"id": 4, "image": "4.png", "v": 4} and recs[4].where == "ray.data:train[item 4]"
    again = spool_dataset(shard, "train", tmp_path, key="run1")  # a restart of the same run
    assert shard.passes == 1 and again.fingerprint == ix.fingerprint
    other = spool_dataset(_Shard(rows[::-1]), "train", tmp_path, key="run2")
    assert other.fingerprint[0] == 10 and other.fingerprint != ix.fingerprint  # the order counts


def test_spooling_a_value_that_is_not_json_names_the_type(tmp_path):
    class _Bad(_Shard):
        def iter_batches(self, batch_size, batch_format):
            yield pa.Table.from_pylist([{"b": b"raw"}])

    with pytest.raises(TypeError, match="bytes cannot be a LLaVA record field"):
        spool_dataset(_Bad([]), "train", tmp_path, key="r")
    assert not any(p.suffix in (".idx", ".jsonl") for p in tmp_path.iterdir())  # nothing half-written
    assert not list(tmp_path.glob("*.tmp*"))  # the failed write's partial file is gone too


def test_spools_go_when_the_run_ends_and_partial_writes_of_killed_writers_at_the_next_start(tmp_path):
    """`release_spools` (a successful end) deletes the run's spools and nothing else; a failed or
    killed run's complete spool stays (resumable: read back, no second pass); a killed writer's
    partial file goes at the next spool start unless its lock is held (being written)."""
    import fcntl
    from types import SimpleNamespace

    from ray_dhp.data.reading import Annotations
    from ray_dhp.data.spool import release_spools

    rows = [{"id": i} for i in range(5)]
    shard = _Shard(rows)
    done = spool_dataset(shard, "train", tmp_path, key="done")
    kept = spool_dataset(_Shard(rows), "train", tmp_path, key="failed")  # a run that failed
    dead = tmp_path / "train.killed.jsonl.tmp4242"  # a worker killed mid-write
    busy = tmp_path / "train.busy.jsonl.tmp4343"   # a write in progress
    dead.write_bytes(b'{"id": 0}\n')
    busy.write_bytes(b'{"id": 0}\n')
    with open(tmp_path / "train.busy.jsonl.idx.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        spool_dataset(shard, "train", tmp_path, key="done")  # the next start (here: a restart)
        assert not dead.exists() and busy.exists() and shard.passes == 1
    sampler = SimpleNamespace(records=SimpleNamespace(parts=[Annotations([done])]))
    gone = release_spools(sampler)
    assert set(gone) == {done.data_path, done.index_path, Path(f"{done.index_path}.lock")}
    assert not any(p.exists() for p in gone)
    assert kept.data_path.exists() and kept.index_path.exists()
    again = spool_dataset(_Shard([]), "train", tmp_path, key="failed")  # its resume reads it back
    assert again.fingerprint == kept.fingerprint and len(Annotations([again])) == 5


def test_ranks_that_spooled_different_rows_stop_with_the_fix(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch.distributed as dist

    from ray_dhp.data import spool
    from ray_dhp.data.reading import Annotations
    from ray_dhp.data.sampler import RunRecords

    rows = [{"id": i} for i in range(5)]
    mine = spool_dataset(_Shard(rows), "train", tmp_path, key="a")
    theirs = spool_dataset(_Shard(rows[::-1]), "train", tmp_path, key="b")  # another node's
    file_part = read_annotations(_write_lines(tmp_path / "f.jsonl"))
    sampler = SimpleNamespace(records=RunRecords([Annotations([mine]), file_part]))
    assert spool._fingerprints(sampler) == {"ray.data:train": mine.fingerprint}  # spools only
    others = {"same": mine.fingerprint, "different": theirs.fingerprint}

    def gather(parts, obj, group=None):
        parts[:] = [obj, {"ray.data:train": others[case]}]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    case = "same"
    spool.check_agreement(sampler)
    case = "different"
    with pytest.raises(ValueError, match="streamed differently on two nodes .* make the dataset "
                                         "deterministic"):
        spool.check_agreement(sampler)


def _write_lines(path):
    path.write_text('{"v": 1}\n')
    return path
