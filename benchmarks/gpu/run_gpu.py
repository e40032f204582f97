"""The GPU script: one call on a lent machine (one H200, torch 2.11, no ray, no deepspeed, no
network; ``python3``), < 8 minutes. In order:

1. versions, and the transformers contract (`ray_dhp.models.contract`: the image's 5.17 lacks
   ``mm_encoder_outputs``; carry transformers 5.24 as a wheel, benchmarks/gpu/README.md);
2. `benchmarks.gpu.precision_check`: the engine on an NCCL-only group under ``bf16_mixed`` at the
   7B text width, every collective device-checked, measured bytes and CUDA peak vs `ray-dhp plan`;
3. `benchmarks.gpu.step_bench`: single-GPU step time, tokens/s and MFU of the demo-width and
   7B-width shapes under ``bf16_mixed``, and the attention kernels that ran in the ViT and the LLM;
4. only with ``--packing`` (issue #43's tokens/s on a GPU, ~3 min): `benchmarks.packing`'s
   plain padding, padded groups and packed rows on one GPU under ``bf16_mixed``, Qwen2.5-VL and
   Qwen3.5 at the demo width and the tiny-wide LM (`packing_runs`), written as
   ``packing-<family>[-wide]-<gpu>-<date>.json``;
5. only with ``--contenders`` (needs deepspeed for zero3; >= 2 GPUs for the comparisons): the
   contenders of `benchmarks.run`.

Results go to benchmarks/results/ and, when ``$OUT`` is set (the device tool), to ``$OUT`` too.
``--device cpu --tiny`` is the dry run of the same code (the default test suite runs it).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def contender_args(device: str, tiny: bool, gpus: int) -> list:
    if device == "cpu":
        return ["--ranks", "2", "--backend", "gloo", "--autocast", "bfloat16", "--contenders",
                "dhp,dhp-disjoint,tp,fsdp2,zero3", "--skip-ray", "--tiny",
                "--out", os.path.join(tempfile.gettempdir(), "dhp_gpu_dry_run")] \
            + ([] if tiny else ["--lengths", "256,1024"])
    ranks = max(1, gpus)
    contenders = "dhp,dhp-disjoint,tp,fsdp2,zero3" if ranks >= 2 else "dhp,tp,fsdp2,zero3"
    lengths = "1024,4096" if tiny else "1024,4096,8192,16384"
    return ["--ranks", str(ranks), "--backend", "nccl", "--autocast", "bfloat16", "--shape", "vitheavy-wide",
            "--lengths", lengths, "--steps", "5", "--warmup", "2", "--contenders", contenders,
            "--sp-length", "16384", "--skip-ray"]


def packing_runs(device: str, tiny: bool) -> list:
    """(family, LM shape, `benchmarks.packing.run` keywords) of the ``--packing`` step: on the GPU
    the CPU table's runs (`benchmarks/README.md`, issue #43) at one rank, ``bf16_mixed``, one
    round each; the dry run one tiny step of two contenders."""
    if tiny:
        small = dict(ranks=1, batch=4, max_tokens=2048, steps=1, warmup=1, num=8,
                     modes=("padded-groups", "packed"))
        return [("qwen2_5_vl", "demo", small)]
    full = dict(ranks=1, batch=16, max_tokens=2048, steps=4, warmup=1, num=200,
                modes=("padding", "padded-groups", "packed"))
    return [(f, t, full) for f in ("qwen2_5_vl", "qwen3_5") for t in ("demo", "wide")]


def run_packing(device: str, tiny: bool, out: str, tag: str) -> list:
    """The ``--packing`` step: each of `packing_runs`, its JSON under ``out``; a run that fails
    is reported and the others go on."""
    import json

    from benchmarks import packing

    done = []
    for family, text, kw in packing_runs(device, tiny):
        try:
            with tempfile.TemporaryDirectory() as d:
                res = packing.run(family, workdir=d, text=text, device=device, precision="bf16_mixed",
                                  timeout_s=300, **kw)
        except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
            print(f"[run_gpu] packing {family} {text}: {type(e).__name__}: {e}", flush=True)
            done.append({"family": family, "text": text, "error": f"{type(e).__name__}: {e}"})
            continue
        res["date"] = time.strftime("%Y-%m-%d")
        shape = "" if text == "demo" else f"-{text}"
        with open(os.path.join(out, f"packing-{family}{shape}-{tag}-{res['date']}.json"), "w") as f:
            json.dump(res, f, indent=1)
        done.append(res)
    return done


def check_versions() -> dict:
    """The versions in use; exits early (naming the fix) if transformers lacks the seam."""
    import transformers

    from benchmarks.gpu.step_bench import versions
    from ray_dhp.models import FAMILIES
    from ray_dhp.models.contract import TransformersContractError, check_transformers

    v = versions()
    print(f"[run_gpu] versions: {v}", flush=True)
    try:
        check_transformers(FAMILIES["qwen2_5_vl"])
    except TransformersContractError as e:
        sys.exit(f"[run_gpu] {e}\n[run_gpu] transformers is {transformers.__file__}: carry the "
                 "wheel as benchmarks/gpu/README.md says")
    return v


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; "
                   "the CPU dry run: a temporary folder)")
    p.add_argument("--contenders", action="store_true", help="also run benchmarks.run's contenders")
    p.add_argument("--packing", action="store_true", help="also run benchmarks.packing on one GPU")
    a, rest = p.parse_known_args(argv)
    t0 = time.perf_counter()
    gpus = 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("run_gpu: no CUDA device visible; use --device cpu --tiny for a dry run")
        gpus = torch.cuda.device_count()
    tiny = a.tiny or a.device == "cpu"
    out = a.out or (os.path.join(tempfile.gettempdir(), "dhp_gpu_dry_run") if a.device == "cpu"
                    else os.path.join(REPO, "benchmarks", "results"))
    report = {"versions": check_versions()}
    from benchmarks.gpu import precision_check, step_bench

    small = ["--tiny", "--patches", "64", "--batch", "1"] if tiny else []
    report["precision"] = precision_check.main(["--device", a.device, "--out", out] + small)
    report["steps"] = step_bench.main(["--device", a.device, "--out", out]
                                      + (["--tiny", "--steps", "1"] if tiny else []))
    if a.packing:
        os.makedirs(out, exist_ok=True)
        tag = "cpu-tiny" if a.device == "cpu" else report["versions"]["device"].replace(" ", "_")
        report["packing"] = run_packing(a.device, tiny, out, tag)
    if a.contenders:
        from benchmarks import run

        report["contenders"] = run.main(contender_args(a.device, tiny, gpus) + rest)
    if os.environ.get("OUT"):  # the device tool brings $OUT back
        for path in glob.glob(os.path.join(out, "*-" + time.strftime("%Y-%m-%d") + ".json")):
            shutil.copy(path, os.environ["OUT"])
    report["wall_s"] = time.perf_counter() - t0
    print(f"[run_gpu] done in {report['wall_s']:.0f} s; results in {out}", flush=True)
    return report


if __name__ == "__main__":
    main()
