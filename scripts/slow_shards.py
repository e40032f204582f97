"""The slow suite (``pytest -m slow``) in shards that each fit well within an hour on a 2-core
machine, and a record of which shard passed on which commit.

    python scripts/slow_shards.py --list            # the shards and their test counts
    python scripts/slow_shards.py --run 3           # run shard 3 (extra args after -- go to pytest)
    python scripts/slow_shards.py --run all         # every shard, one after the other
    python scripts/slow_shards.py --status          # the record: shard, commit, result, seconds

Shards are cut from the collected slow cases, grouped by file in a fixed order, at most
``SHARD_CASES`` cases or ``SHARD_WEIGHT`` weight units each (a Ray end-to-end case weighs 4, a
distributed one 2, a unit or docs one 1: measured per-case times of the three kinds on this
class of machine are ~60-120 s, ~20-40 s and ~5-30 s). The record is
``tests/slow_shards.json`` (committed: it says which shards are green on which commit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "slow_shards.json")
SHARD_WEIGHT = 90  # ~45 min at the weights above
SHARD_CASES = 40


def _weight(nodeid: str) -> int:
    return 4 if nodeid.startswith("tests/ray/") else 2 if nodeid.startswith("tests/distributed/") else 1


def slow_cases() -> list:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", "slow"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def shards(cases: list) -> list:
    """Consecutive runs of cases (files kept together where they fit) under both limits."""
    out, cur, weight = [], [], 0
    for case in sorted(cases, key=lambda c: (c.split("::")[0], cases.index(c))):
        w = _weight(case)
        if cur and (weight + w > SHARD_WEIGHT or len(cur) >= SHARD_CASES):
            out.append(cur)
            cur, weight = [], 0
        cur.append(case)
        weight += w
    return out + ([cur] if cur else [])


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!tests/slow_shards.json"],  # the record itself is not the code
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def _record(index: int, result: dict) -> None:
    data = json.load(open(RECORD)) if os.path.exists(RECORD) else {}
    data[str(index)] = result
    with open(RECORD + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(RECORD + ".tmp", RECORD)


def run_shard(index: int, cases: list, extra: list) -> int:
    t0 = time.time()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-m", "slow", *extra, *cases], cwd=ROOT)
    _record(index, {"commit": _commit(), "passed": rc == 0, "exit_code": rc,
                    "cases": len(cases), "seconds": round(time.time() - t0),
                    "first": cases[0], "last": cases[-1],
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true")
    p.add_argument("--status", action="store_true")
    p.add_argument("--run", default=None, help="a shard number, or 'all'")
    p.add_argument("pytest_args", nargs="*")
    a = p.parse_args(argv)
    if a.status:
        data = json.load(open(RECORD)) if os.path.exists(RECORD) else {}
        for k in sorted(data, key=int):
            r = data[k]
            print(f"shard {k}: {'passed' if r['passed'] else 'FAILED'} on {r['commit']} "
                  f"({r['cases']} cases, {r['seconds']} s, {r['date']})")
        return 0
    parts = shards(slow_cases())
    if a.list or a.run is None:
        for i, part in enumerate(parts, 1):
            files = sorted({c.split("::")[0] for c in part})
            print(f"shard {i}: {len(part)} cases, weight {sum(map(_weight, part))}: "
                  f"{', '.join(f.removeprefix('tests/') for f in files)}")
        return 0
    todo = range(1, len(parts) + 1) if a.run == "all" else [int(a.run)]
    rcs = [run_shard(i, parts[i - 1], a.pytest_args) for i in todo]
    return max(rcs, default=0)


if __name__ == "__main__":
    sys.exit(main())
