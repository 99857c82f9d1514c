"""The map in docs/architecture.md, checked: which rooms may import which, and no import cycles.

Imports are read from the source (``ast``), including those inside functions and those under
``if TYPE_CHECKING:`` (a type-only import is a dependency a reader has to follow too). For the
rooms of ``reliability/`` a module named whole in a string is one too: a child process's
(``-m reliability.adversary.load``) or a worker's hook (``reliability.adversary.hooks:slow_read``);
not for cycles, since a process that starts another imports nothing of it.
"""

from __future__ import annotations

import ast
import concurrent.futures
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rollfleet"
RELIABILITY = PACKAGE.parent / "reliability"

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
    # The fleet's control loop reads what the broker holds (and the client's view of the
    # registry); the workers and the client it sizes know nothing of it.
    "autoscale": {"schemas", "runtime", "broker", "policy_store", "trainer_client"},
    "cli": {"schemas", "runtime", "broker", "policy_store", "models", "trainer_client", "workers", "gateway"}
    | {"autoscale"},
}

# reliability/'s rooms: the numbered scenarios (``python -m reliability``, its ``__main__``) and the
# machine adversary with its oracle. The scenarios import the adversary (scenario 12 runs its
# campaign, scenario 4 SIGKILLs its publisher process); the adversary imports nothing of theirs.
RELIABILITY_ALLOWED = {
    "__main__": {"scenarios"},
    "scenarios": {"adversary"},
    "adversary": set(),
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


def _imports(path: Path, named: bool = False) -> set[str]:
    """The modules ``path`` imports; with ``named``, also those its strings name (reliability/)."""
    tree = _parse(path.read_text())
    root = _module(path).partition(".")[0]
    found: set[str] = set()
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(root)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith(root):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
        elif named and isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.partition(":")[0]
            if re.fullmatch(rf"{root}(\.\w+)+", name):
                found.add(name)
    return found


def _graph(package: Path = PACKAGE, named: bool = False) -> dict[str, set[str]]:
    files = {_module(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        graph[name] |= {m for m in _imports(path, named) if m in files and m != name}
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


def test_the_product_ships_no_test_harness_and_never_imports_it() -> None:
    """The harness that tests, benchmarks and the reliability suite share (brokers, worker
    processes, a vLLM server, link faults, clock skew) lives in ``harness/``, outside what
    ``pip install rollfleet`` ships; nothing in the package imports it."""
    assert not (PACKAGE / "testing").exists()
    assert (PACKAGE.parent / "harness" / "__init__.py").exists()
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        tree = _parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            wrong += [f"{_module(path)} -> {n}" for n in names if n == "harness" or n.startswith("harness.")]
    assert not wrong, wrong


def test_reliability_rooms_import_only_what_the_map_allows() -> None:
    graph = _graph(RELIABILITY, named=True)
    unplaced = sorted(m for m in graph if m != "reliability" and _room(m) not in RELIABILITY_ALLOWED)
    assert not unplaced, f"modules of reliability/ in no room: {unplaced}"
    wrong = []
    for module, deps in graph.items():
        room = _room(module)
        for dep in deps:
            other = _room(dep)
            if other and other != room and other not in RELIABILITY_ALLOWED.get(room, set()):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, wrong


@pytest.mark.parametrize("package", [PACKAGE, RELIABILITY], ids=lambda p: p.name)
def test_there_are_no_import_cycles_between_modules(package: Path) -> None:
    """Package ``__init__`` modules re-export their rooms, so edges into them are followed to the
    submodule they name when that is what is imported; a cycle through a package's own
    ``__init__`` (a submodule importing its package) is reported too."""
    graph = _graph(package)
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


# broker/ is the only room that talks to NATS: every other room goes through its ports
# (``buckets``, ``stream_reads``, ``requests``, ``claims_bucket``, ...), names the client library's
# types through ``broker.types`` and catches the typed errors of ``broker.errors.typed``, so its
# decisions can be tested without a broker (the shared test harness, ``harness/``, lies outside the
# package). Modules elsewhere that still import nats, each with its reason: the list may only shrink.
NATS_ROOMS = {"broker"}
NATS_IMPORTS_LEFT: dict[str, str] = {}


def _imports_nats(path: Path) -> bool:
    for node in ast.walk(_parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "nats" or a.name.startswith("nats.") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").partition(".")[0] == "nats":
            return True
    return False


def test_only_the_broker_imports_nats() -> None:
    importing = {_module(p) for p in PACKAGE.rglob("*.py") if _imports_nats(p)}
    assert any(_room(m) == "broker" for m in importing), "the check sees the broker's own imports"
    wrong = sorted(m for m in importing if _room(m) not in NATS_ROOMS and m not in NATS_IMPORTS_LEFT)
    assert not wrong, f"import nats only in rollfleet/broker/ (use its ports and broker.types): {wrong}"
    gone = sorted(m for m in NATS_IMPORTS_LEFT if m not in importing)
    assert not gone, f"no longer import nats: take them off NATS_IMPORTS_LEFT: {gone}"
