"""The package has no import circle: the module graph of ``ray_dhp`` (every import statement,
function-level ones included, read statically) has no cycle. Edges into a package's
``__init__`` are left out: importing ``ray_dhp.data.sampler`` runs ``ray_dhp/data/__init__.py``
by Python's rules, which is not a design dependency."""

import ast
from pathlib import Path

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
    assert "ray_dhp.demo" in graph["ray_dhp.run_demo"]  # the graph sees real imports
    assert cycles(graph) == []
