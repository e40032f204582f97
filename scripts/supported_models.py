"""Regenerate the generated table of docs/supported_models.md from the installed transformers
(`ray_dhp.models.survey`) and the generic families the parity tests verify
(`tests.distributed.parity.GENERIC_FAMILIES`).

    python scripts/supported_models.py          # rewrite the block between the markers
    python scripts/supported_models.py --check  # exit 1 if the file is not current
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "supported_models.md"
BEGIN, END = "<!-- survey:begin -->", "<!-- survey:end -->"
VERIFIED = ("fp64 exact: collocated vision {vision} + text TP2{text_sp}, disjoint 1 + TP2, text ZeRO-3 DP2 "
            "(`tests/distributed/test_families.py`); `DisaggregatedTrainer` "
            "(`tests/ray/test_generic_trainer.py`) and `ray-dhp train RUN.yaml` with `model.demo` "
            "(fp32, `tests/ray/test_cli_families.py`)")
EXPERTS = ("; expert parallelism EP2 collocated DP2 and disjoint 1 + DP2, experts TP-sharded, "
           "the router loss incl. (`tests/distributed/test_families.py`)")


def generated() -> str:
    sys.path.insert(0, str(ROOT))
    from ray_dhp.models.survey import markdown, survey
    from tests.distributed.family_rows import GENERIC_NO_TEXT_SP
    from tests.distributed.generic_cases import VISION_SP
    from tests.distributed.parity import GENERIC_FAMILIES, GENERIC_MOE_FAMILIES

    return markdown(survey(), {f: VERIFIED.format(
        vision="SP2" if f in VISION_SP else "DP2",
        text_sp="" if f in GENERIC_NO_TEXT_SP else " (and with text SP)")
                               + (EXPERTS if f in GENERIC_MOE_FAMILIES else "")
                               for f in GENERIC_FAMILIES})


def updated(text: str, block: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def main(argv) -> int:
    text = DOC.read_text()
    new = updated(text, generated())
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is not current: run python scripts/supported_models.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
