"""Mechanisms name no model family: `scripts/family_names.py` counts, in the code of
``ray_dhp/data parallel step planning checkpointing`` (comments and docstrings left out), the lines
that name a family and the comparisons against a module name (``== "vision"``); this keeps both
where they are. Family facts go to ``ray_dhp/models/`` (the family files, `FamilySpec`,
`ray_dhp.models.prompt_format.PromptFormat`), never into these allow-lists."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Family names still allowed in mechanism code, per file: the annotation *file format*'s name in
# user-facing messages ("records ... in the LLaVA format"): what users call the JSON layout of
# their data (docs/data.md), not a fact about a model.
FAMILY_ALLOWED = {"ray_dhp/data/bad_data.py": 2, "ray_dhp/data/spool.py": 1}

# Module-name comparisons in mechanism code: none (issue 40 item 2, modules as data; a rank
# hosts a module when the module's layout covers it, `ModuleLayout.hosts`).
BRANCH_ALLOWED: dict = {}


def _tool():
    spec = importlib.util.spec_from_file_location("family_names", ROOT / "scripts" / "family_names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_counter_sees_code_and_skips_comments_and_docstrings():
    tool = _tool()
    src = ('"""About Qwen-VL."""\n'
           'import os  # Qwen\n'
           'def f(name):\n'
           '    """InternVL\'s tower."""\n'
           '    x = "qwen2_5"\n'
           '    return name == "vision" or "audio" in (name,) or GemmaThing\n')
    assert [n for n, _ in tool.family_lines(src)] == [5, 6]
    assert [n for n, _ in tool.branch_lines(src)] == [6]


def test_mechanisms_name_no_family_beyond_the_allow_list():
    found = _tool().count(ROOT)
    family = {f: len(v["family"]) for f, v in found.items() if v["family"]}
    branch = {f: len(v["branch"]) for f, v in found.items() if v["branch"]}
    assert family == FAMILY_ALLOWED, {f: v["family"] for f, v in found.items() if v["family"]}
    assert branch == BRANCH_ALLOWED, {f: v["branch"] for f, v in found.items() if v["branch"]}
