"""The tree's layering, read from the source (no imports run): no import cycle between
modules, ``kimi_encoder`` free of Ray, benchmark modules small and not importing each
other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kimi_encoder", "deployments", "benchmarks")
MAX_BENCHMARK_LINES = 500


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    return {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: its body, and the ``if``/``try``
    blocks at its top level (not ``if TYPE_CHECKING:``), not function or class bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                pending += handler.body
        elif isinstance(node, ast.With):
            pending += node.body
    return found


def imported(name: str, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules among ``known`` that ``node``, in module ``name``, imports."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        package = name.split(".")
        if not known_is_package(name, known):
            package = package[:-1]
        if node.level:
            base = package[: len(package) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
    out = set()
    for target in targets:
        # ``import a.b.c`` runs a, a.b and a.b.c
        parts = target.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known
    out.discard(name)
    return out


def known_is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports at module level."""
    found = modules(root, packages)
    known = set(found)
    graph = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in module_level_imports(tree):
            edges |= imported(name, node, known)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_tree():
    graph = import_graph(ROOT, PACKAGES)
    assert "benchmarks.bench_bytes" in graph
    assert "deployments.args" in graph["deployments.rank"]  # the graph sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle)


def test_a_cycle_is_named(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("import os\nfrom .c import thing\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n"
        "def later():\n    from . import a\nfrom pkg import a\n"
    )
    (package / "d.py").write_text("from .c import thing\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg", "pkg.c"}
    assert graph["pkg.c"] == {"pkg", "pkg.a"}  # not d (type checking), not a function's
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("thing = 1\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None


def every_import(path: Path) -> list[str]:
    """Every module name an import statement in ``path`` names, wherever it stands."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "kimi_encoder").rglob("*.py")), ids=str)
def test_kimi_encoder_never_imports_ray(path):
    rays = [name for name in every_import(path) if name.split(".")[0] == "ray"]
    assert not rays, f"{path.relative_to(ROOT)} imports {rays}: the library stays Ray-free"


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmark_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_BENCHMARK_LINES, (
        f"benchmarks/{path.name} has {lines} lines (at most {MAX_BENCHMARK_LINES}): move "
        "what other benchmarks could use into the shared modules, or split it by question"
    )


def test_benchmarks_import_no_other_benchmark_at_module_level():
    """Each ``bench_*`` stands on the shared modules (common, cpu, serving, paths, ...),
    never on another ``bench_*``."""
    graph = import_graph(ROOT, ("benchmarks",))
    crossing = {
        name: sorted(e for e in edges if e.split(".")[-1].startswith("bench_"))
        for name, edges in graph.items()
        if name.split(".")[-1].startswith("bench_")
    }
    assert {name: edges for name, edges in crossing.items() if edges} == {}
