"""A node's preparation (``job.workdir`` fetched and verified, ``job.setup`` run) and when
the daemon stops buying. Pure: no I/O, no clock.

A job with a ``job.workdir`` or a ``job.setup`` has each new node ``preparing`` after its
agent registers (:data:`~daemon.control.lifecycle.NodeState.PREPARING`: never admitted)
until the agent reports the outcome, once:

- **ready** (``code_ready``): the node is ``ready`` and the run of failures ends;
- **failed** (``setup_failed``: the fetch, the sha256 check, the unpack, or a setup
  command that exited non-zero or ran past ``job.setup_timeout_s``): the node is
  terminated as ``failed``, and the planner, finding the pool short, buys a replacement.

A setup that fails on every node would buy and fail nodes for ever. After
``job.setup_max_failures`` failures in a row across nodes (no node ready in between), the
daemon stops buying: :func:`on_prepared` returns the one operator-visible line naming
``job.setup``, and :attr:`SetupRecord.halted` stays set until the daemon restarts (with a
fixed setup or workdir, a new pin). The nodes already in the job train on.

Example (``setup_max_failures: 3``): n1 fails → ``Terminate(n1, failed)``, 1 in a row; n2
is ready → 0; n3, n4 and n5 fail → each terminated, and at n5 the record is halted with
``job.setup failed on 3 nodes in a row (...)``; n6, launched before the halt, is ready →
the run ends, but the daemon still buys nothing until it restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from daemon.control.actions import Action, NodeView, Terminate
from daemon.control.lifecycle import NodeState

__all__ = ["SetupRecord", "Prepared", "on_prepared", "halt_line"]


@dataclass(frozen=True, slots=True)
class SetupRecord:
    """The daemon run's preparation record: ``failures_in_a_row`` (since the last node
    ready) and ``halted``: the operator's line once buying stopped ("" while it buys)."""

    failures_in_a_row: int = 0
    halted: str = ""


@dataclass(frozen=True, slots=True)
class Prepared:
    """What :func:`on_prepared` decided: the new record, the actions, and the halt line
    when this outcome stopped the buying (None otherwise)."""

    record: SetupRecord
    actions: list[Action] = field(default_factory=list)
    halted_now: str | None = None


def halt_line(failures: int, node_id: str, stage: str, exit_code: int | None, last_line: str) -> str:
    """The operator's line (event, ``spotctl status``) when the buying stops."""
    code = "" if exit_code is None else f" exit {exit_code}"
    tail = f": {last_line}" if last_line else ""
    return (f"job.setup failed on {failures} nodes in a row (last: {node_id}, {stage}{code}{tail}); "
            "no more nodes are bought: fix job.setup / job.workdir, then restart spotvisord")


def on_prepared(rec: SetupRecord, node: NodeView, *, ok: bool, max_failures: int, stage: str = "",
                exit_code: int | None = None, last_line: str = "") -> Prepared:
    """``node``'s preparation ended: ``ok`` (ready) or failed at ``stage`` (``fetch``,
    ``verify``, ``unpack``, ``setup``, ``timeout``) with the setup's ``exit_code`` and its
    output's ``last_line``. A failed node still live is terminated (``failed`` while
    preparing: it never joined the job); ``max_failures`` (``job.setup_max_failures``)
    failures in a row halt the buying, once."""
    if ok:
        return Prepared(replace(rec, failures_in_a_row=0))
    n = rec.failures_in_a_row + 1
    actions: list[Action] = []
    if not node.state.is_terminal():
        final = NodeState.FAILED if node.state is NodeState.PREPARING else NodeState.TERMINATED
        actions.append(Terminate(node.id, "setup_failed", final))
    if rec.halted or n < max_failures:
        return Prepared(replace(rec, failures_in_a_row=n), actions)
    line = halt_line(n, node.id, stage, exit_code, last_line)
    return Prepared(SetupRecord(failures_in_a_row=n, halted=line), actions, halted_now=line)
