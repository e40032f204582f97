"""The package's import structure, read statically (every import statement, function-level
ones included): no import circle between modules, and the package in declared floors (`FLOORS`,
bottom to top) with no import going up a floor. Edges into a package's ``__init__`` are left out
of the circle check: importing ``ray_dhp.data.sampler`` runs ``ray_dhp/data/__init__.py`` by
Python's rules, which is not a design dependency; the floor check counts an import that names an
``__init__``'s own code (``from ray_dhp.models import family_of``). ``pytest -s`` prints the
floor table."""

import ast
from pathlib import Path

import pytest

import ray_dhp

PKG = Path(ray_dhp.__file__).parent


def _modules() -> dict:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        name = ".".join(("ray_dhp",) + p.relative_to(PKG).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _targets(node, name: str, is_pkg: bool, mods: dict) -> list:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        parts = name.split(".")[:len(name.split(".")) - node.level + (1 if is_pkg else 0)]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> dict:
    """``{module: modules it imports}`` within ray_dhp (package ``__init__`` targets left out)."""
    mods = _modules()
    edges = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for t in _targets(node, name, is_pkg, mods):
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and mods[t].name != "__init__.py":
                    edges[name].add(t)
    return edges


def cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (each a circle), sorted."""
    reach = {m: set() for m in edges}
    for m in edges:  # modules reachable from m (graphs of ~100 nodes: plain search is enough)
        todo = list(edges[m])
        while todo:
            n = todo.pop()
            if n not in reach[m]:
                reach[m].add(n)
                todo += edges[n]
    comps = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in edges}
    return sorted(sorted(c) for c in comps if len(c) > 1)


def test_cycle_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "ray_dhp.demo.omni" in graph["ray_dhp.demo.run"]  # the graph sees real imports
    assert cycles(graph) == []


# -- floors ----------------------------------------------------------------------------------
# The package in a declared order, bottom to top: a module imports only from its own floor or
# the floors below it (function-level imports count; edges to third-party packages do not).
FLOORS = (
    ("config", ("ray_dhp.config",)),          # plain dataclasses and their validation
    ("parallel", ("ray_dhp.parallel",)),      # topology, meshes, family-free mechanisms
    ("models", ("ray_dhp.models",)),          # each family's plan, loading, its parallel forward
    ("data", ("ray_dhp.data",)),              # reading, processing, sampling, loading
    ("step", ("ray_dhp.step",)),              # one training step: the engine and its parts
    ("planning", ("ray_dhp.planning",)),      # what a run costs before it starts
    ("checkpointing", ("ray_dhp.checkpointing",)),
    ("train", ("ray_dhp.train", "ray_dhp.layout")),  # Ray Train integration, DHPConfig
    ("entry", ("ray_dhp.cli", "ray_dhp.run_file", "ray_dhp.run_sections", "ray_dhp.tune",
               "ray_dhp.demo", "ray_dhp.__main__", "ray_dhp")),  # what a user runs or names
)


def floor_of(module: str, floors=FLOORS) -> int:
    """Index (0: bottom) of ``module``'s floor: the one naming it or a package above it (the root
    ``ray_dhp`` names only its ``__init__``); KeyError if none or several do."""
    found = {i for i, (_, prefixes) in enumerate(floors) for p in prefixes
             if module == p or ("." in p and module.startswith(p + "."))}
    if len(found) != 1:
        raise KeyError(f"{module} is on {len(found)} floors, not one: name it once in FLOORS")
    return found.pop()


def explicit_graph() -> dict:
    """`import_graph` plus the edges into a package ``__init__`` that an import names
    explicitly (``from ray_dhp.models import family_of``: ``models/__init__`` is code the
    importer uses; running a parent ``__init__`` by Python's rules is still left out)."""
    mods = _modules()
    edges = import_graph()
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[name] |= {t for t in _targets(node, name, is_pkg, mods)
                                if t in mods and t != name and mods[t].name == "__init__.py"}
            elif _imported_by_name(node) in set(mods) - {name}:
                edges[name].add(_imported_by_name(node))
    return edges


def _imported_by_name(node):
    """The module a call ``importlib.import_module("<literal>")`` names, else None."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    called = getattr(node.func, "attr", getattr(node.func, "id", None))
    return node.args[0].value if called == "import_module" else None


def upward_edges(edges: dict, floors=FLOORS) -> list:
    """``(module, target, module's floor, target's floor)`` of every import of a higher floor."""
    out = []
    for m in sorted(edges):
        for t in sorted(edges[m]):
            if floor_of(t, floors) > floor_of(m, floors):
                out.append((m, t, floors[floor_of(m, floors)][0], floors[floor_of(t, floors)][0]))
    return out


def floor_table(edges: dict, floors=FLOORS) -> str:
    rows = [f"{i}  {name:<14} {len([m for m in edges if floor_of(m, floors) == i]):>3} modules  "
            f"{' '.join(p.removeprefix('ray_dhp.') or 'ray_dhp' for p in prefixes)}"
            for i, (name, prefixes) in reversed(list(enumerate(floors)))]
    return "floors, top to bottom:\n" + "\n".join(rows)


def test_floor_check_sees_an_upward_import():
    floors = (("low", ("p.low",)), ("high", ("p.high", "p.top")))
    assert upward_edges({"p.low.a": {"p.low.b"}, "p.low.b": set(), "p.high.c": {"p.low.a"},
                         "p.top": {"p.high.c"}}, floors) == []
    assert upward_edges({"p.low.a": {"p.high.c"}, "p.high.c": set()}, floors) == \
        [("p.low.a", "p.high.c", "low", "high")]


def test_every_module_is_on_a_floor():
    for m in import_graph():
        floor_of(m)
    with pytest.raises(KeyError):
        floor_of("ray_dhp.new_root_module")  # a new root module is placed on purpose


def test_no_import_goes_up_a_floor():
    graph = explicit_graph()
    print("\n" + floor_table(graph))
    assert "ray_dhp.models" in graph["ray_dhp.step.microbatch"]  # explicit __init__ edges seen
    assert "ray_dhp.checkpointing.export" in graph["ray_dhp.cli"]  # and importlib.import_module
    assert "ray_dhp.step.microbatch" in graph["ray_dhp.train.custom_loop"]  # function-level ones
    up = upward_edges(graph)
    assert not up, f"{len(up)} import(s) go up a floor:\n" + "\n".join(
        f"  {m} -> {t}   ({a} -> {b})" for m, t, a, b in up)
