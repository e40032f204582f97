"""The worked example of the pool planner (issue #45): Qwen2.5-VL-32B (published dims, no weights)
on one pool of 8 x H100 and on 8 x H100 + 8 x L40S (`examples/pools/`), planned by
``ray-dhp plan --recommend --pool``. ``python -m benchmarks.pool_example`` prints both reports and
the summary table; ``--write`` puts the reports into docs/placement.md and the table into
docs/cluster.md between their markers (``tests/unit/test_pool_example_docs.py`` checks that the
committed text is this output).

The run: ``examples/qwen2_5_vl_32b_8gpu.yaml`` with ``precision.policy=bf16`` (bf16 weights and
AdamW moments, 10 B/param: at the example's 16 B/param no layout of the 32B LM fits 80 GB
devices less their margin), a global batch of 16 in 4 micro-batches, 16384 vision + 512 text
tokens per sample (a large image: the vision tower's share of the step grows with it). Prices
are the pool files' assumptions (USD per device-hour), not quotes.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["examples/qwen2_5_vl_32b_8gpu.yaml", "precision.policy=bf16",
       "optim.global_batch_size=16", "optim.micro_batches=4"]
FLAGS = ["--vision-tokens", "16384", "--recommend"]
POOLS = {"8 x H100": "examples/pools/h100x8.yaml",
         "8 x H100 + 8 x L40S": "examples/pools/h100x8_l40sx8.yaml"}
PLACEMENT, CLUSTER = ROOT / "docs" / "placement.md", ROOT / "docs" / "cluster.md"
REPORT = "<!-- pool example {}: {} -->"
SUMMARY = ("<!-- pool summary: begin -->", "<!-- pool summary: end -->")
DEVICES = ("<!-- pool device table: begin -->", "<!-- pool device table: end -->")
ROW = re.compile(r"^\s+1\s+(?P<groups>.+?)\s+(?P<schedule>sequential|pipelined)\s+"
                 r"(?P<vision>sp\d+ x dp\d+)\s+(?P<text>tp\d+(?:\+sp)? x dp\d+)\s+(?P<zero>\S+)\s+"
                 r"(?P<step>[\d.]+)\s+(?P<tps>[\d,]+)\s+(?P<tpp>[\d,]+|-)\s+(?P<cpm>[\d.]+|-)")


def command(pool_file: str) -> list:
    return ["plan", *RUN, *FLAGS, "--pool", pool_file]


def report(pool_file: str) -> str:
    """What ``ray-dhp plan ... --pool pool_file`` prints."""
    from ray_dhp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(command(pool_file))
    return out.getvalue().rstrip()


def summary(reports: dict) -> str:
    """The #1 of each ranking of each report, as a Markdown table."""
    rows = ["| pools | ranked by | groups on pools (devices) | vision | text | step (s) | "
            "tokens/s | USD per million tokens |", "|---|---|---|---|---|---:|---:|---:|"]
    for name, text in reports.items():
        for title in ("best by tokens/s", "best by tokens per price unit"):
            part = text[text.index(title):].splitlines()[2]
            m = ROW.match(part)
            groups = m["groups"].replace(" | ", ", ")  # no table separator inside a cell
            rows.append(f"| {name} | {title[8:]} | {groups} | {m['vision']} | {m['text']} | "
                        f"{m['step']} | {m['tps']} | {m['cpm']} |")
    return "\n".join(rows)


def device_table() -> str:
    """The device table the pools draw on (`ray_dhp.planning.devices.ACCELERATORS`)."""
    from ray_dhp.planning.devices import ACCELERATORS

    rows = ["| accelerator | memory (GiB) | dense bf16 (TFLOP/s) | in a node (GB/s) | "
            "between nodes (GB/s) | HBM (TB/s) | default margin (GiB) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for a in ACCELERATORS.values():
        rows.append(f"| `{a.name}` | {a.memory_gib:g} | {a.peak_bf16 / 1e12:g} | {a.link_gbs:g} | "
                    f"{a.internode_gbs:g} | {a.hbm_tbs:g} | {a.margin_gib:g} |")
    return "\n".join(rows)


def _slug(name: str) -> str:
    return Path(POOLS[name]).stem


def _put(text: str, begin: str, end: str, body: str) -> str:
    return text[:text.index(begin) + len(begin)] + "\n" + body + "\n" + text[text.index(end):]


def _between(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) + len(begin):text.index(end)].strip()


def fenced(name: str, text: str) -> str:
    return f"```console\n$ ray-dhp {' '.join(command(POOLS[name]))}\n{text}\n```"


def committed() -> tuple:
    """({pools: the report block in docs/placement.md}, the summary table in docs/cluster.md,
    the device table in docs/placement.md)."""
    doc = PLACEMENT.read_text()
    blocks = {n: _between(doc, REPORT.format(_slug(n), "begin"), REPORT.format(_slug(n), "end"))
              for n in POOLS}
    return blocks, _between(CLUSTER.read_text(), *SUMMARY), _between(doc, *DEVICES)


def main(argv) -> None:
    reports = {name: report(path) for name, path in POOLS.items()}
    table = summary(reports)
    for name, text in reports.items():
        print(fenced(name, text), end="\n\n")
    print(table)
    if "--write" in argv:
        doc = _put(PLACEMENT.read_text(), *DEVICES, device_table())
        for name, text in reports.items():
            doc = _put(doc, REPORT.format(_slug(name), "begin"), REPORT.format(_slug(name), "end"),
                       fenced(name, text))
        PLACEMENT.write_text(doc)
        CLUSTER.write_text(_put(CLUSTER.read_text(), *SUMMARY, table))


if __name__ == "__main__":
    main(sys.argv[1:])
