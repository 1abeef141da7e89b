"""Imports point down the layers, and no package imports back through another (issue 27).

Every ``import`` in ``parsers/`` and ``sidecar/`` is read with :mod:`ast`, those inside functions
included, and placed in its unit: ``parsers`` and the top-level ``sidecar/__init__.py`` are layer 0,
each ``sidecar.<x>`` package (or module) above them is its own unit at the layer :data:`LAYERS`
gives it. An import from a unit to one of a higher layer, or a cycle between units, fails the test
with the importing file, its line and the imported module. A module of ``sidecar`` the table does
not place fails too, so a new package has to be given its layer here (and in
docs/development.md#layers).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = {
    "parsers": 0,
    "sidecar": 0,
    "sidecar.following": 1,
    "sidecar.output": 1,
    "sidecar.analysis": 2,
    "sidecar.mindspore": 2,
    "sidecar.engine": 3,
    "sidecar.inprocess": 3,
    "sidecar.service": 4,
    "sidecar.cli": 5,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p) for top in ("parsers", "sidecar") for p in (ROOT / top).rglob("*.py")}


def _unit(module: str) -> str | None:
    """The unit a module belongs to: its package's entry in :data:`LAYERS` (None if foreign)."""
    parts = module.split(".")
    if parts[0] == "parsers":
        return "parsers"
    if parts[0] != "sidecar":
        return None
    return "sidecar" if len(parts) == 1 else ".".join(parts[:2])


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module imported) for every import in the file, wherever it stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from sidecar import engine`` imports the module sidecar.engine; ``from sidecar
            # import __version__`` a name of sidecar
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((node.lineno, name if name in MODULES else base))
    return list(dict.fromkeys(found))


def _edges() -> list[tuple[str, str, str, int, str]]:
    """(from unit, to unit, file, line, module imported) for every import between units."""
    edges = []
    for top in ("parsers", "sidecar"):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            source = _unit(module)
            for line, imported in _imports(path, module):
                target = _unit(imported)
                if target is not None and target != source:
                    edges.append((source, target, str(path.relative_to(ROOT)), line, imported))
    return edges


def test_every_module_has_a_layer() -> None:
    units = {_unit(module) for module in MODULES}
    assert units - set(LAYERS) == set(), "give these a layer in LAYERS and docs/development.md"


def test_no_import_points_up() -> None:
    up = [
        f"{file}:{line} imports {imported} ({source}, layer {LAYERS[source]} -> {target}, layer {LAYERS[target]})"
        for source, target, file, line, imported in _edges()
        if LAYERS.get(target, 0) > LAYERS.get(source, 0)
    ]
    assert up == [], "imports that point up a layer:\n" + "\n".join(up)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_cycle_between_packages() -> None:
    edges = _edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target, *_ in edges:
        graph[source].add(target)
    problems = []
    for component in _cycles(graph):
        problems.append("cycle between " + ", ".join(component) + ":")
        problems.extend(
            f"  {file}:{line} imports {imported}"
            for source, target, file, line, imported in edges
            if source in component and target in component
        )
    assert problems == [], "\n".join(problems)


def test_the_reader_sees_imports_in_functions_and_relative_ones(tmp_path: Path) -> None:
    """What the two tests above trust: an import is seen however it is written."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from sidecar import __version__, engine\n"
        "def f():\n    from ..analysis import aggregate\n    import sidecar.service.daemon\n",
        encoding="utf-8",
    )
    assert [name for _, name in _imports(probe, "sidecar.output.probe")] == [
        "sidecar", "sidecar.engine", "sidecar.analysis.aggregate", "sidecar.service.daemon",
    ]
