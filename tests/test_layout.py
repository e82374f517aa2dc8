"""The code's shape, as the control plane v2 issue set it: the decisions are pure
(daemon/control/ imports nothing that does I/O, reads a clock or runs an event loop),
no import cycle anywhere (function-level and type-only imports count), no class under
daemon/ over 400 lines, and the supervisor's loop module at most 350 lines.

``python -m pytest tests/test_layout.py`` is the command that checks it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("daemon", "trainer")
# what a pure decision may import besides daemon.control itself: no asyncio, no I/O, no clock
PURE_STDLIB = {"__future__", "dataclasses", "enum", "typing", "math", "random", "collections", "collections.abc",
               "re", "itertools", "functools"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, wherever the import statement is."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_import_cycle() -> None:
    mods = _modules()
    graph = {m: {d for d in _imports(p) if d in mods and d != m} for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_decisions_are_pure() -> None:
    impure = {}
    for name, path in _modules().items():
        if not name.startswith("daemon.control."):
            continue
        bad = {i for i in _imports(path) if not i.startswith("daemon.control")
               and i.split(".")[0] not in {s.split(".")[0] for s in PURE_STDLIB}}
        if bad:
            impure[name] = sorted(bad)
    assert impure == {}


@pytest.mark.parametrize("limit", [400])
def test_no_class_under_daemon_is_over_400_lines(limit: int) -> None:
    big = {}
    for name, path in _modules().items():
        if name.startswith("daemon."):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                    big[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert big == {}


def test_the_loop_module_is_short() -> None:
    lines = (ROOT / "daemon" / "controlnode" / "supervisor.py").read_text().count("\n")
    assert lines <= 350, lines
