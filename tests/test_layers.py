"""The direction of dependencies: the engine (everystep/) never imports the
supervisor, and no module imports itself back through others. Read from the
source (every import, at module level or inside a function), not from what
happens to be imported at run time."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
    # only the worker, the drains of everystep.testing and the replay check
    # (everystep.history, the replay rules without their writes) drive the runner.
    assert "everystep.runner" not in GRAPH["everystep.api"]
    assert {module for module, names in GRAPH.items() if "everystep.runner" in names} <= {
        "everystep.worker", "everystep.__init__", "everystep", "everystep.testing.draining", "everystep.history"}


def test_workflow_names_are_resolved_in_one_module():
    # Registering, naming, resolving and importing workflows: everystep.registry only.
    needles = ("__everystep_workflow__", "importlib.import_module")
    holders = {module for module, path in MODULES.items() if any(needle in path.read_text() for needle in needles)}
    assert holders == {"everystep.registry"}


# A string that starts like an SQL statement.
SQL_TEXT = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|SET|RESET|LISTEN|NOTIFY|GRANT|REVOKE"
                      r"|BEGIN|COMMIT|LOCK|TRUNCATE)\b")
# Who may hold SQL in its source, and why: the data layer's composed
# statements, which take an identifier (LISTEN its channel, a test's schema
# its name), and the role script `everystep roles` prints for an operator,
# made of the role and schema names.
SQL_HOLDERS = {"everystep.db.session": {"LISTEN {}"},
               "everystep.db.testing": {"CREATE SCHEMA {}", "DROP SCHEMA {} CASCADE"}, "everystep.roles": None}


def sql_texts(module: str) -> set[str]:
    """The string constants of a module that start like SQL, docstrings aside."""
    tree = ast.parse(MODULES[module].read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and SQL_TEXT.match(node.value)}


def test_nobody_but_the_data_layer_writes_sql():
    # Every statement the engine runs is named in everystep/db/sql/ (loaded
    # by everystep.db.queries); no module writes one of its own.
    found = {module: texts for module in MODULES if (texts := sql_texts(module))}
    allowed = {module: texts for module, texts in found.items()
               if module in SQL_HOLDERS and SQL_HOLDERS[module] in (None, texts)}
    assert {module: sorted(texts) for module, texts in found.items() if module not in allowed} == {}
    assert "everystep.store" not in MODULES
# The JSON codec, the registry, log lines and spans never import the database
# layer: what they need of it comes in as values.
WITHOUT_DATABASE = ("everystep.serde", "everystep.registry", "everystep.logs", "everystep.tracing")


def is_database_layer(module: str) -> bool:
    return module.split(".")[0].startswith("psycopg") or module.split(".")[:2] in (
        ["everystep", "store"], ["everystep", "db"])


def test_the_codec_the_registry_logs_and_tracing_never_import_the_database_layer():
    # As imported, in a fresh interpreter. The package's __init__ (the public
    # API, which schedules runs through the store) is left out: a bare package
    # stands in for it, so that only these modules' own imports count.
    code = (
        "import sys, types\n"
        "package = types.ModuleType('everystep')\n"
        f"package.__path__ = [{str(ROOT / 'everystep')!r}]\n"
        "sys.modules['everystep'] = package\n"
        f"for name in {WITHOUT_DATABASE!r}: __import__(name)\n"
        "print(*sorted(sys.modules))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    assert set(WITHOUT_DATABASE) <= set(loaded)
    assert [module for module in loaded if is_database_layer(module)] == []
    # As written, the lazy imports included.
    reached, todo = set(), list(WITHOUT_DATABASE)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(GRAPH[module])
    assert sorted(module for module in reached if is_database_layer(module)) == []
