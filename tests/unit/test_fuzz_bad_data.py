"""Fuzz: hostile records through the public data API (reader -> sampler / loader).

Skip mode: the run goes on, every hostile record is counted once as skipped with its
``file:line``, and valid records with odd characters (BOM, U+2028, U+0085, NUL, CRLF...) are
trained. Strict mode: each hostile record fails, naming its ``file:line``. Too much bad data
stops a skip-mode run with a summary (counts per reason, examples, likely fix).
"""

from __future__ import annotations

import json

import pytest

from ray_dhp import demo
from ray_dhp.data.loader import StepLoader
from ray_dhp.data.sample import BadSample
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.hostile_data import make_hostile_dataset


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return make_hostile_dataset(tmp_path_factory.mktemp("hostile"))


def _sampler(path, data_root=None, **cfg):
    cfg = {"global_batch_size": 8, "max_tokens": 2048, "max_bad_fraction": 0.5, **cfg}
    return StepSampler(read_annotations(path), demo.tiny_processor(),
                       resolve_data_root(path, data_root), TrainLoopConfig(**cfg).sampler_config())


@pytest.mark.parametrize("feed", ["sampler", "loader_with_a_decoding_process"])
def test_skip_mode_trains_through_every_hostile_record(hostile, feed):
    path, bad_at, odd_at = hostile
    sampler = _sampler(path)
    records = sampler.records
    assert len(records) == 40 + len(bad_at) + len(odd_at)  # U+2028/U+0085 split no record
    if feed == "sampler":
        next_step, progress = sampler.next_step, sampler
    else:
        loader = StepLoader(sampler, prefetch=True, num_workers=1)
        loader.start(12)
        next_step, progress = loader.next, loader
    trained = []
    while progress.epoch < 1:  # a whole pass: every record drawn at least once
        trained += [s.index for mb in next_step() for s in mb]
    if feed != "sampler":
        loader.close()
    assert progress.skipped == len(bad_at)
    assert {records[i].line for i in sampler.bad} == set(bad_at)  # each at its own line
    trained_lines = {records[i].line for i in trained}
    assert odd_at <= trained_lines and not trained_lines & set(bad_at)
    assert len(trained_lines) == len(records) - len(bad_at)  # every valid record was trained
    odd = [s for i in trained if records[i].line in odd_at for s in [records[i]]]
    assert any("\u2028" in t["value"] for r in odd for t in r.data["conversations"])
    assert sum(sampler.ledger.counts.values()) == len(bad_at)


def test_strict_mode_fails_each_hostile_record_with_its_file_and_line(hostile):
    path, bad_at, _ = hostile
    sampler = _sampler(path, bad_data="strict")
    for i, rec in enumerate(sampler.records):
        if rec.line not in bad_at:
            continue
        out = sampler.process(i)
        assert isinstance(out, BadSample), (bad_at[rec.line], out)
        with pytest.raises(ValueError, match=rf"bad sample at {path}:{rec.line}: "):
            sampler.note_bad(i, out)
    first_bad = min(bad_at)  # and a strict run stops at the first one it draws
    with pytest.raises(ValueError, match=rf"{path}:\d+: ") as err:
        for _ in range(20):
            sampler.next_step()
    assert int(str(err.value).split(f"{path}:")[1].split(":")[0]) in bad_at
    assert first_bad in bad_at


def test_a_wrong_data_root_stops_the_run_with_a_summary(tmp_path):
    path = demo.make_dataset(tmp_path / "d", num_samples=40, text_only_every=4)
    sampler = _sampler(path, data_root=tmp_path / "elsewhere", max_bad_fraction=0.25)
    with pytest.raises(ValueError, match="too much bad data") as err:
        for _ in range(20):
            sampler.next_step()
    msg = str(err.value)
    assert "of the 40 records drawn so far are bad" in msg and "missing image: 30" in msg
    assert f"{path}:" in msg  # first examples with their location
    assert "check data_root" in msg and str(tmp_path / "elsewhere") in msg


def test_not_enough_valid_samples_says_why(tmp_path):
    path = demo.make_dataset(tmp_path / "d", num_samples=6)
    sampler = _sampler(path, data_root=tmp_path / "elsewhere", max_bad_fraction=1.0)
    with pytest.raises(ValueError, match="not enough valid samples") as err:
        sampler.next_step()
    assert "6 of the 6 records drawn so far are bad" in str(err.value)
    assert "missing image: 6" in str(err.value) and "check data_root" in str(err.value)


def test_reader_format_by_extension_and_lines_split_at_newline_only(tmp_path):
    lines = tmp_path / "a.jsonl"  # first line starts with "[": still JSON lines
    lines.write_text('[1]\n{"v": "x\u2028y\u0085z"}\n{"v": 2}\n', encoding="utf-8")
    recs = read_annotations(lines)
    assert [(r.line, r.ok) for r in recs] == [(1, False), (2, True), (3, True)]
    assert recs[1].data["v"] == "x\u2028y\u0085z"
    array = tmp_path / "b.json"
    array.write_text(json.dumps([{"v": 1}, 2]), encoding="utf-8")
    assert [(r.where, r.ok) for r in read_annotations(array)] == [(f"{array}[item 0]", True),
                                                                  (f"{array}[item 1]", False)]
    broken = tmp_path / "c.json"
    broken.write_bytes(b'[\n{"v": 1},\n{"v": "\xff"}\n]')
    with pytest.raises(ValueError, match=rf"{broken}:3: not UTF-8"):
        read_annotations(broken)


def test_a_bad_sample_is_logged_once_by_the_rank_that_decoded_it(hostile, caplog):
    """Every rank counts each bad record (the budget is the same everywhere), but only the decoding
    rank logs it (``log=owner == rank`` in `StepLoader`), and a record bad again in a later epoch is
    not logged again."""
    path, bad_at, _ = hostile
    first = next(i for i, r in enumerate(_sampler(path).records) if r.line in bad_at)
    for owner_here in (False, True):
        sampler = _sampler(path)
        out = sampler.process(first)
        with caplog.at_level("WARNING", logger="ray_dhp.data.sampler"):
            caplog.clear()
            sampler.note_bad(first, out, log=owner_here)
            sampler.note_bad(first, out, log=owner_here)  # the same record drawn again
        assert sampler.bad == {first}  # counted once on every rank
        logged = [m for m in caplog.messages if "skipping bad sample" in m]
        assert len(logged) == (1 if owner_here else 0), logged
