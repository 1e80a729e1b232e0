"""The package's layers hold, and its import graph has no cycles that can run.

The layers are import-linter contracts in pyproject.toml (docs/layout.md says why that
order): `lint-imports` checks them here as in `make lint`, imports under `if TYPE_CHECKING:`
and inside functions counted, so a type-only import of a higher layer fails too.

The cycle check below is about what runs: each module's imports are read with `ast` (at
module level and inside functions; those under `if TYPE_CHECKING:` never run and are left
out, and a cross-layer one is the contracts' to refuse). An edge runs from a module to each
module of ours it imports: `from a.b import c` is an edge to `a.b.c` when that is a module,
else to `a.b`; `import a.b` an edge to `a.b`. Importing a submodule also runs its parent
packages' `__init__`, but that is how every package works and is not counted.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jaxnitro

ROOT = Path(jaxnitro.__file__).parent
PACKAGE = "jaxnitro"
CHECKOUT = ROOT.parent.parent  # src/jaxnitro -> the checkout, where pyproject.toml is

# Edges (importer, imported) that close a cycle today and are allowed for now, each with why.
KNOWN_LAZY: dict[tuple[str, str], str] = {}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join([PACKAGE, *parts])] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def import_graph() -> dict[str, set[str]]:
    """Module name -> the modules of ours it imports (any of its import statements)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _base(name, path.name == "__init__.py", node)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


@pytest.mark.slow
def test_no_import_cycles():
    graph = import_graph()
    for (importer, imported), _why in KNOWN_LAZY.items():
        graph[importer].discard(imported)
    found = cycles(graph)
    assert not found, "import cycles (importer -> imported; one per group of modules):\n" + (
        "\n".join(" -> ".join(cycle) for cycle in found)
    )


@pytest.mark.slow
def test_known_exceptions_are_still_needed():
    # An allowed edge that no longer exists (or no longer closes a cycle) is taken off the list.
    graph = import_graph()
    for edge in KNOWN_LAZY:
        importer, imported = edge
        assert imported in graph.get(importer, set()), f"{edge} is gone: remove it from KNOWN_LAZY"
        without = {k: set(v) for k, v in graph.items()}
        for other in KNOWN_LAZY:
            if other != edge:
                without[other[0]].discard(other[1])
        assert cycles(without), f"{edge} no longer closes a cycle: remove it from KNOWN_LAZY"


def test_the_walk_sees_cycles_and_lazy_imports():
    # The checker itself: a function-level import closing a loop is a cycle.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    from . import z\n")
    assert sorted(type(n).__name__ for n in _imports(tree)) == ["Import", "ImportFrom"]


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package under `src`, with this checkout's contracts."""
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), f"{exe} is missing: install the dev extra (pip install -e '.[dev]')"
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(exe), "--no-cache", "--no-logo", str(CHECKOUT / "pyproject.toml")],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layers_hold():
    done = lint_imports(ROOT.parent)
    assert done.returncode == 0, f"an import breaks the layers (docs/layout.md):\n{done.stdout}"
    assert ", 0 broken." in done.stdout


def test_a_type_only_import_of_a_higher_layer_breaks_them(tmp_path):
    # The contracts see an import under TYPE_CHECKING: core naming the handle is refused.
    shutil.copytree(ROOT, tmp_path / "jaxnitro", ignore=shutil.ignore_patterns("__pycache__"))
    units = tmp_path / "jaxnitro" / "_src" / "core" / "units.py"
    units.write_text(
        units.read_text()
        + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        + "    from jaxnitro._src.run.nitro import Nitro\n"
    )
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    assert "jaxnitro._src.core.units -> jaxnitro._src.run.nitro" in done.stdout
