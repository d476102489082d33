"""The package's structure: checks on streamscope's source, not on its values."""

from __future__ import annotations

import ast
from pathlib import Path

import streamscope

PACKAGE = Path(streamscope.__file__).parent


# --- No import cycles inside streamscope/ -------------------------------------------------------------------------

def module_files(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name: its file, and whether it is a package's ``__init__``."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Which of the package's modules each module imports, at the top and inside functions alike.

    ``from . import x`` counts as an import of the submodule ``x`` where there
    is one, else of the package; an import of a name inside a module counts
    as one of that module. Parent packages run on import too, but an edge to
    each would make every ``__init__`` that lists its submodules a cycle:
    only the modules named count.
    """
    modules = module_files(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph`: each strongly connected set of more than one module, with one path around it."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(_path_around(graph, sorted(members)))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def _path_around(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One cycle through the first of `members`, as the modules in import order, back to the start."""
    start, inside = members[0], set(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for other in sorted(graph[node] & inside):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                frontier.append(other)
    return members


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles inside streamscope/ (a -> b: a imports b):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    # A package of four modules: one cycle through a function-level relative import, and a clean module.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from .sub.b import thing\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def thing():\n    from ..a import other\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


# --- end of the import-cycle checks -------------------------------------------------------------------------------
