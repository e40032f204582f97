"""The docs, followed in order, work: every command and snippet of the tested pages is run (or
checked, see `tests/docs/doc_blocks.py`) and the outputs they quote are compared.

Default suite: the blocks that need neither Ray nor training (``run``), per page, in order, with
their quoted outputs. ``-m slow``: every page whole, in order, including the trainings
(``run slow``); about 10 minutes on 2 shared cores (each ``ray-dhp train`` starts a local Ray).
"""

import pytest

from tests.docs.doc_blocks import ROOT, parse, run_page, untagged

PAGES = ["README.md", "docs/quickstart.md", "docs/use_your_model.md", "docs/custom_loop.md"]


@pytest.mark.parametrize("page", PAGES)
def test_every_command_block_says_how_it_is_tested(page):
    blocks = parse(ROOT / page)
    assert not untagged(blocks), f"add a <!-- doc-test: ... --> line above: {untagged(blocks)}"
    assert any(b.kind in ("run", "run slow") for b in blocks)


@pytest.mark.parametrize("page", PAGES)
def test_page_quick_blocks_run_in_order(page, tmp_path):
    assert run_page(ROOT / page, tmp_path, slow=False) or page == "docs/use_your_model.md"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_runs_in_order_with_trainings(page, tmp_path):
    done = run_page(ROOT / page, tmp_path, slow=True)
    assert done


def _layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section.split("```")[1]


def test_readme_layout_names_every_module_and_only_those():
    named, folder = set(), ""
    for line in _layout_block().splitlines():
        for token in line.split():
            if token == "ray_dhp/":
                folder = "ray_dhp"
            elif token.endswith("/") and folder.startswith("ray_dhp") and line.startswith(" "):
                folder = "ray_dhp/" + token.rstrip("/")
            elif token.endswith(".py") and folder:
                named.add(f"{folder}/{token}")
            elif token in ("tests/", "docs/"):
                folder = ""
    actual = {str(p.relative_to(ROOT)) for p in (ROOT / "ray_dhp").rglob("*.py")
              if not p.name.startswith("__")}
    assert not actual - named, f"README layout: add {sorted(actual - named)}"
    assert not named - actual, f"README layout: remove {sorted(named - actual)}"
    tests = {p.name + "/" for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name[0] != "_"}
    assert all(t in _layout_block() for t in tests), f"README layout: tests folders {tests}"
    assert "gpu/" not in _layout_block() or (ROOT / "tests" / "gpu").is_dir()


def test_quoted_outputs_are_compared_tolerantly_but_not_blindly():
    from tests.docs.doc_blocks import check_output

    printed = "[ray_dhp] done: loss 5.9310 (step 1) -> 3.7440 (step 20); results under /x/tiny_demo"
    check_output(["[ray_dhp] done: loss 5.93 (step 1) -> 3.74 (step 20); results under .../tiny_demo"],
                 printed, "here")
    for stale in ["loss 5.87 (step 1) -> 4.10 (step 20)",  # the quickstart's old quote
                  "loss 5.93 (step 1) -> 3.74 (step 4)", "results under .../tiny_lr"]:
        with pytest.raises(AssertionError, match="the page quotes"):
            check_output([stale], printed, "here")
    check_output(["lr 6.67e-04"], "lr 6.6667e-04", "here")
    with pytest.raises(AssertionError):
        check_output(["lr 6.67e-04"], "lr 2.00e-03", "here")
