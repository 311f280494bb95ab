"""The direction of dependencies: the engine (everystep/) never imports the
supervisor, and no module imports itself back through others. Read from the
source (every import, at module level or inside a function), not from what
happens to be imported at run time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("everystep", "supervisor")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported_by(module: str) -> set[str]:
    """Every module `module` imports: `from a import b` is the module a.b when
    there is one, else a (whose b is a name)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return found


GRAPH = {module: {name for name in imported_by(module) if name in MODULES and name != module} for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan's
    strongly connected components of more than one module, or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1 or node in graph[node]:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_engine_never_imports_the_supervisor():
    offenders = {module: sorted(name for name in imported_by(module) if name.split(".")[0] == "supervisor")
                 for module in MODULES if module.split(".")[0] == "everystep"}
    assert {module: names for module, names in offenders.items() if names} == {}
    # The scan sees imports, the lazy ones included: the supervisor's of the engine.
    assert "everystep.worker" in GRAPH["supervisor.children"]
    assert "everystep.config" in imported_by("everystep.cli.common")


def test_no_module_imports_itself_back():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_api_does_not_reach_into_the_runner():
    # The public API records steps through the run context's Recorder protocol;
    # only the worker and the tests' harness drive the runner.
    assert "everystep.runner" not in GRAPH["everystep.api"]
    assert {module for module, names in GRAPH.items() if "everystep.runner" in names} <= {
        "everystep.worker", "everystep.__init__", "everystep"}


def test_workflow_names_are_resolved_in_one_module():
    # Registering, naming, resolving and importing workflows: everystep.registry only.
    needles = ("__everystep_workflow__", "importlib.import_module")
    holders = {module for module, path in MODULES.items() if any(needle in path.read_text() for needle in needles)}
    assert holders == {"everystep.registry"}
