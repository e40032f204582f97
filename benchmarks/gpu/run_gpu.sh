#!/usr/bin/env bash
# One prepared benchmark run for a lent GPU machine. First benchmarks/gpu/precision_check.py (the
# engine on an NCCL-only group, bf16_mixed at the 7B text width, CUDA peak vs ray-dhp plan), then
# the contenders (NCCL, bf16 autocast); results in the same
# format under benchmarks/results/ (<shape>-<gpu>x<N>-<date>.json + PNGs).
#
#   bash benchmarks/gpu/run_gpu.sh                       # on the GPU machine (~3-5 min)
#   bash benchmarks/gpu/run_gpu.sh --device cpu --tiny   # CPU dry run of the same script
#
# Needs a Python with CUDA torch, transformers, deepspeed, matplotlib, psutil (PYTHON=... to pick
# one; default: .venv/bin/python if present, else python). Other arguments go to run_gpu.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
"$PY" -c "import torch, transformers, deepspeed, matplotlib, psutil" || {
  echo "run_gpu.sh: $PY lacks torch/transformers/deepspeed/matplotlib/psutil; pip install -e '.[benchmarks]'" >&2
  exit 2
}
exec "$PY" -m benchmarks.gpu.run_gpu "$@"
