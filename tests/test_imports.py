"""The package's layering: each folder imports only the folders below it, no import cycle, and
no module reaching into another's private names.

The order is the order data flows (the developer guide's layout page): the leaves
(``config``, ``hardware`` and the utilities ``progress``, ``quiet`` and ``collector``)
import nothing of torchroof, not even under ``TYPE_CHECKING``; ``records`` reads only
``config`` (a step's facts hold the Workload it ran); ``counters`` reads only ``records``
and ``config``; then capture, quantisation, models, parallel programs, workloads, kernels,
timing, the report's data, the measured runs and the expected ranges fitted on them,
pricing, pipeline parallelism (it traces and prices whole stages,
so it sits above pricing), rendering, the public API, the prepared model and its studies,
serving (it prices engine steps from a prepared model), plan search (it prices layouts as
the prepared model and the serving simulation do), the labs and validation, and the
command line on top. The graph is read from the source: every ``import`` statement,
including those inside functions (edges all the same once they run); ``if TYPE_CHECKING:``
blocks are left out of the cycle check, as they never run, but not out of the layering
checks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

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


def import_graph(type_checking: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package modules it imports, private names imported across modules).

    ``from torchroof.capture import routing`` is an edge to ``torchroof.capture.routing``,
    not to the package's ``__init__`` (which every submodule import runs first anyway); a
    relative import (``from ..pricing import price``) is resolved against the module's
    package."""
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    private: list[str] = []
    for name, path in modules.items():
        aliases: dict[str, str] = {}  # local name -> imported package module
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in list(ast.walk(tree)) if type_checking else _runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: make it absolute
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                node = ast.ImportFrom(
                    module=".".join([*base, *([node.module] if node.module else [])]),
                    names=node.names,
                    level=0,
                )
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
    assert "torchroof.pricing.price" in edges  # the walk found the package at all
    assert find_cycle(edges) == []


def test_no_module_imports_another_modules_private_names():
    _, private = import_graph()
    assert private == []


# bottom first: a module may import modules of its own room or of any lower rank
LAYERS: list[tuple[str, ...]] = [
    (
        "torchroof.config",
        "torchroof.hardware",
        "torchroof.progress",
        "torchroof.quiet",
        "torchroof.collector",
    ),
    ("torchroof.records",),
    ("torchroof.counters",),
    ("torchroof.capture",),
    ("torchroof.quant",),
    ("torchroof.models",),
    ("torchroof.parallel",),
    ("torchroof.workloads",),
    ("torchroof.kernels",),
    ("torchroof.timing",),
    ("torchroof.report",),
    ("torchroof.accuracy",),
    ("torchroof.pricing",),
    ("torchroof.parallel.pipeline",),
    ("torchroof.render",),
    ("torchroof.api",),
    ("torchroof.symbolic",),
    ("torchroof.prepared",),
    ("torchroof.studies", "torchroof.sensitivity"),
    ("torchroof.serving",),
    ("torchroof.planning",),
    ("torchroof.labs", "torchroof.validation"),
    ("torchroof.cli",),
    ("torchroof", "torchroof.__main__"),  # these two modules exactly: the package's face
]
LEAVES = set(LAYERS[0])
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}
TOP = {"torchroof", "torchroof.__main__"}  # rooms that hold only themselves, no folder


def room(module: str) -> str:
    """The longest entry of LAYERS that is ``module`` or a package above it (the top
    package ``torchroof`` is a room of its own ``__init__`` only, so a new folder that is
    in no layer is found, not taken for the top)."""
    best = ""
    for candidate in RANK:
        inside = module.startswith(candidate + ".") and candidate not in TOP
        if (module == candidate or inside) and len(candidate) > len(best):
            best = candidate
    assert best, f"{module} is in no layer: add its folder to LAYERS"
    return best


def test_room_finds_a_new_folder_in_no_layer():
    assert room("torchroof.pricing.price") == "torchroof.pricing"
    assert room("torchroof") == "torchroof"
    with pytest.raises(AssertionError, match="in no layer"):
        room("torchroof.newfolder.module")


MODULES = _modules()
EDGES, _ = import_graph(type_checking=True)


def test_every_module_has_a_layer():
    assert len(MODULES) > 60
    for module in MODULES:
        room(module)  # fails when a new folder is in no layer


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_room_above_its_own(module):
    own = room(module)
    wrong = []
    for target in sorted(EDGES.get(module, ())):
        there = room(target)
        if there == own:
            continue  # its own room
        if own.startswith(there + ".") and target == there and there not in TOP:
            continue  # the __init__ of the package it lives in (parallel.pipeline -> parallel)
        if RANK[there] >= RANK[own]:
            wrong.append(f"{target} ({there}, rank {RANK[there]})")
    assert not wrong, f"{module} ({own}, rank {RANK[own]}) imports upward: {wrong}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if room(m) in LEAVES))
def test_leaves_import_nothing_of_torchroof_outside_themselves(module):
    own = room(module)
    outside = sorted(t for t in EDGES.get(module, ()) if room(t) != own)
    assert not outside, f"{module} is a leaf but imports {outside}"


@pytest.mark.parametrize(
    "folder, may_read",
    [
        ("torchroof.records", {"torchroof.config"}),
        ("torchroof.counters", {"torchroof.records", "torchroof.config"}),
    ],
)
def test_records_and_counters_read_only_what_is_below_them(folder, may_read):
    for module in MODULES:
        if room(module) == folder:
            others = {room(t) for t in EDGES.get(module, ())} - {folder}
            assert others <= may_read, (module, others)


def test_the_rank_table_orders_the_stages():
    # config is a leaf (rank 0), records just above; pricing builds the report's Estimate, so
    # it is above it; pipeline parallelism prices whole stages, so it is above pricing, though
    # it lives inside parallel/
    assert {"torchroof.config.workload", "torchroof.records.trace"} <= set(MODULES)
    assert RANK[room("torchroof.config.workload")] == 0
    assert RANK[room("torchroof.records.trace")] == 1
    assert RANK[room("torchroof.pricing.price")] > RANK[room("torchroof.report.estimate")]
    assert room("torchroof.parallel.pipeline.price") == "torchroof.parallel.pipeline"
    assert (
        RANK["torchroof.parallel.pipeline"] > RANK["torchroof.pricing"] > RANK["torchroof.parallel"]
    )
