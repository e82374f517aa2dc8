"""The chaos matrix (issue 7, item 3): each cell injects one fault and asserts nothing is lost.

Every test of ``tests/chaos/`` records one row per scenario through the ``matrix``
fixture: did the job complete, how many committed checkpoints were lost, how many
instances were leaked, how many events were lost. The rows are printed as one table
at the end of the session (:func:`print_matrix`, from the root conftest's
``pytest_terminal_summary``, also under ``-q`` and with pytest-xdist); a
test records its row *before* asserting the zeros, so a failing cell shows its
numbers. A test that fails before recording shows up as a row of ``?``.

What "lost" means is the same in every cell:

- **lost committed checkpoints**: commits a trainer made (its status line, a
  manifest in the store) that the system forgot: no ``checkpoint_committed`` event
  for them, or a newer one is no longer the one resume takes (``latest_committed``);
- **leaked instances**: instances still alive at the provider once the daemon is
  done with them (the job completed and the pool was released);
- **lost events**: gaps in the store's ``seq`` (1..last), plus events somebody saw
  (the feed, a follower of ``/v1/events``, a listener) that the store no longer holds
  as they were seen.

Also here: the in-process harness the fast cells share (:class:`Sim`: Supervisor +
:class:`ChaosProvider` + :class:`~conftest.ManualClock`, the agents' calls made
directly) and the event-loss check.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from conftest import UNTIL_TIMEOUT_S, ManualClock, RecordingProvider
from daemon.config import Config
from daemon.model import Event, Node, NodeState
from daemon.providers.base import CapacityError, Instance
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor

# -- the matrix ---------------------------------------------------------------------------------

COLUMNS = ("job completed", "lost committed checkpoints", "leaked instances", "lost events")


@dataclass
class Row:
    """One scenario's outcome. ``job_completed`` None: the cell runs no job (a config
    refused at the door), shown ``n/a``. ``recorded`` False: the test failed before it
    could say (every cell ``?``)."""

    scenario: str
    job_completed: bool | None = None
    lost_checkpoints: int | None = None
    leaked_instances: int | None = None
    lost_events: int | None = None
    seconds: float | None = None
    test: str = ""
    recorded: bool = True

    def cells(self) -> list[str]:
        if not self.recorded:
            return [self.scenario, "?", "?", "?", "?", ""]

        def show(v: object) -> str:
            if isinstance(v, bool):
                return "yes" if v else "NO"
            return "n/a" if v is None else str(v)

        return [self.scenario, show(self.job_completed), show(self.lost_checkpoints),
                show(self.leaked_instances), show(self.lost_events),
                "" if self.seconds is None else f"{self.seconds:.1f}"]

    def clean(self) -> bool:
        return (self.recorded and self.job_completed is not False and self.lost_checkpoints == 0
                and self.leaked_instances == 0 and self.lost_events == 0)


class Matrix:
    """One test's rows. ``row(...)`` records a scenario's outcome (before the test asserts it).

    A row travels in the test's report (``user_properties``, key ``chaos_row``), so the
    table is the same whether the tests ran in this process or in pytest-xdist's workers:
    the root conftest gathers the rows from the reports and prints the table
    (:func:`print_matrix`)."""

    def __init__(self, properties: list[tuple[str, object]], test: str) -> None:
        self._properties = properties
        self._test = test
        self._t0 = time.monotonic()
        self.recorded = 0

    def row(self, scenario: str, *, job_completed: bool | None, lost_checkpoints: int, leaked_instances: int,
            lost_events: int) -> Row:
        row = Row(scenario, job_completed, lost_checkpoints, leaked_instances, lost_events,
                  seconds=time.monotonic() - self._t0, test=self._test)
        self._properties.append((ROW_PROPERTY, asdict(row)))
        self.recorded += 1
        self._t0 = time.monotonic()
        return row


ROW_PROPERTY = "chaos_row"


@pytest.fixture
def matrix(request: pytest.FixtureRequest) -> Iterable[Matrix]:
    properties = request.node.user_properties
    m = Matrix(properties, request.node.nodeid)
    yield m
    if not m.recorded:  # failed (or skipped) before it could say: a row of "?"
        properties.append((ROW_PROPERTY, asdict(Row(request.node.name, test=request.node.nodeid, recorded=False))))


def print_matrix(tr: Any, rows: list[Row]) -> None:
    """The table of ``rows``, one line per scenario, and a line counting the clean ones."""
    head = ["scenario", *COLUMNS, "seconds"]
    table = [head] + [r.cells() for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    tr.write_sep("=", "chaos matrix")
    for i, line in enumerate(table):
        text = "  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths)))
        tr.write_line(text, bold=i == 0, red=i > 0 and not rows[i - 1].clean())
    bad = [r for r in rows if not r.clean()]
    tr.write_line(f"{len(rows)} scenarios, {len(rows) - len(bad)} clean"
                  + (f", {len(bad)} NOT clean: {', '.join(r.scenario for r in bad)}" if bad else ""))


# -- what "lost events" means ---------------------------------------------------------------------

def lost_events(stored: list[Event], seen: Iterable[Event | dict[str, Any]] = ()) -> int:
    """Events lost: each ``seq`` missing from ``1..last`` in ``stored`` (the store's events,
    all of them), plus each event in ``seen`` (what a feed, a follower or a listener was
    shown) that ``stored`` does not hold with the same kind, node and data."""
    by_seq = {e.seq: e for e in stored}
    last = max(by_seq, default=0)
    missing = sum(1 for s in range(1, last + 1) if s not in by_seq)
    for ev in seen:
        d = ev.to_dict() if isinstance(ev, Event) else ev
        got = by_seq.get(d["seq"])
        if got is None or (got.kind, got.node, got.data) != (d["kind"], d["node"], d["data"]):
            missing += 1
    return missing


# -- the in-process harness -------------------------------------------------------------------

class ChaosProvider(RecordingProvider):
    """:class:`~conftest.RecordingProvider` with the cloud's faults.

    ``out_of_capacity``: while true every launch raises :class:`CapacityError` (no
    instance is made). :meth:`reclaim`: the cloud takes an instance away (a spot
    reclaim, a replacement killed while booting): ``describe`` stops listing it.
    :meth:`live`: instances neither terminated by the daemon nor reclaimed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.out_of_capacity = False
        self.refused: list[str] = []  # node ids whose launch met no capacity
        self.reclaimed: set[str] = set()

    async def launch(self, offer, node):  # type: ignore[override]
        if self.out_of_capacity:
            self.refused.append(node.node_id)
            raise CapacityError(f"InsufficientInstanceCapacity: no spot capacity for {offer.key} (chaos)")
        return await super().launch(offer, node)

    def reclaim(self, instance_id: str) -> None:
        self.reclaimed.add(instance_id)

    async def describe(self, tag: str) -> list[Instance]:
        return [i for i in await super().describe(tag) if i.id not in self.reclaimed]

    def live(self) -> list[Instance]:
        return [i for _, i in self.launched if i.id not in self.terminated and i.id not in self.reclaimed]


@dataclass
class Sim:
    """A started Supervisor (no HTTP: the agents' calls are made directly, as the agent
    API's handlers make them) on a ManualClock, with a :class:`ChaosProvider`.

    The helpers play each node's agent and trainer: :meth:`boot` (the agent
    registers), :meth:`beat` (a heartbeat; returns the daemon's reply), :meth:`start`
    / :meth:`commit` / :meth:`complete` (trainer status lines), :meth:`notice` (the
    agent saw an interruption notice), :meth:`exit` (the trainer left the job).
    ``seen``: every event as the supervisor's listeners were told of it.
    """

    sup: Supervisor
    provider: ChaosProvider
    clock: ManualClock
    store: Store
    seen: list[Event] = field(default_factory=list)
    notifier: Any = None  # daemon.feed.notify.Notifier, when the config has sinks
    _attempts: Iterable[int] = field(default_factory=lambda: itertools.count(1))

    def node(self, ordinal: int) -> Node:
        return next(n for n in self.sup.nodes.values() if n.ordinal == ordinal)

    def events(self, kind: str) -> list[Event]:
        return self.store.events(kinds=[kind])

    async def until(self, pred: Callable[[], object], timeout_s: float = UNTIL_TIMEOUT_S, what: str = "") -> None:
        """Wait until ``pred()`` holds, re-checked on every new event and every 20 ms."""
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    await self.sup.wait_for_events(self.store.last_seq(), timeout_s=0.02)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}") from None

    async def launched(self, ordinal: int) -> Node:
        """Wait until node ``ordinal`` has an instance (``launching``)."""
        await self.until(lambda: any(n.ordinal == ordinal and n.state is NodeState.LAUNCHING
                                     for n in self.sup.nodes.values()), what=f"node #{ordinal} launching")
        return self.node(ordinal)

    async def two_running(self) -> tuple[Node, Node]:
        """Nodes 1 and 2 launch and boot, and both are admitted (``running``)."""
        n1, n2 = await self.launched(1), await self.launched(2)
        self.boot(n1)
        self.boot(n2)
        await self.until(lambda: n1.state is NodeState.RUNNING and n2.state is NodeState.RUNNING, what="job start")
        return n1, n2

    def boot(self, node: Node) -> None:
        self.sup.agents.on_register(node)
        self.sup.wake()

    def beat(self, node: Node, *, step: int | None = None, trainer: str = "running") -> dict[str, Any]:
        return self.sup.agents.on_heartbeat(node, {"step": step, "trainer": {"state": trainer}})

    def _status(self, node: Node, event: str, step: int, **fields: Any) -> None:
        line = {"event": event, "time": time.time(), "rank": 0, "step": step, **fields}
        self.sup.intake.on_reports(node, [{"kind": "trainer_status", "line": line}])

    def start(self, nodes: list[Node], step: int, resumed_from: int | None = None) -> str:
        """The nodes' trainers (re)start as one torchrun attempt at world size len(nodes);
        ``nodes[0]`` holds rank 0; every node's agent forwards its own workers' ``started``
        line (rank ``i`` on ``nodes[i]``), rank 0's first."""
        attempt = f"a{next(self._attempts)}"  # type: ignore[call-overload]
        for n in nodes:
            self.beat(n, step=step)
        for rank, n in enumerate(nodes):
            self._status(n, "started", step, attempt=attempt, world_size=len(nodes), resumed_from=resumed_from,
                         rank=rank)
        self.sup.wake()
        return attempt

    def commit(self, node: Node, attempt: str, step: int, *, ids: tuple[str, ...] = (),
               kinds: tuple[str, ...] = (), reason: str = "notice") -> None:
        self._status(node, "checkpoint_committed", step, attempt=attempt, notice_ids=list(ids), kinds=list(kinds),
                     reason=reason, seconds=0.5, bytes=1000)
        self.sup.wake()

    def complete(self, node: Node, attempt: str, step: int) -> None:
        self._status(node, "completed", step, attempt=attempt)
        self.sup.wake()

    def notice(self, node: Node, *, lead_s: float = 120.0) -> str:
        """The node's agent reports an AWS interruption notice (deadline ``lead_s`` from now)."""
        deadline = time.time() + lead_s
        nid = f"{node.id}:{int(deadline):x}"  # the agent's form: <node id>:<hash of the notice body>
        iso = datetime.fromtimestamp(deadline, timezone.utc).isoformat()
        self.sup.intake.on_reports(node, [{"kind": "interruption_notice", "seen_at": time.time(), "deadline": deadline,
                                    "notice": {"id": nid, "provider": "aws", "kind": "interruption",
                                               "action": "terminate", "deadline": iso}}])
        return nid

    def exit(self, node: Node) -> None:
        self.sup.intake.on_reports(node, [{"kind": "trainer_exited", "exit_code": -15}])
        self.beat(node, trainer="exited")
        self.sup.wake()

    def lost_events(self) -> int:
        return lost_events(self.store.events(), self.seen)


def sim_config(tmp_path: Path, **overrides: Any) -> Config:
    """Pool ``chaos``: 1..3 nodes, target 2; valid world sizes 1, 2, 3, 6; two offers
    (zones a and b); timeouts long enough that only what a test does makes a node lost."""
    raw: dict[str, Any] = {
        "pool": {"name": "chaos", "min_nodes": 1, "target_nodes": 2, "max_nodes": 3},
        "job": {"id": "chaos-job", "module": "standin_trainer", "target_steps": 100,
                "global_batch_size": 12, "micro_batch_size": 2},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "reconcile_interval_s": 0.02,
                   "heartbeat_timeout_s": 3600, "launch_timeout_s": 3600, "rejoin_timeout_s": 30},
        "offers": [{"provider": "local", "zone": "local-a"}, {"provider": "local", "zone": "local-b"}],
    }
    for section, values in overrides.items():
        raw.setdefault(section, {})
        if isinstance(values, dict):
            raw[section].update(values)
        else:
            raw[section] = values
    return Config.model_validate(raw)


@pytest.fixture
def make_sim(tmp_path: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Sim]]:
    """``async with make_sim(**config_overrides) as sim:`` a started :class:`Sim`; entered
    again, a restarted daemon on the same store (a new provider, unless ``provider=`` is
    given). With ``notify`` sinks in the config, ``sim.notifier`` is the feed, started
    before the supervisor as ``running_daemon`` does (keys from ``notify_environ``) and
    closed without waiting for a sink (what it has not delivered stays in the outbox)."""

    attempts = itertools.count(1)  # attempt ids go on across a restarted daemon, as a trainer's random ones differ

    @contextlib.asynccontextmanager
    async def make(*, provider: ChaosProvider | None = None, notify_environ: dict[str, str] | None = None,
                   **overrides: Any) -> AsyncIterator[Sim]:
        from daemon.feed.notify import Notifier

        config = sim_config(tmp_path, **overrides)
        store = Store(tmp_path / "state" / "spotvisord.db").open()
        provider = provider or ChaosProvider()
        clock = ManualClock(time.time())
        sup = Supervisor(config, provider=provider, store=store, clock=clock)
        sim = Sim(sup, provider, clock, store, _attempts=attempts)
        sup.subscribe(sim.seen.append)
        notifier = None
        if config.notify:
            notifier = Notifier(store, config.notify, pool=config.pool.name, environ=notify_environ or {})
            sup.subscribe(notifier.wake)
            sim.notifier = notifier
        try:
            if notifier is not None:
                await notifier.start()
            await sup.start(agent_url="http://127.0.0.1:9")
            yield sim
        finally:
            await sup.aclose()
            if notifier is not None:
                await notifier.aclose(drain_timeout_s=0)
            store.close()

    return make
