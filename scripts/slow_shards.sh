#!/usr/bin/env bash
# The slow suite in shards (scripts/slow_shards.py): installs .venv with the test extras first.
#   bash scripts/slow_shards.sh --list | --run N | --run all | --status
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" "test"
exec python "$ROOT/scripts/slow_shards.py" "$@"
