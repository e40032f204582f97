"""Count model-family names and module-name branches in the *code* of the mechanism packages.

Mechanisms (``ray_dhp/data parallel step planning checkpointing``) are meant to name no model
family: family facts live in ``ray_dhp/models/``. This counts, per directory and per file, the
code lines (comments and docstrings left out; identifiers, string literals and imports counted)
that name a family, and the comparisons that branch on a module's name (``name == "vision"``,
``"audio" in (...)``)::

    python scripts/family_names.py            # the table
    python scripts/family_names.py --lines    # and every counted line

``tests/unit/test_family_names.py`` keeps the counts where they are.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MECHANISMS = ("data", "parallel", "step", "planning", "checkpointing")
FAMILY = re.compile(
    r"qwen|internvl|internvit|intern_vit|omni|gemma|llava|glm|deltanet|idefics|smolvlm|mistral"
    r"|llama|pixtral|siglip|whisper|kimi|minicpm", re.IGNORECASE)
MODULE_NAMES = ("vision", "audio")


def _docstring_lines(tree: ast.AST) -> set:
    """Line numbers covered by docstrings (a string that is a whole statement)."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out.update(range(node.lineno, node.end_lineno + 1))
    return out


def family_lines(source: str) -> list:
    """``(line number, line)`` of each code line naming a family (comments/docstrings skipped)."""
    docs = _docstring_lines(ast.parse(source))
    hits = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
            continue
        if tok.type == tokenize.STRING and tok.start[0] in docs:
            continue
        if FAMILY.search(tok.string):
            hits.add(tok.start[0])
    lines = source.splitlines()
    return [(n, lines[n - 1].strip()) for n in sorted(hits)]


def branch_lines(source: str) -> list:
    """``(line number, line)`` of each comparison against a module name ("vision"/"audio")."""
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op in operands:
                elts = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
                if any(isinstance(e, ast.Constant) and e.value in MODULE_NAMES for e in elts):
                    hits.add(node.lineno)
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            if node.value.value in MODULE_NAMES:
                hits.add(node.lineno)
    lines = source.splitlines()
    return [(n, lines[n - 1].strip()) for n in sorted(hits)]


def count(root: Path = ROOT) -> dict:
    """``{relative file: {"family": [...], "branch": [...]}}`` for files with any hit."""
    out = {}
    for d in MECHANISMS:
        for p in sorted((root / "ray_dhp" / d).rglob("*.py")):
            src = p.read_text()
            fam, br = family_lines(src), branch_lines(src)
            if fam or br:
                out[p.relative_to(root).as_posix()] = {"family": fam, "branch": br}
    return out


def main(argv: list) -> int:
    found = count()
    show = "--lines" in argv
    print(f"{'file':50} {'family':>7} {'branch':>7}")
    for d in MECHANISMS:
        files = {f: v for f, v in found.items() if f.startswith(f"ray_dhp/{d}/")}
        fam = sum(len(v["family"]) for v in files.values())
        br = sum(len(v["branch"]) for v in files.values())
        print(f"{'ray_dhp/' + d + '/':50} {fam:7d} {br:7d}")
        for f, v in files.items():
            print(f"  {f:48} {len(v['family']):7d} {len(v['branch']):7d}")
            if show:
                for n, line in v["family"] + v["branch"]:
                    print(f"      {n:4d}: {line}")
    total_f = sum(len(v["family"]) for v in found.values())
    total_b = sum(len(v["branch"]) for v in found.values())
    print(f"{'total':50} {total_f:7d} {total_b:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
