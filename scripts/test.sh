#!/usr/bin/env bash
# The test suite: from a fresh clone, install ray_dhp[test] and run pytest (extra args go to pytest).
# pytest's exit code 5 ("no tests collected") is a failure here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" "test"
cd "$ROOT"
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
