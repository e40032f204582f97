"""The GPU script's CPU dry run (benchmarks/gpu/run_gpu.py --device cpu --tiny): the same code
as on the lent GPU, on gloo with tiny shapes. Versions recorded, the precision check's measured
state equal to the plan under the collective device check, the step benchmark's times, tokens/s
and attention kernels per module, the packing step's two contenders (``--packing``: packed rows
no more padded than the padded groups, the same real tokens), JSON written and copied to ``$OUT``."""

from __future__ import annotations

import json


def test_gpu_script_dry_runs_on_cpu(tmp_path, monkeypatch):
    from benchmarks.gpu import run_gpu

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    report = run_gpu.main(["--device", "cpu", "--tiny", "--packing", "--out", str(tmp_path / "results")])
    v = report["versions"]
    assert v["torch"] and v["transformers"] and "ray" in v and "deepspeed" in v
    (prec,) = report["precision"]
    assert prec["policy"] == "bf16_mixed" and prec["checked_collectives"] > 0
    assert prec["measured"]["total"] == prec["plan"]["state"]
    assert prec["plan"]["step_peak_state"] >= prec["plan"]["state"]
    steps = report["steps"]["results"]
    assert [r["shape"] for r in steps] == ["demo-width", "7b-width(tiny)"]
    for r in steps:
        assert r["tokens_per_s"] > 0 and len(r["step_s"]) == 1 and all(x > 0 for x in r["losses"])
        for module in ("vision", "text"):  # an SDPA kernel ran in both modules (CPU: its CPU form)
            assert any("scaled_dot_product" in k for k in r["attention_kernels"][module]), r
        assert r["mfu"] is None  # no known peak on CPU
    (pack,) = report["packing"]
    assert pack["precision"] == "bf16_mixed" and set(pack["modes"]) == {"padded-groups", "packed"}, pack
    grouped, packed = pack["modes"]["padded-groups"], pack["modes"]["packed"]
    assert grouped["raw"]["real"] == packed["raw"]["real"]  # the same samples, step for step
    assert packed["padding_fraction"] <= grouped["padding_fraction"] and packed["tokens_per_s"] > 0
    names = sorted(p.name.split("-2")[0] for p in out.glob("*.json"))
    assert names == ["gpu-step-cpu-tiny", "packing-qwen2_5_vl-cpu-tiny", "precision-cpu-tiny"], names
    saved = json.loads(next(out.glob("gpu-step-*.json")).read_text())
    assert saved["versions"]["transformers"] == v["transformers"]
