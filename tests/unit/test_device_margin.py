"""Real headroom (issue #42): every verdict of `ray-dhp plan` and `--recommend` keeps the device
margin (CUDA context, communicator buffers, allocator fragmentation) free; a run file names the
accelerator it plans for; the margin is overridable, and bad values are refused naming the key."""

import re
from pathlib import Path

import pytest

from ray_dhp.cli import main
from ray_dhp.cli.plan import HEADROOM_RE, plan_text
from ray_dhp.planning.devices import ACCELERATORS, DEFAULT_GPU, budget_of
from ray_dhp.run_file import ConfigError, load_run_file

ROOT = Path(__file__).resolve().parents[2]
A3B = str(ROOT / "examples" / "qwen3_vl_30b_a3b_8gpu.yaml")
TINY = str(ROOT / "examples" / "tiny.yaml")


def test_the_device_table_documents_each_margin():
    h100, h200 = ACCELERATORS["h100"], ACCELERATORS["h200"]
    # context 0.5 + communicators 2 + NVLS 1 + 4% fragmentation (ray_dhp/planning/devices.py)
    assert h100.margin_gib == round(3.5 + 0.04 * 79.1, 1) == 6.7
    assert h200.margin_gib == 9.1 and ACCELERATORS["a100-80gb"].margin_gib == 5.7
    assert DEFAULT_GPU == "h100"
    from ray_dhp.planning.flops import PEAK_BF16

    assert dict(PEAK_BF16)["H200"] == 989e12 and PEAK_BF16[0][0] == "H200"  # before "H20"
    b = budget_of("h200", margin_gib=2.0)
    assert (b.memory_gib, b.margin_gib, b.usable_gib) == (139.8, 2.0, 137.8)


def _rows(text):
    return [ln for ln in text.splitlines() if " memory: state" in ln]


def test_fits_only_below_the_device_less_its_margin():
    """30B-A3B plans at ~79.3 GiB on its most loaded rank: below 80 GiB, above 80 - 6.7 (and
    above an H100's 79.1 - 6.7); [fits] only with the margin waived, and the headroom line says
    by how much."""
    rf = load_run_file(A3B)
    kw = dict(vision_tokens=[4096], text_tokens=512)
    h100 = plan_text(rf, device="h100", **kw)
    assert all(r.endswith("[EXCEEDS device less margin]") for r in _rows(h100)[:2])
    rank, peak, pct = re.search(HEADROOM_RE, h100).groups()
    assert 73.3 < float(peak) < 80 and float(pct) == round(100 * (72.4 - float(peak)) / 79.1, 1)
    at80 = plan_text(rf, device="h100", device_gib=80.0, **kw)  # the h100's margin rules: 6.7
    assert "device h100 (--device-gib) 80 GiB less a 6.7 GiB margin" in at80
    assert all(r.endswith("[EXCEEDS device less margin]") for r in _rows(at80)[:2])
    waived = plan_text(rf, device="h100", device_gib=80.0, margin_gib=0.0, **kw)
    assert all(r.endswith("[fits]") for r in _rows(waived))
    own = plan_text(rf, **kw)  # the file names h200
    assert "device h200 139.8 GiB less a 9.1 GiB margin" in own
    assert float(re.search(HEADROOM_RE, own).group(3)) >= 8.0


@pytest.mark.parametrize("overrides, key", [
    (["scaling.accelerator=h1000"], "scaling.accelerator"),
    (["scaling.device_margin_gib=-1"], "scaling.device_margin_gib"),
    (["scaling.device_margin_gib=80"], "scaling.device_margin_gib"),  # >= the h100's 79.1 GiB
    (["scaling.use_gpu=false"], "scaling.accelerator"),  # a GPU named for a CPU run
])
def test_run_file_keys_are_validated_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_run_file(A3B, ["scaling.accelerator=h100"] + overrides
                      if overrides[0].startswith("scaling.device") else overrides)


@pytest.mark.parametrize("flags, named", [
    (["--device", "h1000"], "--device"),
    (["--device", "h100", "--device-margin-gib", "90"], "--device-margin-gib"),
    (["--device-gib", "2"], "--device-gib"),  # the default margin leaves nothing of 2 GiB
])
def test_cli_flags_are_validated_naming_the_flag(flags, named, capsys):
    assert main(["plan", TINY, *flags]) == 2
    assert named in capsys.readouterr().err


def test_recommend_never_proposes_a_layout_above_the_device_less_its_margin():
    """The same workload on the same GPUs: with the margin the recommender drops what fits only
    into the margin, and none of the layouts it lists plans above memory - margin."""
    from ray_dhp.cli.plan import policy_of_run, settings_of
    from ray_dhp.models import load_model_config
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Layout, Workload, evaluate

    rf = load_run_file(A3B)
    config = load_model_config(rf.model_spec())
    counts, policy = count_params(config), policy_of_run(rf)
    lay = Layout("collocated", "sequential", 2, 4, 1, 8, text_ep=8)  # the example's layout
    w = dict(vision_tokens=4096, text_tokens=512, global_batch_size=32, micro_batches=4,
             settings=settings_of(rf, "flash"), policy=policy,
             state_bytes=float(policy.state_bytes()), device_gib=80.0)
    whole = evaluate(config, counts, lay, Workload(**w))
    kept = evaluate(config, counts, lay, Workload(**w, margin_gib=6.7))
    assert whole.feasible and 73.3 < whole.peak_memory_gib <= 80
    assert kept.reason.startswith("memory:") and "> 73.3 GiB (80 GiB less a 6.7 GiB margin)" \
        in kept.reason
