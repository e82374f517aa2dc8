"""The code's shape, as the control plane v2 issue and issue 28 set it: the decisions
are pure (daemon/control/ imports nothing that does I/O, reads a clock or runs an event
loop), no import cycle anywhere (function-level and type-only imports count), the
supervisor's loop module at most 350 lines; one owner of state (no module but the
supervisor and its apply arm assigns the supervisor's fields, and ``Core``, the parts'
view of it, has no mutable attribute); no class over 300 lines in daemon/ or trainer/,
no function over 60 lines in daemon/control/ or trainer/loop.py; no import under an
alias that reads as another module.

There are no exceptions to grant: each rule holds for the whole tree.
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


# -- one owner of state ----------------------------------------------------------------------
# the names the supervisor goes by in its parts (core: the Core protocol; sup: a local alias)
_OWNER_NAMES = {"core", "sup", "supervisor"}
# methods that change the container or the JobView they are called on (JobView.to moves the job's state)
_MUTATORS = {"to", "add", "discard", "remove", "pop", "popitem", "clear", "update", "setdefault", "append",
             "extend", "insert"}
# the supervisor, and its apply arm (daemon/controlnode/actuator.py: the one other writer)
_OWNERS = {"daemon.controlnode.supervisor", "daemon.controlnode.actuator"}


def _chain(node: ast.expr) -> list[str]:
    """``self.core.job.step`` → ``["self", "core", "job", "step"]`` (a subscript is ``"[]"``)."""
    out = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
        elif isinstance(node, ast.Subscript):
            out.append("[]")
        node = node.value
    return [node.id, *reversed(out)] if isinstance(node, ast.Name) else []


def _into_owner(chain: list[str]) -> bool:
    """The chain reaches into the supervisor: ``core.X...``, ``self.core.X...`` (not ``self.core`` itself)."""
    if chain[:1] == ["self"]:
        chain = chain[1:]
    return len(chain) >= 2 and chain[0].lstrip("_") in _OWNER_NAMES


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found += t.elts
        else:
            flat.append(t)
    return flat


def owner_writes(source: str) -> list[str]:
    """Where ``source`` changes the supervisor's state: an assignment (plain, tuple,
    augmented, annotated, ``del``) to an attribute or item reached through it, or a call
    of a mutating method on something reached through it other than its store
    (``core.job.to(...)``, ``sup.rejoin.nodes.discard(...)``). ``line: dotted.target``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            chain = _chain(t)
            if chain and _into_owner(chain):
                out.append(f"{node.lineno}: {'.'.join(chain)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            chain = _chain(node.func.value)
            if chain and _into_owner(chain) and "store" not in chain:
                out.append(f"{node.lineno}: {'.'.join(chain)}.{node.func.attr}()")
    return out


def test_owner_writes_finds_each_form() -> None:
    """The check itself: each way of writing the supervisor's state is found, reads are not."""
    src = """
core.paused = True
sup.first_ready_at, sup.rejoin = None, None
self.core.job.step = 3
self.sup.desired_nodes += 1
core.nodes["n1"] = node
del core.nodes["n1"]
core.job.to(JobState.PAUSED)
self.core.job.attempts.add("a1")
self.core = core
x = core.nodes.get("n1")
core.store.set("paused", True)
node.deadline = core.clock()
"""
    assert [w.split(": ")[1] for w in owner_writes(src)] == [
        "core.paused", "sup.rejoin", "sup.first_ready_at", "self.core.job.step", "self.sup.desired_nodes",
        "core.nodes.[]", "core.nodes.[]", "core.job.to()", "self.core.job.attempts.add()"]


def test_only_the_supervisor_changes_its_state() -> None:
    """No module under daemon/ but the supervisor and its actuator assigns a field of the
    supervisor (its parts hand it typed changes: ``core.act(...)``, daemon/control/changes.py).
    ``PoolState`` and the actions are frozen dataclasses: nobody assigns them."""
    writers = {}
    for name, path in _modules().items():
        if name.startswith("daemon.") and name not in _OWNERS:
            found = owner_writes(path.read_text())
            if found:
                writers[name] = found
    assert writers == {}


def test_core_has_no_mutable_attributes() -> None:
    """``Core`` (the parts' view of the supervisor) declares methods and read-only
    properties only: no annotated or assigned attribute, no property setter."""
    tree = ast.parse((ROOT / "daemon" / "controlnode" / "core.py").read_text())
    core = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Core")
    bad = []
    for item in core.body:
        if isinstance(item, (ast.AnnAssign, ast.Assign, ast.AugAssign)):
            bad.append(ast.unparse(item))
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bad += [f"{item.name}: @{ast.unparse(d)}" for d in item.decorator_list
                    if isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")]
    assert bad == []
    assert any(isinstance(i, ast.FunctionDef) for i in core.body)  # the check looked at the class


# -- sizes -------------------------------------------------------------------------------------


def _defs(tree: ast.AST, prefix: str) -> list[tuple[str, ast.AST]]:
    """Every class and function of ``tree``, with its dotted name under ``prefix``."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((f"{prefix}.{node.name}", node))
            out += _defs(node, f"{prefix}.{node.name}")
        else:
            out += _defs(node, prefix)
    return out


def _over(kinds: tuple[type, ...], limit: int, where) -> dict[str, int]:
    big = {}
    for name, path in _modules().items():
        if where(name):
            for qual, node in _defs(ast.parse(path.read_text()), name):
                lines = node.end_lineno - node.lineno + 1
                if isinstance(node, kinds) and lines > limit:
                    big[qual] = lines
    return big


def test_no_class_is_over_300_lines() -> None:
    big = _over((ast.ClassDef,), 300, lambda m: m.split(".")[0] in PACKAGES)
    assert big == {}


def test_no_decision_or_loop_function_is_over_60_lines() -> None:
    big = _over((ast.FunctionDef, ast.AsyncFunctionDef), 60,
                lambda m: m.startswith("daemon.control.") or m == "trainer.loop")
    assert big == {}


# -- import aliases ----------------------------------------------------------------------------
# aliases the libraries' own documentation uses, kept though they break the rule below
CONVENTIONAL = {("numpy", "np"), ("torch.distributed", "dist"), ("torch.distributed.checkpoint", "dcp"),
                ("torch.nn.functional", "F")}


def _abbreviates(alias: str, dotted: str) -> bool:
    """``alias``'s letters appear in ``dotted``'s, in order (``np`` numpy, ``pf``
    daemon.controlnode.preflight, ``torchrun`` torch.distributed.run; not ``decide``
    daemon.control.migration)."""
    letters = iter(dotted.replace(".", "").replace("_", "").lower())
    return all(ch in letters for ch in alias.replace("_", "").lower())


def alias_offences(source: str, modules: set[str]) -> list[str]:
    """``import x as y`` / ``from m import x as y`` in ``source`` whose alias reads as
    another module: ``y`` is the name of a different module of the package (``modules``:
    dotted names), or ``x`` is a module and ``y`` does not abbreviate its name.
    ``"m.x as y"`` each; :data:`CONVENTIONAL` aliases pass."""
    names = {part for m in modules for part in m.split(".")}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", 0):
            continue
        for a in node.names:
            if a.asname is None:
                continue
            full = a.name if isinstance(node, ast.Import) else f"{node.module}.{a.name}"
            if (full, a.asname) in CONVENTIONAL:
                continue
            is_module = isinstance(node, ast.Import) or full in modules
            clashes = a.asname.lstrip("_") in names and a.asname.lstrip("_") != a.name.split(".")[-1]
            if clashes or (is_module and not _abbreviates(a.asname, full)):
                out.append(f"{full} as {a.asname}")
    return out


def test_alias_offences_finds_a_module_under_another_name() -> None:
    mods = {"daemon.control.migration", "daemon.control.operator", "daemon.control.actions", "daemon.control.pool"}
    src = """
from daemon.control import migration as decide
from daemon.control import operator as op
from daemon.control import actions as a
from daemon.control.pool import plan as pool
from daemon.control.migration import decide as decide_move
import numpy as np
import torch.distributed as dist
import datetime as when
"""
    assert alias_offences(src, mods) == ["daemon.control.migration as decide", "daemon.control.pool.plan as pool",
                                         "datetime as when"]


def test_no_import_alias_names_another_module() -> None:
    mods = _modules()
    found = {f"{name}: {o}" for name, path in mods.items() for o in alias_offences(path.read_text(), set(mods))}
    assert found == set()


# the supervisor's own records: mutable, written only by the supervisor (the test above)
_SUPERVISOR_RECORDS = {"daemon.control.state.JobView", "daemon.control.state.Rejoin"}


def test_what_the_decisions_take_and_return_is_frozen() -> None:
    """Every dataclass in daemon/control/ (PoolState, NodeView, the actions, the changes,
    the job tracker's and the migration's states and messages) is frozen, so a decision
    cannot change what it was given and nobody can change what it returned; the
    supervisor's own records are the exception, and only the supervisor writes them."""
    mutable = set()
    for name, path in _modules().items():
        if name.startswith("daemon.control."):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    for deco in node.decorator_list:
                        text = ast.unparse(deco)
                        if text.split("(")[0].endswith("dataclass") and "frozen=True" not in text:
                            mutable.add(f"{name}.{node.name}")
    assert mutable == _SUPERVISOR_RECORDS
