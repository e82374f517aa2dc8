"""What the supervisor's parts share: the narrow view each part has of it.

The :class:`~daemon.controlnode.supervisor.Supervisor` owns the pool's state (its
nodes, the job, the store) and the loop; its parts (:mod:`.fleet`, :mod:`.agent_link`,
:mod:`.intake`, :mod:`.job_tracker`, :mod:`.operator`) each get this protocol, not the
class, so what a part may touch is written down here.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Iterator, Mapping, Protocol

from daemon.config import Config
from daemon.control.actions import Action, NodeView, PoolState
from daemon.control.reports import Limits
from daemon.control.state import JobView, Rejoin
from daemon.controlnode.store import Store
from daemon.model import Event, EventKind, Node, NodeState

__all__ = ["Core", "wait_event", "leaves"]


class Core(Protocol):
    """The supervisor, as its parts see it."""

    config: Config
    store: Store
    pool: str
    nodes: dict[str, Node]
    job: JobView
    rejoin: Rejoin | None
    agent_url: str | None
    agent_ca_pem: str | None  # the CA the nodes trust for an https agent_url (daemon.controlnode.tls)
    target_nodes: int  # the operator's target (spotctl scale)
    desired_nodes: int  # what the pool should hold now (0 while paused or once the job is over)
    paused: bool
    first_ready_at: float | None  # when the first node of a pending job was up (unix s)
    domain: str  # the placement domain the job runs in (daemon.controlnode.migrator)
    policy: Any  # the RecoveryPolicy (daemon.control.policies)
    secrets: Mapping[str, str]  # the job's secrets {NAME: value} (daemon.controlnode.job_secrets): never shown
    run_nonce: str  # the job's rendezvous id is <job.id>-<run_nonce> (daemon.controlnode.jobspec); kept in the store
    code: Any  # the CodeDelivery (daemon.controlnode.code_delivery): the pinned job.workdir, preparations

    def clock(self) -> float: ...

    def record(self, kind: EventKind | str, node: str | None = None, **data: Any) -> Event: ...

    def wake(self) -> None: ...

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...

    def set_state(self, node: Node, state: NodeState, detail: str = "") -> None: ...

    def state(self) -> PoolState: ...

    def view(self, node: Node) -> NodeView: ...

    def limits(self) -> Limits: ...

    def drop(self, node: Node, kind: str, problem: str, what: Any) -> None: ...

    def act(self, action: Action) -> None: ...

    def send(self, node_id: str, command: dict[str, Any]) -> None: ...

    def job_spec(self, node: Node) -> dict[str, Any]: ...

    def job_completed(self) -> None: ...

    def spot_cost(self) -> dict[str, Any]: ...

    def domain_of(self, node: Node) -> str: ...

    @property
    def closed(self) -> bool: ...


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


def leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    """The exceptions of a (nested) exception group, depth first."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from leaves(exc)
        else:
            yield exc
