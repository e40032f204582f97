"""No test file imports another test file: what several test files share lives in a helper
module (`tests/distributed/parity.py`, `checkpoint_cases.py`, ...; `tests/README.md`). Importing
a test module runs its module-level setup a second time under another name, ties one test file's
edits to another's tests, and a ``test_*`` function imported into a module is collected twice.

Read statically with `ast`: every ``import`` / ``from ... import`` in every file under ``tests/``
(the helpers and conftests too, function-level imports included, relative ones resolved) and every
``importlib.import_module("<literal>")``; a target is a test module when one of its dotted parts
(or a name imported from it) starts with ``test_``."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# (file, module) pairs let through: none (test_nccl_twin.py's import of test_parity, left while
# the twin work was open, now comes from parity.py)
ALLOWED: set = set()


def _is_test(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def imports_of_test_modules(source: str, module: str) -> list:
    """``(line, target)``, by line, for every import of a test module in ``source`` (the text of
    the module named ``module``, e.g. ``tests.unit.test_x``)."""
    package = module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _is_test(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            if _is_test(base):
                out.append((node.lineno, base))
            else:
                out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name.startswith("test_")]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and _is_test(node.args[0].value)):
            out.append((node.lineno, node.args[0].value))
    return sorted(out)


def test_the_detector_catches_every_form():
    """Every form of importing a test module is caught; helper imports are let through."""
    source = "\n".join([
        "from tests.distributed.test_parity import CFG",        # 1: absolute
        "import tests.unit.test_packing",                        # 2: plain import
        "from tests.distributed import test_checkpoint as ck",   # 3: the module as a name
        "def f():",
        "    from tests.ray.test_tracking import read_scalars",  # 5: inside a function
        "from .test_zero import TOL",                            # 6: relative
        "from . import test_ulysses",                            # 7: relative, the module as a name
        "from tests.distributed.parity import test_case",        # 8: a test function (collected twice)
        "importlib.import_module('tests.unit.test_video')",      # 9: by name
        "from tests.distributed.parity import CFG",              # helpers: allowed
        "from . import checkpoint_cases",
        "import tests.spawn",
    ])
    got = imports_of_test_modules(source, "tests.distributed.test_x")
    assert got == [(1, "tests.distributed.test_parity"), (2, "tests.unit.test_packing"),
                   (3, "tests.distributed.test_checkpoint"), (5, "tests.ray.test_tracking"),
                   (6, "tests.distributed.test_zero"), (7, "tests.distributed.test_ulysses"),
                   (8, "tests.distributed.parity.test_case"), (9, "tests.unit.test_video")], got


def test_no_test_file_imports_another_test_file():
    files = sorted(TESTS.rglob("*.py"))
    assert len([p for p in files if p.name.startswith("test_")]) > 100  # the real tree was read
    found = []
    for path in files:
        rel = path.relative_to(TESTS).as_posix()
        module = ".".join(("tests",) + path.relative_to(TESTS).with_suffix("").parts)
        for line, target in imports_of_test_modules(path.read_text(), module):
            if (rel, target) not in ALLOWED:
                found.append(f"tests/{rel}:{line}: imports {target}")
    assert not found, ("a test file imports another test file; move what it needs into a helper "
                       "module of the folder (tests/README.md):\n" + "\n".join(found))
