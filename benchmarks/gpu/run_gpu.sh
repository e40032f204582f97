#!/usr/bin/env bash
# The GPU script in one call (benchmarks/gpu/run_gpu.py; the exact device command is in
# benchmarks/gpu/README.md). Needs python3 with CUDA torch (>= 2.11) and transformers >= 5.18;
# nothing else (no ray, no deepspeed, no network). PYTHON=... picks another interpreter.
#
#   bash benchmarks/gpu/run_gpu.sh                       # on the GPU machine (< 8 min)
#   bash benchmarks/gpu/run_gpu.sh --device cpu --tiny   # CPU dry run of the same script
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
"$PY" -c "import torch, transformers" || {
  echo "run_gpu.sh: $PY lacks torch or transformers" >&2
  exit 2
}
exec "$PY" -m benchmarks.gpu.run_gpu "$@"
