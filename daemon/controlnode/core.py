"""What the supervisor's parts share: the narrow, read-only view each part has of it.

The :class:`~daemon.controlnode.supervisor.Supervisor` owns the pool's state (its
nodes, the job, the operator's target and pause, the grow in flight) and the loop; its
parts (:mod:`.fleet`, :mod:`.agent_link`, :mod:`.intake`, :mod:`.job_tracker`,
:mod:`.operator`, ...) each get this protocol, not the class, so what a part may read
and ask for is written down here. A part assigns none of it: it hands the supervisor
a typed change or decision (:meth:`Core.act`: :mod:`daemon.control.changes`,
:mod:`daemon.control.actions`), a node's next state (:meth:`Core.set_state`) or a new
node (:meth:`Core.add_node`), and the supervisor applies it
(:class:`~daemon.controlnode.actuator.Actuator`). ``tests/test_layout.py`` checks both.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Iterable, Iterator, Mapping, Protocol

import structlog

from daemon.config import Config
from daemon.control.actions import Action, NodeView, PoolState
from daemon.control.changes import Change
from daemon.control.policies import RecoveryPolicy
from daemon.control.reports import Limits
from daemon.control.state import JobView, Rejoin
from daemon.controlnode.store import Store
from daemon.model import Event, EventKind, Node, NodeState

__all__ = ["Core", "wait_event", "stop_tasks", "leaves"]

log = structlog.get_logger("spotvisor.daemon")

#: seconds between the cancels :func:`stop_tasks` repeats, and its bound in all
RECANCEL_S = 0.5
STOP_BOUND_S = 10.0


class Core(Protocol):
    """The supervisor, as its parts see it: properties to read, methods to ask with."""

    @property
    def config(self) -> Config: ...

    @property
    def store(self) -> Store: ...  # the events and node rows (a part appends events through record())

    @property
    def pool(self) -> str: ...

    @property
    def nodes(self) -> Mapping[str, Node]: ...  # by id; a new one comes in through add_node()

    @property
    def job(self) -> JobView: ...  # what the trainer's reports say of the job; changed by the supervisor alone

    @property
    def rejoin(self) -> Rejoin | None: ...  # the grow in flight

    @property
    def agent_url(self) -> str | None: ...  # the agents' endpoint, from start() (None before)

    @property
    def agent_ca_pem(self) -> str | None: ...  # the CA the nodes trust for an https agent_url (daemon.controlnode.tls)

    @property
    def target_nodes(self) -> int: ...  # the operator's target (spotctl scale)

    @property
    def desired_nodes(self) -> int: ...  # what the pool should hold now (0 while paused or once the job is over)

    @property
    def paused(self) -> bool: ...

    @property
    def domain(self) -> str: ...  # the placement domain the job runs in (daemon.controlnode.migrator)

    @property
    def policy(self) -> RecoveryPolicy: ...  # the recovery policy (daemon.control.policies)

    @property
    def run_nonce(self) -> str: ...  # the job's rendezvous id is <job.id>-<run_nonce> (daemon.controlnode.jobspec)

    @property
    def closed(self) -> bool: ...

    def clock(self) -> float: ...

    def record(self, kind: EventKind | str, node: str | None = None, **data: Any) -> Event: ...

    def wake(self) -> None: ...

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...

    def act(self, action: Action | Change) -> None: ...

    def set_state(self, node: Node, state: NodeState, detail: str = "") -> None: ...

    def add_node(self, node: Node) -> None: ...

    def state(self) -> PoolState: ...

    def view(self, node: Node) -> NodeView: ...

    def limits(self) -> Limits: ...

    def drop(self, node: Node, kind: str, problem: str, what: Any) -> None: ...

    def send(self, node_id: str, command: dict[str, Any]) -> None: ...

    def job_spec(self, node: Node) -> dict[str, Any]: ...

    def job_completed(self) -> None: ...  # the pool holds nothing from now on (act(CompleteJob(...)) calls it)

    def spot_cost(self) -> dict[str, Any]: ...

    def domain_of(self, node: Node) -> str: ...


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s`` seconds; True if it was set.

    ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11, wait_for
    can swallow a cancellation that arrives as the event is set (gh-86296), and a
    loop that loses its cancel never stops.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def stop_tasks(tasks: Iterable["asyncio.Task[Any] | None"], *, every_s: float = RECANCEL_S,
                     bound_s: float = STOP_BOUND_S) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every ``every_s``
    seconds while one runs on, for ``bound_s`` seconds at most (then ``task_ignored_cancel``
    is logged and it is left). What each raised is theirs (not raised here).

    A task that calls aetcd and gRPC can lose a cancel: Python 3.11's ``asyncio.wait_for``
    (in aetcd's ``Watcher.add_callback``) returns the inner result when a cancel lands as it
    completes, and aetcd's ``_terminate_stream`` swallows ``CancelledError``. One such lost
    cancel left a deposed daemon's key watch running, and the daemon stopping for ever
    (the partition chaos cell, under load: its ``tasks_dumped`` showed the watch in
    ``async for``); a cancel repeated reaches it at its next await."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(every_s, max(0.0, deadline - loop.time())))
    for t in pending:
        log.error("task_ignored_cancel", task=t.get_name(), waited_s=bound_s)
    for t in given:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: theirs, and not "never retrieved" at collection


def leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    """The exceptions of a (nested) exception group, depth first."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from leaves(exc)
        else:
            yield exc
