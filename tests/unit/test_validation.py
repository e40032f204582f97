"""One validation path: `plan`, `config` and `train` reject the same values, before Ray starts,
naming the run-file key; the Python API names the ``train_loop_config`` key."""

import math
import subprocess
from pathlib import Path

import pytest

from ray_dhp.config.checks import Check, ConfigError
from ray_dhp.cli import main
from ray_dhp.cli.render import markdown_reference
from ray_dhp.run_file import load_run_file
from ray_dhp.config.train_loop import TrainLoopConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")

BAD = [  # (override, message): numbers finite and in range, choices, cross-key rules
    ("optim.lr=.inf", "optim.lr: must be > 0, got inf"),
    ("optim.lr=.nan", "optim.lr: must be > 0, got nan"),
    ("optim.max_grad_norm=.inf", "optim.max_grad_norm: must be > 0, got inf"),
    ("placement.timeout_s=0", "placement.timeout_s: must be > 0, got 0"),
    ("scaling.resources_per_worker={CPU: -1}", "scaling.resources_per_worker: must be >= 0"),
    ("run.num_cpus=-2", "run.num_cpus: must be >= 1"),
    ("optim.betas=[0.9, 1.5]", "optim.betas: must be 2 numbers, each >= 0 and < 1"),
    ("optim.betas=[0.9]", "optim.betas: must be 2 numbers"),
    ("optim.eps=0", "optim.eps: must be > 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay: must be >= 0"),
    ("checkpoint.num_to_keep=0", "checkpoint.num_to_keep: must be >= 1"),
    ("checkpoint.checkpoint_every=-1", "checkpoint.checkpoint_every: must be >= 0"),
    ("data.max_tokens=0", "data.max_tokens: must be >= 1"),
    ("data.demo_samples=0", "data.demo_samples: must be >= 1"),
    ("optim.lr_schedule=exp", "optim.lr_schedule: must be one of constant, cosine, linear"),
    ("precision.policy=float16", "precision.policy: must be one of fp32, bf16_autocast"),
    ("optim.autocast_dtype=bfloat16", "optim.autocast_dtype"),
    ("data.bad_data=lenient", "data.bad_data: must be one of skip, strict"),
    ("optim.micro_batches=2|optim.micro_batch_tokens=100",
     "optim.micro_batch_tokens: set optim.micro_batches=1"),
    ("optim.micro_batches=3", "optim.global_batch_size=4 must be divisible by optim.micro_batches=3"),
    ("vision.tensor_parallel=2", "vision.tensor_parallel: unknown key; did you mean 'text.tensor_parallel'"),
    ("text.sequence_parallel=2", "text.sequence_parallel: expected bool, got 2"),
]


@pytest.mark.parametrize("override, message", BAD)
@pytest.mark.parametrize("command", ["plan", "config", "train"])
def test_every_command_rejects_the_same_values_naming_the_key(command, override, message, capsys,
                                                              forbid_ray_init, tmp_path):
    argv = [command, TINY, *override.split("|"), f"run.storage_path={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"ray-dhp {command}: configuration error: {message}" in err, err
    assert not forbid_ray_init and not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.parametrize("key, value, message", [
    ("lr", math.inf, "train_loop_config.lr: must be > 0, got inf"),
    ("max_grad_norm", math.inf, "train_loop_config.max_grad_norm: must be > 0"),
    ("betas", (0.9, 1.0), "train_loop_config.betas: must be 2 numbers, each >= 0 and < 1"),
    ("eps", -1e-8, "train_loop_config.eps: must be > 0"),
    ("lr_schedule", "exp", "train_loop_config.lr_schedule: must be one of"),
    ("lr", "fast", "train_loop_config.lr: expected float, got 'fast'"),
    ("micro_batch_tokens", 64, None),
])
def test_python_api_names_the_train_loop_config_key(key, value, message):
    if message is None:  # a valid value is coerced and kept
        assert TrainLoopConfig.from_dict({key: value}).optim.micro_batch_tokens == 64
        return
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        TrainLoopConfig.from_dict({key: value})
    assert TrainLoopConfig.from_dict({"lr": "3e-4"}).optim.lr == 3e-4  # coerced as in a run file


def test_python_api_takes_flat_keys_or_sections_and_names_them_as_written():
    """One tree (`TrainLoopConfig`): flat keys land in their section (`FLAT_KEYS`), sections are
    taken as given, and an error names the key the way it was written."""
    flat = TrainLoopConfig.from_dict({"lr": 3e-4, "packing": True, "video_fps": 1.0})
    nested = TrainLoopConfig.from_dict({"optim": {"lr": 3e-4}, "data": {"packing": True,
                                                                        "video": {"fps": 1.0}}})
    assert flat == nested and nested.optim.lr == 3e-4 and nested.data.video.fps == 1.0
    for given, message in [({"optim": {"lr": -1}}, "train_loop_config.optim.lr: must be > 0"),
                           ({"data": {"video": {"min_frames": 9, "max_frames": 8}}},
                            "train_loop_config.data.video.min_frames=9 > "
                            "train_loop_config.data.video.max_frames=8"),
                           ({"optim": {"lrr": 1}}, "train_loop_config.optim: unknown key 'lrr'; "
                                                   "did you mean 'lr'?")]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("?", r"\?")):
            TrainLoopConfig.from_dict(given)


def test_trainer_checks_train_loop_config_before_workers_start(forbid_ray_init):
    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo

    cfg = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    with pytest.raises(ValueError, match=r"train_loop_config\.micro_batch_tokens: set "
                                         r"train_loop_config\.micro_batches=1"):
        DisaggregatedTrainer(train_loop_config={"micro_batches": 2, "micro_batch_tokens": 99},
                             dhp_config=cfg, datasets={"train": str(Path(TINY))})
    with pytest.raises(ValueError, match=r"train_loop_config\.modules\.visoin: unknown module"):
        DisaggregatedTrainer(train_loop_config={"modules": {"visoin": {"train": False}}},
                             dhp_config=cfg, datasets={"train": str(Path(TINY))})
    sp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                   vision=ModuleParallel(sequence_parallel=2),
                   text=ModuleParallel(tensor_parallel=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"train_loop_config\.modules\.llm\.lora: LoRA adapters "
                                         r"are not covered with text sequence parallelism"):
        DisaggregatedTrainer(train_loop_config={"modules": {"llm": {"lora": {"r": 4}}}},
                             dhp_config=sp, datasets={"train": str(Path(TINY))})
    with pytest.raises(ValueError, match=r"DHPConfig\.timeout_s: must be > 0"):
        DHPConfig(model=demo.tiny_model_config(), timeout_s=0)
    assert not forbid_ray_init


def test_check_describes_and_rejects():
    assert Check(ge=0, lt=1, length=2).describe() == "2 numbers, each >= 0 and < 1"
    assert Check(gt=0).error(1e-3) is None and Check(gt=0).error(0) == "must be > 0, got 0"
    assert Check().error(math.inf) == "must be finite, got inf"  # numbers are finite anyway
    assert Check(ge=0).error({"CPU": 0.5, "GPU": 1}) is None
    assert Check(choices=("a", None)).error(None) is None


def test_reference_lists_only_settable_keys_with_what_they_accept():
    ref = markdown_reference()
    assert "`vision.tensor_parallel`" not in ref
    assert "| `text.sequence_parallel` | bool |" in ref  # on/off, not a degree
    assert "| `optim.lr` | float | > 0 |" in ref
    assert "| `optim.betas` | tuple | 2 numbers, each >= 0 and < 1 |" in ref
    eps_row = next(line for line in ref.splitlines() if line.startswith("| `optim.eps` |"))
    assert "moments" not in eps_row  # eps is not "AdamW moments" (the old description)


def test_plan_on_cpu_says_cpu_and_follows_max_tokens(capsys, forbid_ray_init):
    assert main(["plan", TINY, "data.max_tokens=300", "--vision-tokens", "64,4096",
                 "--text-tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert "flash" not in out and "80 GiB" not in out and "EXCEEDS" not in out
    assert "eager attention" in out and "CPU: no device limit" in out
    assert "samples of 1124 tokens (4096 // 4 + 100) exceed data.max_tokens=300" in out
    assert "vision tokens per sample = 64:\n  rank 0 memory:" in out  # 116 tokens: estimated


def test_config_prints_the_checked_run_file(capsys, forbid_ray_init):
    assert main(["config", TINY, "optim.lr=3e-4"]) == 0
    printed = capsys.readouterr().out
    assert "lr: 0.0003" in printed and "sequence_parallel: 2" in printed
    assert main(["config"]) == 2


def test_finished_run_is_refused_and_unfinished_resumed(monkeypatch, tmp_path, capsys, forbid_ray_init):
    import ray_dhp.cli.runs as runs

    rf = load_run_file(TINY, [f"run.storage_path={tmp_path}"])
    assert runs.check_run_folder(rf) is None  # no folder: a new run
    monkeypatch.setattr(runs, "checkpoint_step", lambda folder: 12)
    assert runs.check_run_folder(rf) == 12  # unfinished: resumed from step 12
    monkeypatch.setattr(runs, "checkpoint_step", lambda folder: 20)
    assert main(["train", TINY, f"run.storage_path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "run.name: the run 'tiny_demo' in" in err and "already finished" in err
    assert "give another run.name (e.g. run.name=tiny_demo_2)" in err
    assert "raise optim.num_steps above 20" in err and not forbid_ray_init


def test_bootstrap_keeps_the_callers_shell_options(tmp_path):
    import sys

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".ray_dhp_installed_test").touch()  # installed: nothing to do
    script = ROOT / "scripts" / "bootstrap.sh"
    body = (f'set +e +u; set +o pipefail; before="$-$(set -o | grep pipefail)"; '
            f'RAY_DHP_VENV={venv} source {script} test; rc=$?; '
            f'after="$-$(set -o | grep pipefail)"; echo "rc=$rc same=$([ "$before" = "$after" ] && echo yes)"; '
            f'echo "path=${{PATH%%:*}}"; false; echo alive; '
            f'RAY_DHP_VENV={tmp_path}/none PYTHON=/nonexistent source {script}; echo "failed rc=$?"; echo alive')
    p = subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=60)
    assert "rc=0 same=yes" in p.stdout and f"path={venv}/bin" in p.stdout, p.stdout + p.stderr
    assert "failed rc=1" in p.stdout and p.stdout.count("alive") == 2, p.stdout + p.stderr
    assert "installing into" in p.stderr
