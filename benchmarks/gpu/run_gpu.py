"""The GPU benchmark: the same sections as ``benchmarks.run``, sized for one lent machine.

On CUDA: NCCL, one rank per GPU (a single GPU gives a 1-rank run: every contender degenerates
to its unsharded form, which still measures the implementations' overheads, CUDA peak memory
and the memory model in bf16; the comparisons need >= 2 GPUs), the 4x wider ``vitheavy-wide``
shape, bf16 autocast, lengths up to 16k patches per image. It first runs
`benchmarks.gpu.precision_check` (the engine on an NCCL-only group under the bf16_mixed policy at
the 7B text width: CUDA peak memory vs `ray-dhp plan`). ``--device cpu --tiny`` dry-runs the
same code paths on gloo into a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def args_for(device: str, tiny: bool, gpus: int) -> list:
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--skip-precision", action="store_true", help="skip the first part: the "
                   "engine on NCCL with the bf16_mixed policy at the 7B text width "
                   "(benchmarks/gpu/precision_check.py)")
    p.add_argument("--only-precision", action="store_true", help="run the first part only")
    a, rest = p.parse_known_args(argv)
    gpus = 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("run_gpu: no CUDA device visible; use --device cpu --tiny for a dry run")
        gpus = torch.cuda.device_count()
    if not a.skip_precision:  # first: NCCL-only group, real width, peak memory vs the plan
        from benchmarks.gpu import precision_check

        pargs = ["--device", a.device] + (["--tiny"] if a.tiny or a.device == "cpu" else [])
        if a.device == "cpu":
            pargs += ["--out", os.path.join(tempfile.gettempdir(), "dhp_gpu_dry_run")]
        precision_check.main(pargs)
        if a.only_precision:
            return None
    from benchmarks import run

    return run.main(args_for(a.device, a.tiny, gpus) + rest)


if __name__ == "__main__":
    main()
