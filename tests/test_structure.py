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


def module_level_imports(
    tree: ast.Module, type_only: bool = True
) -> list[ast.Import | ast.ImportFrom]:
    """Imports at the module's level: its body, and the ``if``/``try`` blocks at its top
    level, ``if TYPE_CHECKING:`` included unless ``type_only`` is false (a reader follows
    a type-only import as any other), not function or class bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if type_only or not _is_type_checking(node):
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
    # Its own packages are already being imported when a module runs (a package's
    # __init__ importing its modules is no cycle).
    parts = name.split(".")
    return out - {".".join(parts[:i]) for i in range(1, len(parts))}


def known_is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def import_graph(
    root: Path, packages: tuple[str, ...], type_only: bool = True
) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports at module level (its type-only
    imports too, unless ``type_only`` is false)."""
    found = modules(root, packages)
    known = set(found)
    graph = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in module_level_imports(tree, type_only):
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
    assert cycle is None, "import cycle (type-only imports count): " + " -> ".join(cycle)


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
    assert graph["pkg.b"] == {"pkg.c"}  # pkg, its own package, is being imported already
    assert graph["pkg.c"] == {"pkg.a", "pkg.d"}  # d for its types too; not a function's
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\nthing = 1\n"
    )
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg.c", "pkg.d", "pkg.c"]
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


# --- the service's modules ---------------------------------------------------------------

MAX_MODULE_LINES = 500  # kimi_encoder/ and deployments/
MAX_WING_LINES = 350  # deployments/ranks/: small pieces of one concern each
WING = ROOT / "deployments" / "ranks"
SERVICE = sorted([*(ROOT / "kimi_encoder").rglob("*.py"), *(ROOT / "deployments").rglob("*.py")])


@pytest.mark.parametrize("path", SERVICE, ids=lambda p: str(p.relative_to(ROOT)))
def test_service_modules_stay_small(path):
    bound = MAX_WING_LINES if WING in path.parents else MAX_MODULE_LINES
    lines = len(path.read_text().splitlines())
    assert lines <= bound, (
        f"{path.relative_to(ROOT)} has {lines} lines (at most {bound}): split it by concern"
    )


def claims_ray_free(path: Path) -> bool:
    """The modules that say they never import Ray: every one of the ranks wing, and those
    whose docstring says "Ray-free"."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return WING in path.parents or "Ray-free" in doc


def test_the_ray_free_claims_are_checked():
    claimed = {module_name(p, ROOT) for p in SERVICE if claims_ray_free(p)}
    assert {"deployments.fanout", "deployments.ranks.roster", "deployments.dispatch"} <= claimed


@pytest.mark.parametrize(
    "path", [p for p in SERVICE if claims_ray_free(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_a_module_that_claims_to_be_ray_free_imports_no_ray_even_through_others(path):
    """No module-level import of ray in it, nor in any module of the tree it imports at
    module level, and so on: the claim holds for what importing the module pulls in (a
    function that imports ray where it runs in a replica says so itself)."""
    graph = import_graph(ROOT, PACKAGES, type_only=False)  # what importing it runs
    paths = modules(ROOT, PACKAGES)
    seen, pending = set(), [module_name(path, ROOT)]
    while pending:
        name = pending.pop()
        if name in seen or name not in paths:
            continue
        seen.add(name)
        tree = ast.parse(paths[name].read_text())
        rays = [
            alias.name if isinstance(node, ast.Import) else node.module
            for node in module_level_imports(tree, type_only=False)  # what runs
            for alias in node.names
            if (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            == "ray"
        ]
        assert not rays, f"{path.relative_to(ROOT)} claims to be Ray-free; {name} imports {rays}"
        pending += graph.get(name, ())


# What a rank client answers (deployments/ranks/calls.py, RankClient).
RANK_METHODS = {"encode", "load", "wake", "hold", "push", "info", "replica_alive"}


def rank_calls(path: Path) -> list[str]:
    """Calls of a rank client's methods made on something that reads as a rank (an item
    of ``ranks`` or ``clients``, a roster's ``_clients``), and any reach into a roster's
    clients: what only deployments/ranks/ may do."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "_clients":
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in RANK_METHODS:
            continue
        target = node.func.value
        if isinstance(target, ast.Subscript) and any(
            word in ast.unparse(target.value) for word in ("ranks", "clients")
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_rank_call_outside_the_ranks_wing():
    """Every rank call goes through the wing's roster (its gate, its book): a new caller
    elsewhere (a metrics scrape, a hand-off) would call a rank Serve may stop and keep it.
    handles.py is the client itself."""
    outside = [
        p
        for p in sorted((ROOT / "deployments").rglob("*.py"))
        if WING not in p.parents and p.name != "handles.py"
    ]
    assert len(outside) > 10
    found = [call for path in outside for call in rank_calls(path)]
    assert found == [], "rank calls outside deployments/ranks/:\n" + "\n".join(found)


def test_the_rank_call_guard_catches_a_new_caller(tmp_path):
    sneaky = tmp_path / "scrape.py"
    sneaky.write_text(
        "async def scrape(roster, ranks):\n"
        "    await roster._clients[1].info()\n"
        "    await ranks[2].load()\n"
        "    await self.fanout.ranks[r].push(part, [])\n"
        "    item = items[0].encode()\n"  # not a rank
    )
    found = rank_calls(sneaky)
    assert sorted(line.split(":")[1] for line in found) == ["2", "2", "3", "4"]


# What every replica, client and test process imports at start, and what a rank then does
# (build its model on the meta device, fill it, run a forward). torch._dynamo (and the sympy
# it pulls in) is a second of CPU per process; only a compiled or graphs build and a CUDA
# varlen forward need it, and they import it then (kimi_encoder.model.varlen_function). A
# rank's build imports sympy alone (0.3 s: to_empty of a meta model), not dynamo.
START_MODULES = ("deployments.app", "deployments.rank", "deployments.ingress", "kimi_encoder.cli")
PROBE = """
import importlib, io, sys
from PIL import Image
def loaded():
    return sorted({"torch._dynamo", "sympy"} & set(sys.modules))
for name in sys.argv[1:]:
    importlib.import_module(name)
    print(name, loaded())
from kimi_encoder.encoder import VisionEncoder
encoder = VisionEncoder.from_pretrained("tiny", device="cpu", backend="cpu")
image = io.BytesIO()
Image.new("RGB", (64, 48)).save(image, "PNG")
encoder.encode([encoder.plan(image.getvalue())])
print("a tiny rank's build and forward", "torch._dynamo" in sys.modules)
"""


def test_starting_a_process_does_not_import_dynamo():
    import subprocess
    import sys

    command = [sys.executable, "-c", PROBE, *START_MODULES]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    want = [f"{name} []" for name in START_MODULES] + ["a tiny rank's build and forward False"]
    assert done.stdout.splitlines() == want, done.stdout
