#!/usr/bin/env bash
# Create .venv (if missing) and install ray_dhp with the given extras, CPU torch first.
# Usage: source scripts/bootstrap.sh [extras]   (e.g. "test")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RAY_DHP_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.ray_dhp_installed${EXTRAS:+_$EXTRAS}"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.cfg" -nt "$STAMP" ]; then
  # torch first, pinned to the CPU wheel (a bare `torch` requirement would pull a CUDA build);
  # setup.cfg's range admits 2.13, so the next step keeps it.
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
