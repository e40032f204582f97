"""The `ray-dhp` run file and CLI without a Ray cluster: strict keys, overrides, plan, docs."""

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from ray_dhp.cli import main
from ray_dhp.cli.render import defaults_yaml, markdown_reference
from ray_dhp.cli.schema import ConfigError, file_fields
from ray_dhp.run_file import RunFile, load_run_file
from ray_dhp.config.train_loop import FLAT_KEYS, TrainLoopConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
BIG = str(ROOT / "examples" / "qwen2_5_vl_32b_8gpu.yaml")


def test_printed_defaults_are_complete_and_load_back_to_the_defaults(tmp_path, capsys,
                                                                      forbid_ray_init):
    assert main(["config", "--print-defaults"]) == 0
    text = capsys.readouterr().out
    assert text == defaults_yaml()
    path = tmp_path / "defaults.yaml"
    path.write_text(text)
    assert load_run_file(str(path)) == RunFile()
    data = yaml.safe_load(text)
    for sec in fields(RunFile):  # every key of every section is printed
        keys = {f.name for f in file_fields(sec.metadata["section"])}
        if sec.metadata.get("optional"):  # absent by default (audio): its keys as comments
            assert data[sec.name] is None
            assert all(f"  # {k}: " in text for k in keys)
            continue
        assert set(data[sec.name]) == keys
    assert "# tiny random-init demo model" in text  # comments come from the help strings
    assert main(["plan", str(path)]) == 0
    assert not forbid_ray_init  # ray.init was never called


def test_every_loop_field_is_in_exactly_one_section():
    """The run file's loop sections are the loop's own dataclasses (or extend them), and the
    Python API's flat keys name every key of the tree exactly once."""
    file_sections = {sec.name: sec.metadata["section"] for sec in fields(RunFile)}
    for sec in fields(TrainLoopConfig):
        assert issubclass(file_sections[sec.name], sec.metadata["section"]), sec.name

    def paths(cls, prefix):
        for f in fields(cls):
            sub = f.metadata.get("section")
            yield from paths(sub, f"{prefix}{f.name}.") if sub else [f"{prefix}{f.name}"]

    tree = [p for sec in fields(TrainLoopConfig) for p in paths(sec.metadata["section"], f"{sec.name}.")]
    assert sorted(FLAT_KEYS.values()) == sorted(tree)
    assert RunFile().optim.lr == TrainLoopConfig().optim.lr  # defaults in one place, not repeated


def test_overrides_are_coerced_to_the_field_types():
    rf = load_run_file(TINY, ["optim.lr=3e-4", "vision.sequence_parallel=1",
                              "vision.data_parallel=2", "optim.max_grad_norm=null",
                              "scaling.resources_per_worker={CPU: 0.5}", "optim.betas=[0.8, 0.9]",
                              "run.name=123", "placement.schedule=sequential"])
    assert rf.optim.lr == 3e-4 and isinstance(rf.optim.lr, float)
    assert rf.vision.sequence_parallel == 1 and rf.vision.data_parallel == 2
    assert rf.optim.max_grad_norm is None and rf.optim.betas == (0.8, 0.9)
    assert rf.scaling.resources_per_worker == {"CPU": 0.5} and rf.run.name == "123"
    assert rf.placement.mode == "collocated"  # scalar shorthand in the file, key override on top
    assert rf.train_loop_config()["optim"]["lr"] == 3e-4
    assert load_run_file(TINY, ["placement=disjoint"]).dhp_config().num_workers == 4


@pytest.mark.parametrize("overrides, match", [
    (["optim.lrr=1e-3"], r"optim\.lrr: unknown key; did you mean 'optim\.lr'\?"),
    (["optm.lr=1e-3"], r"optm: unknown section; did you mean 'optim'\?"),
    (["optim.checkpoint_every=5"], r"did you mean 'checkpoint\.checkpoint_every'\?"),
    (["optim.lr=fast"], r"optim\.lr: expected float, got 'fast'"),
    (["vision.sequence_parallel=null"], r"vision\.sequence_parallel: null is not allowed"),
    (["optim.lr"], r"expected key=value"),
    (["vision.sequence_parallel=3", "vision.data_parallel=1", "text.tensor_parallel=1",
      "text.data_parallel=3"], r"sequence_parallel=3 must divide the vision attention heads"),
    (["vision.sequence_parallel=1"], r"products match"),
    (["scaling.num_workers=3"], r"scaling\.num_workers: .*set num_workers=2"),
    (["optim.lr_schedule=cosin"], r"optim\.lr_schedule: must be one of constant, cosine, linear"),
])
def test_mistakes_name_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        rf = load_run_file(TINY, overrides)
        rf.num_workers()
        rf.train_loop_config()


def test_unknown_yaml_key_reports_its_dotted_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {demo: qwen2_5_vl}\nvision:\n  sequence_paralel: 2\n")
    with pytest.raises(ConfigError, match=r"vision\.sequence_paralel: unknown key; did you mean "
                                          r"'vision\.sequence_parallel'\?"):
        load_run_file(str(path))


def test_plan_with_a_misspelt_key_fails_before_ray_starts(capsys, forbid_ray_init):
    assert main(["plan", TINY, "vision.sequence_paralel=2"]) == 2
    assert "did you mean 'vision.sequence_parallel'?" in capsys.readouterr().err
    assert not forbid_ray_init  # ray.init was never called


def test_python_dash_m_entry_point_exits_nonzero_on_a_typo(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(Path(TINY).read_text().replace("global_batch_size", "global_bath_size"))
    proc = subprocess.run([sys.executable, "-m", "ray_dhp", "plan", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "optim.global_bath_size: unknown key; did you mean 'optim.global_batch_size'?" in proc.stderr


def test_plan_32b_runs_without_ray_or_weights(capsys, forbid_ray_init):
    assert main(["plan", BIG, "--vision-tokens", "1024,65536"]) == 0
    out = capsys.readouterr().out
    assert not forbid_ray_init  # ray.init was never called
    assert "placement=collocated world_size=8" in out and "rank 7: vision(dp=0, sp=7)" in out
    # published Qwen2.5-VL-32B: ~33.5 B parameters, ~0.67 B of them in the ViT
    assert "vision 0.689 B, text 32.764 B" in out
    assert "rank 3 [vision+text]: vision 0.689 B + text 4.096 B params" in out
    assert sum(line.startswith("  rank ") and " memory: " in line for line in out.splitlines()) == 16
    assert "ZeRO-3 over 8 GPUs" in out


def test_model_presets_and_inline_dims_merge():
    rf = load_run_file(BIG, ["model.config={text_config: {num_hidden_layers: 2}}"])
    cfg = rf.model_spec()
    assert cfg.text_config.num_hidden_layers == 2 and cfg.text_config.hidden_size == 5120
    assert cfg.vision_config.fullatt_block_indexes == [7, 15, 23, 31]
    with pytest.raises(ConfigError, match="model.preset needs model.family"):
        load_run_file(None, ["model.preset=32b"]).model_spec()
    with pytest.raises(ConfigError, match="known: \\['32b', '72b', '7b'\\]"):
        load_run_file(None, ["model.family=qwen2_5_vl", "model.preset=33b"]).model_spec()


def test_configuration_reference_is_generated_from_the_dataclasses():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == markdown_reference(), (
        "docs/configuration.md is stale: run `python -m ray_dhp.cli docs > docs/configuration.md`")


def test_export_without_the_export_module_fails_clearly(monkeypatch, capsys, tmp_path):
    import ray_dhp.cli as cli

    monkeypatch.setattr(cli, "_export_fn", lambda: None)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 1
    assert "no ray_dhp.export_hf" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(cli, "_export_fn", lambda: lambda c, o, **kw: calls.append((c, o, kw)))
    assert main(["export", "c", "o"]) == 0
    assert calls == [("c", "o", {"dtype": None, "source": None, "overwrite": False, "lora": "merge"})]
    assert main(["export", "c", "o", "--overwrite"]) == 0 and calls[-1][2]["overwrite"] is True
    assert main(["export", "c", "o", "--dtype", "bfloat16"]) == 0
    assert calls[-1][2]["dtype"] == "bfloat16"
    assert main(["export", "c", "o", "--lora", "adapter"]) == 0 and calls[-1][2]["lora"] == "adapter"


def test_sweep_keys_are_checked_and_grids_expanded():
    from ray import tune

    from ray_dhp.tune import _check_keys, _grid_values, trial_run_file

    space = {"optim.lr": tune.grid_search([1e-4, 1e-3]),
             "vision": tune.grid_search([{"sequence_parallel": 2},
                                         {"sequence_parallel": 1, "data_parallel": 2}])}
    _check_keys(space)
    combos = _grid_values(space)
    assert len(combos) == 4
    base = load_run_file(TINY).to_dict()
    assert {trial_run_file(base, c).num_workers() for c in combos} == {2}
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        _check_keys({"optim.lrate": tune.grid_search([1])})


def test_examples_parse():
    for name in os.listdir(ROOT / "examples"):
        if name.endswith(".yaml") and name != "anyscale_job.yaml":
            load_run_file(str(ROOT / "examples" / name))


def test_run_file_mixes_named_datasets(tmp_path, monkeypatch, forbid_ray_init):
    from ray_dhp import demo
    from ray_dhp.cli.train import build_trainer, prepare_data

    demo.make_dataset(tmp_path / "coco", num_samples=2)
    demo.make_dataset(tmp_path / "ocr", num_samples=2)
    monkeypatch.chdir(tmp_path)  # relative paths are resolved when the file is loaded
    path = tmp_path / "mix.yaml"
    path.write_text("data:\n  train: coco/data.jsonl\n  datasets: {ocr: ocr/data.jsonl}\n"
                    "  dataset_weights: {train: 0.7, ocr: 0.3}\n")
    rf = load_run_file(str(path))
    datasets = prepare_data(rf)
    assert datasets == {"train": str(tmp_path / "coco" / "data.jsonl"),
                        "ocr": str(tmp_path / "ocr" / "data.jsonl")}
    assert rf.train_loop_config()["data"]["dataset_weights"] == {"train": 0.7, "ocr": 0.3}
    trainer = build_trainer(rf, datasets=datasets)
    assert trainer.train_loop_config["dataset_paths"] == datasets
    for overrides, match in [
        (["data.dataset_weights=null"], r"data\.datasets: \['ocr'\] need data\.dataset_weights"),
        (["data.dataset_weights={train: 1, vqa: 1}"],
         r"data\.dataset_weights: .*\['vqa'\] not in datasets=.*\['ocr', 'train'\]"),
        (["data.dataset_weights={train: 1, ocr: 0}"], "finite numbers > 0"),
        (["data.datasets.train=ocr/data.jsonl"], 'the dataset "train" is data.train'),
        (["data.datasets.ocr=nowhere.jsonl"], r"data\.datasets\.ocr: .*nowhere\.jsonl does not "),
    ]:
        with pytest.raises(ConfigError, match=match):
            prepare_data(load_run_file(str(path), overrides))
    assert not forbid_ray_init


def test_an_empty_inline_config_means_the_familys_defaults_not_the_demo():
    """``model: {family: llava, config: {}}`` is LLaVA at transformers' default dims, never the
    demo model an unset section falls back to (an empty mapping is a given config)."""
    from ray_dhp.run_file import run_file_from_dict

    spec = run_file_from_dict({"model": {"family": "llava", "config": {}}}).model_spec()
    assert spec.model_type == "llava"
    assert spec.get_text_config().hidden_size == 4096  # LlavaConfig's default Llama text config
    assert run_file_from_dict({}).model_spec().model_type == "qwen2_5_vl"  # the demo, unchanged


def test_each_entry_point_checks_a_run_once(tmp_path, monkeypatch, forbid_ray_init):
    """The run checks (`check_run`) and the layout-against-model check (`check_layout_fits`)
    run once per entry point: the run file checks as it is loaded and the trainer it builds
    trusts it; the Python API's trainer checks itself. The engine checks neither."""
    import ray_dhp.models.layout_fit as fit
    import ray_dhp.train.run_checks as checks
    from ray_dhp import DHPConfig, DisaggregatedTrainer, demo
    from ray_dhp.cli.train import build_trainer, prepare_data

    calls = {"run": 0, "layout": 0}

    def counted(key, f):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return f(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(checks, "check_run", counted("run", checks.check_run))
    monkeypatch.setattr(fit, "check_layout_fits", counted("layout", fit.check_layout_fits))
    rf = load_run_file("examples/tiny.yaml", [f"run.storage_path={tmp_path}"])
    assert calls == {"run": 1, "layout": 1}
    dhp = rf.dhp_config()  # the trainer's layout, built once more by `ray-dhp train`
    build_trainer(rf, datasets=prepare_data(rf), dhp=dhp)
    assert calls == {"run": 1, "layout": 2}
    path = demo.make_dataset(str(tmp_path / "d"), num_samples=2)
    DisaggregatedTrainer(dhp_config=DHPConfig(model=demo.tiny_model_config(),
                                              processor=demo.tiny_processor()),
                         datasets={"train": path},
                         train_loop_config={"global_batch_size": 1, "num_steps": 1})
    assert calls == {"run": 2, "layout": 3}
    assert not forbid_ray_init
