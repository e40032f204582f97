"""`ray-dhp plan` on every run file in ``examples/``: the device each plans for, the most loaded
rank's planned peak, the device margin and the headroom left (percent of the device's memory
free after the margin), and the planner's device table. ``python -m benchmarks.plan_headroom``
prints both tables; ``--write`` puts them into docs/plan_accuracy.md between their markers
(``tests/unit/test_examples_headroom.py`` checks that the committed tables are this output and
that every GPU example keeps at least `MIN_HEADROOM`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plan_accuracy.md"
BEGIN, END = "<!-- headroom table: begin -->", "<!-- headroom table: end -->"
DEVICES_BEGIN, DEVICES_END = "<!-- device table: begin -->", "<!-- device table: end -->"
MIN_HEADROOM = 0.08  # of the device's memory, after the margin (issue #42)
NOT_RUN_FILES = ("anyscale_job.yaml",)  # an Anyscale job spec, not a ray-dhp run file


def examples() -> list:
    return sorted(p.name for p in (ROOT / "examples").glob("*.yaml") if p.name not in NOT_RUN_FILES)


def example_row(name: str) -> dict:
    """What ``ray-dhp plan examples/<name>`` (no flags: 4096 vision + 512 text tokens per
    sample) says: device, memory, margin, peak (most loaded rank), headroom."""
    from ray_dhp.cli.plan import HEADROOM_RE, budget_of_run, plan_text
    from ray_dhp.run_file import load_run_file

    rf = load_run_file(str(ROOT / "examples" / name))
    text = plan_text(rf, vision_tokens=[4096], text_tokens=512)
    budget = budget_of_run(rf)
    if budget is None:
        return {"example": name, "device": "CPU (no limit)"}
    rank, peak, pct = re.search(HEADROOM_RE, text).groups()
    return {"example": name, "device": budget.name, "memory": budget.memory_gib,
            "margin": budget.margin_gib, "rank": int(rank), "peak": float(peak),
            "headroom": float(pct)}


def table(rows: list) -> str:
    out = ["| example | device | memory (GiB) | margin (GiB) | planned peak (GiB, rank) | "
           "headroom after the margin |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "memory" not in r:
            out.append(f"| `{r['example']}` | {r['device']} | | | | |")
            continue
        out.append(f"| `{r['example']}` | {r['device']} | {r['memory']:g} | {r['margin']:g} | "
                   f"{r['peak']:.2f} (rank {r['rank']}) | {r['headroom']:.1f}% |")
    return "\n".join(out)


def device_table() -> str:
    """The planner's device table (`ray_dhp.planning.devices.ACCELERATORS`) with each margin."""
    from ray_dhp.planning.devices import ACCELERATORS, COMM_GIB, CONTEXT_GIB, FRAGMENTATION, NVLS_GIB

    out = ["| accelerator (`scaling.accelerator`) | CUDA name contains | memory (GiB) | NVLS | "
           f"margin (GiB) = {CONTEXT_GIB:g} + {COMM_GIB:g} (+ {NVLS_GIB:g} NVLS) + "
           f"{FRAGMENTATION:.0%} of memory |", "|---|---|---:|---|---:|"]
    for a in ACCELERATORS.values():
        out.append(f"| `{a.name}` | {a.match} | {a.memory_gib:g} | {'yes' if a.nvls else 'no'} | "
                   f"{a.margin_gib:g} |")
    return "\n".join(out)


def _between(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) + len(begin):text.index(end)].strip()


def committed_tables() -> tuple:
    """(device table, headroom table) as docs/plan_accuracy.md has them."""
    text = DOC.read_text()
    return _between(text, DEVICES_BEGIN, DEVICES_END), _between(text, BEGIN, END)


def _put(text: str, begin: str, end: str, body: str) -> str:
    return text[:text.index(begin) + len(begin)] + "\n" + body + "\n" + text[text.index(end):]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    devices, t = device_table(), table([example_row(n) for n in examples()])
    if "--write" in argv:
        DOC.write_text(_put(_put(DOC.read_text(), DEVICES_BEGIN, DEVICES_END, devices), BEGIN, END, t))
    print(devices + "\n\n" + t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
