"""The map in docs/architecture.md, checked: which rooms may import which, and no import cycles.

Imports are read from the source (``ast``), including those inside functions and those under
``if TYPE_CHECKING:`` (a type-only import is a dependency a reader has to follow too).
"""

from __future__ import annotations

import ast
import concurrent.futures
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rollfleet"

# room -> rooms it may import (besides itself). From the map: schemas is the contract everyone
# reads; runtime imports nothing of ours; trainer_client and workers never import each other.
ALLOWED = {
    "schemas": set(),
    "runtime": set(),
    "broker": {"schemas", "runtime"},
    "policy_store": {"schemas", "runtime"},
    "models": {"schemas", "runtime"},
    "trainer_client": {"schemas", "runtime", "broker", "policy_store"},
    "workers": {"schemas", "runtime", "broker", "policy_store", "models"},
    "integrations": {"schemas", "runtime", "broker", "policy_store", "trainer_client"},
    "gateway": {"schemas", "runtime", "trainer_client"},
    "cli": {"schemas", "runtime", "broker", "policy_store", "models", "trainer_client", "workers", "gateway"},
    "testing": {"schemas", "runtime", "broker", "policy_store", "models", "trainer_client", "workers", "cli"},
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parse(source: str) -> ast.Module:
    """``ast.parse`` on a thread of its own: CPython 3.11.7 (fixed in 3.11.8) miscounts the AST
    constructor's recursion depth in a thread where a ``RecursionError`` was caught before (the
    deep-nesting tests, run earlier in the same process), and raises ``SystemError``."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(ast.parse, source).result()


def _imports(path: Path) -> set[str]:
    tree = _parse(path.read_text())
    found: set[str] = set()
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rollfleet")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("rollfleet"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        graph[name] |= {m for m in _imports(path) if m in files and m != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_rooms_import_only_what_the_map_allows() -> None:
    wrong = []
    for module, deps in _graph().items():
        room = _room(module)
        if room not in ALLOWED:
            continue
        for dep in deps:
            other = _room(dep)
            if other and other != room and other not in ALLOWED[room]:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, wrong


def test_there_are_no_import_cycles_between_modules() -> None:
    """Package ``__init__`` modules re-export their rooms, so edges into them are followed to the
    submodule they name when that is what is imported; a cycle through a package's own
    ``__init__`` (a submodule importing its package) is reported too."""
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, cycles[:5]


def test_the_client_and_its_sessions_are_one_way() -> None:
    graph = _graph()
    sessions = [m for m in graph if m.startswith("rollfleet.trainer_client.sessions")]
    assert sessions, "the sessions room exists"
    for module in sessions:
        assert "rollfleet.trainer_client.client" not in graph[module], module
