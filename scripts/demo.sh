#!/usr/bin/env bash
# The main job: from a fresh clone, install and train the bundled tiny Qwen2.5-VL with DHP on CPU
# (vision Ulysses SP=2, text TP=2, collocated on 2 Ray workers). Extra args go to `python -m ray_dhp.demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" ""
cd "$ROOT"
exec python -m ray_dhp.demo "$@"
