"""The import graph between the rooms of the house has no loop (issue 33): odmoe's sub-packages and
top-level modules, nodes/, launch/, benchmarks/ (the odmoe_bench distribution). Allowed by design
and left out: odmoe/__init__.py re-exporting LocalCluster from launch. Inside a room neither (issue
49): no module imports one that imports it back, whether at the top, inside a function or for type
checking only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {("odmoe/__init__.py", "launch")}
TOP = {"nodes": "nodes", "launch": "launch"}  # odmoe.<name> -> room


def room_of_module(dotted: str) -> str | None:
    """The room of an imported `odmoe...` (or `odmoe_bench...`) module name (None: not ours)."""
    parts = dotted.split(".")
    if parts[0] == "odmoe_bench":
        return "benchmarks"
    if parts[0] != "odmoe" or len(parts) == 1:
        return None
    if parts[1] in TOP:
        return TOP[parts[1]]
    return f"odmoe.{parts[1]}"


def room_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] != "odmoe":
        return rel.parts[0]
    if len(rel.parts) == 2:  # a top-level module of odmoe (or its __init__)
        return "odmoe" if rel.name == "__init__.py" else f"odmoe.{rel.stem}"
    return f"odmoe.{rel.parts[1]}"


def our_files() -> list[Path]:
    return [
        path
        for top in ("odmoe", "nodes", "launch", "benchmarks")
        for path in sorted((ROOT / top).rglob("*.py"))
        if "rpc" not in path.parts
    ]


def imported(path: Path) -> list[str]:
    """Every dotted name a file imports (and `module.name` for each name taken from a module)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in our_files():
        here, rel = room_of_file(path), str(path.relative_to(ROOT))
        for name in imported(path):
            there = room_of_module(name)
            if there and there != here and (rel, there) not in ALLOWED and there != "odmoe":
                graph.setdefault(here, set()).add(there)
    return graph


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "benchmarks":
        parts[0] = "odmoe_bench"
    elif parts[0] != "odmoe":
        parts.insert(0, "odmoe")
    return ".".join(parts).removesuffix(".__init__")


def module_edges() -> dict[str, set[str]]:
    """Every import of one of our modules by another, a package's own __init__ aside (importing a
    package runs it first: that is not a loop a reader follows)."""
    files = {_module_name(path): path for path in our_files()}
    graph: dict[str, set[str]] = {}
    for here, path in files.items():
        for name in imported(path):
            if name in files and name != here and not here.startswith(name + ".") and name != "odmoe":
                graph.setdefault(here, set()).add(name)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_no_loop_between_rooms():
    graph = edges()
    loops = sorted(room for room in graph if room in reachable(graph, room))
    assert not loops, {room: sorted(graph[room]) for room in loops}


def test_no_loop_between_modules():
    graph = module_edges()
    loops = sorted(m for m in graph if m in reachable(graph, m))
    assert not loops, {m: sorted(graph[m] & set(loops)) for m in loops}


def test_the_check_sees_the_rooms():
    graph = edges()
    assert "odmoe.main" in graph["nodes"] and "odmoe.worker" in graph["nodes"]
    assert "launch" in graph["benchmarks"] and "odmoe.config" in graph["odmoe.main"]
    # and a loop is found when there is one
    assert "a" in reachable({"a": {"b"}, "b": {"a"}}, "a")
    modules = module_edges()
    assert "odmoe.main.exchange_records" in modules["odmoe.main.remote_experts"]
    assert "odmoe.models.checkpoint" in modules["odmoe.models.open_model"]
