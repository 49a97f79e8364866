"""The package's import graph has no cycle and no module reaches into another's privates.

DESIGN "Target layout": each box imports only boxes below it. The graph is read from the
source (every ``import`` statement, including those inside functions, which are edges all
the same once they run); ``if TYPE_CHECKING:`` blocks are left out, as they never run.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import torchroof

ROOT = Path(torchroof.__file__).resolve().parent.parent
PACKAGES = {
    "torchroof": ROOT / "torchroof",
    "torchroof.counters": ROOT / "counters",
    "torchroof.hardware": ROOT / "hardware",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node outside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if id(n) not in skipped]


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package modules it imports, private names imported across modules).

    ``from torchroof import routing`` is an edge to ``torchroof.routing``, not to the
    package's ``__init__`` (which every submodule import runs first anyway)."""
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    private: list[str] = []
    for name, path in modules.items():
        aliases: dict[str, str] = {}  # local name -> imported package module
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchroof"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in modules:
                        edges[name].add(target)
                        aliases[alias.asname or alias.name] = target
                    elif node.module in modules:
                        edges[name].add(node.module)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            private.append(f"{name} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        edges[name].add(alias.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append(f"{name} reads {aliases[node.value.id]}.{node.attr}")
    return edges, private


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of ``edges`` as a path that ends where it starts, or [] if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(edges):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_find_cycle_sees_a_two_module_loop():
    # a -> b -> a is a cycle; c -> a is not part of it
    assert find_cycle({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_package_has_no_import_cycle():
    edges, _ = import_graph()
    assert "torchroof.pipeline" in edges  # the walk found the package at all
    assert find_cycle(edges) == []


def test_no_module_imports_another_modules_private_names():
    _, private = import_graph()
    assert private == []


def test_pipeline_is_the_stage_only():
    """The model-level entry points live in torchroof.api; the pricing stage imports no
    capture, workload or model-building module."""
    edges, _ = import_graph()
    above = {"torchroof.api", "torchroof.capture", "torchroof.workloads", "torchroof.models"}
    assert not edges["torchroof.pipeline"] & above
    assert "torchroof.pipeline" in edges["torchroof.api"]
