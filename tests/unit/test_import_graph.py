"""The package's import graph: no cycles, a ground floor that imports nothing above it, and
only ``ops/cpu/`` touching the C libraries.

The graph is read with ``ast`` from the sources (every ``import`` statement, also those inside
functions and ``TYPE_CHECKING`` blocks: a lazy import still ties two modules together), so it
needs no import of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "moeserve"

# modules every other may import: they import only each other (and no moeserve module above)
GROUND_FLOOR = {
    "moeserve.platform",
    "moeserve.config",
    "moeserve.core",
    "moeserve.distributed.parallel_dims",
    "moeserve.ops.formats",  # the registry: names, the formats loaded lazily by name
    "moeserve.ops.formats.base",  # the contract and the plain-torch body
    "moeserve.libc",  # prctl and malloc_trim, for process hygiene
    "moeserve.guided",  # structured output's parameters (SamplingParams holds them)
}


# the floors of docs/architecture.md section 0, lowest first: a module may import only
# modules of its own floor or below. A module belongs to the floor of its longest prefix here
# (the ground floor names modules, not prefixes).
FLOORS: list[tuple[str, ...]] = [
    tuple(GROUND_FLOOR),
    (
        "moeserve.quant",
        "moeserve.models.hf_config",
        "moeserve.models.registry",
        "moeserve.models.weights",
        "moeserve.models.fp8",
        "moeserve.core",
        "moeserve.tokenizer",
        "moeserve.chat_template",
        "moeserve.detokenizer",
        "moeserve.profiling",
    ),
    ("moeserve.ops.cpu",),
    ("moeserve.ops",),
    ("moeserve.distributed",),
    ("moeserve.layers",),
    (
        "moeserve.models",
        "moeserve.kvcache",
        "moeserve.spec",
        "moeserve.text_tracker",
        "moeserve.grammar",
    ),
    ("moeserve.engine", "moeserve.eplb", "moeserve.disagg"),
    ("moeserve.launch",),
    (
        "moeserve",
        "moeserve.serving",
        "moeserve.llm",
        "moeserve.cli",
        "moeserve.bench",
        "moeserve.planner",
        "moeserve.demo",
    ),
]


def floor_of(module: str) -> int:
    """The index in :data:`FLOORS` of the longest prefix naming ``module``."""
    best, best_len = None, -1
    if module in GROUND_FLOOR:
        return 0
    for i, prefixes in enumerate(FLOORS[1:], start=1):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _target(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` refers to: itself, or the nearest package above it that exists."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``{module: the moeserve modules it imports}``."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` runs the package's __init__ too: both are edges
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("moeserve"):
                    target = _target(name, mods)
                    if target is not None and target != mod:
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_ground_floor_imports_nothing_above_it():
    graph = import_graph()
    assert GROUND_FLOOR <= set(graph), GROUND_FLOOR - set(graph)
    upward = {m: sorted(graph[m] - GROUND_FLOOR) for m in GROUND_FLOOR if graph[m] - GROUND_FLOOR}
    assert upward == {}


def test_no_module_imports_a_floor_above_its_own():
    graph = import_graph()
    upward = sorted(
        f"{m} -> {t}" for m, ts in graph.items() for t in ts if floor_of(t) > floor_of(m)
    )
    assert upward == []


def test_only_ops_cpu_touches_the_c_libraries():
    """No module outside ``ops/cpu/`` looks up ``_library()`` symbols or uses ctypes (but
    ``moeserve.libc``, the two libc calls the standard library lacks)."""
    offenders = []
    for mod, path in _modules().items():
        if mod.startswith("moeserve.ops.cpu") or mod == "moeserve.libc":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "_library":
                offenders.append(f"{mod}:{node.lineno} _library")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n == "ctypes" or n.startswith("ctypes.") for n in names):
                    offenders.append(f"{mod}:{node.lineno} ctypes")
    assert offenders == []
