"""Model ids resolve through a (fake, local) Hugging Face cache, offline; an uncached id fails in
the driver with a message saying how to download it. No network: HF_HUB_OFFLINE is set."""

from __future__ import annotations

import os

import pytest

from ray_dhp import demo

REPO = "Qwen/Tiny-VL-Test"
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An HF_HUB_CACHE holding REPO in the standard layout (models--org--name, refs/main,
    snapshots/<rev>/) with a tiny Qwen2.5-VL (config, weights and processor: the driver checks
    them)."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    import transformers

    config = demo.tiny_model_config("qwen2_5_vl")
    transformers.Qwen2_5_VLForConditionalGeneration._from_config(config).save_pretrained(snap)
    demo.tiny_processor("qwen2_5_vl").save_pretrained(snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return str(snap)


def test_cached_id_resolves_to_its_snapshot(hub_cache):
    from ray_dhp.layout import DHPConfig
    from ray_dhp.models.hub import resolve_model_path

    assert resolve_model_path(REPO) == hub_cache
    cfg = DHPConfig(model=REPO, processor=REPO)
    assert cfg.model == hub_cache and cfg.processor == hub_cache
    assert cfg.model_config().model_type == "qwen2_5_vl"


def test_run_file_keeps_the_id_and_resolves_it(hub_cache):
    from ray_dhp.run_file import load_run_file

    rf = load_run_file(None, [f"model.path={REPO}", f"processor.path={REPO}", "model.demo=null"])
    assert rf.model.path == REPO  # not turned into <cwd>/Qwen/Tiny-VL-Test
    assert rf.model_spec() == hub_cache
    assert rf.processor_spec() == hub_cache


def test_a_local_directory_wins_over_the_cache(hub_cache, tmp_path):
    from ray_dhp.models.hub import resolve_model_path

    local = tmp_path / "Qwen" / "Tiny-VL-Test"
    local.mkdir(parents=True)
    assert resolve_model_path(REPO) == str(local)


def test_uncached_id_says_how_to_download(hub_cache):
    from ray_dhp.cli.schema import ConfigError
    from ray_dhp.layout import DHPConfig
    from ray_dhp.run_file import load_run_file

    with pytest.raises(ValueError) as e:
        DHPConfig(model="Qwen/Not-Cached")
    msg = str(e.value)
    assert "DHPConfig(model=...)" in msg and "hf download Qwen/Not-Cached" in msg
    assert os.environ["HF_HUB_CACHE"] in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ConfigError, match=r"(?s)model\.path=.Qwen/Not-Cached.*huggingface-cli download"):
        load_run_file(None, ["model.path=Qwen/Not-Cached"]).model_spec()


def test_neither_directory_nor_id(hub_cache):
    from ray_dhp.models.hub import resolve_model_path

    with pytest.raises(ValueError, match="not a local directory, and not a Hugging Face model id"):
        resolve_model_path("./no/such/dir/here")
