"""The control plane of one pool: observe, decide, act, record.

One :class:`Supervisor` per pool/job. It owns the pool's state (its nodes, the
:class:`~daemon.control.state.JobView`, the operator's target, the grow in flight) and
the **reconcile loop**; each pass:

1. **observe** — the providers list the pool's instances (:meth:`Fleet.observe`);
   heartbeats and reports arrive between passes (:mod:`.agent_link`, :mod:`.intake`);
2. **decide** — pure functions of one :class:`~daemon.control.actions.PoolState`:
   the recovery policy on nodes lost from the job
   (:meth:`~daemon.control.policies.RecoveryPolicy.after_loss`), the planner
   (:func:`daemon.control.pool.plan`) and admission
   (:meth:`~daemon.control.policies.RecoveryPolicy.admit`), then the stall check (:mod:`daemon.control.stall`);
3. **act** — provider calls (:class:`~daemon.controlnode.fleet.Fleet`), agent
   commands (:meth:`AgentLink.send`) and state changes, through :class:`Actuator`;
4. **record** — every change is a node row and an event in the store.

**One owner of state**: the supervisor is the only code that changes its fields, the
nodes' record and the job's lifecycle. Its parts read it through
:class:`~daemon.controlnode.core.Core` (read-only) and hand it what should change:
a decision (:mod:`daemon.control.actions`) or a change (:mod:`daemon.control.changes`)
through :meth:`Supervisor.act`, a node's state through :meth:`Supervisor.set_state`,
a new node through :meth:`Supervisor.add_node`.

The notice → replacement path: an agent reports a notice (:meth:`Intake.on_reports`) →
:func:`~daemon.control.reactions.on_notice` returns ``Leave`` (``draining``, not
:data:`~daemon.control.lifecycle.COUNTED`) → the pass plans a ``Launch`` → the commit
arrives (:class:`JobTracker`), the node is ``Terminate``-d as ``drained`` → the
replacement registers, admission asks for a rejoin commit, then ``Admit``-s it. A pass
also takes a whole-job migration's next step (:class:`Migrator`, one domain per job)."""

from __future__ import annotations

import asyncio
import collections
import random
import secrets
import time
from typing import Any, Awaitable, Callable, Mapping

import structlog

from daemon.config import Config
from daemon.control import actions as a
from daemon.control.admission import Rules
from daemon.control.changes import Change
from daemon.control.lifecycle import ADMITTED, NodeState, check_transition
from daemon.control.policies import RecoveryPolicy, get_policy, lost_from_job
from daemon.control.pool import Desired, Timeouts, plan
from daemon.control.reports import Limits
from daemon.control.state import JobView, Rejoin
from daemon.controlnode.actuator import Actuator
from daemon.controlnode.agent_link import AgentLink
from daemon.controlnode.cloud_check import CheckResult
from daemon.controlnode.code_delivery import CodeDelivery
from daemon.controlnode.core import stop_tasks, wait_event
from daemon.controlnode.fleet import Fleet
from daemon.controlnode.intake import Intake
from daemon.controlnode.job_life import JobLife
from daemon.controlnode.job_tracker import JobTracker
from daemon.controlnode.jobspec import job_spec
from daemon.controlnode.migrator import Migrator
from daemon.controlnode.operator import Operator
from daemon.controlnode.rendezvous_watch import RendezvousWatch
from daemon.controlnode.stall_watch import StallWatch
from daemon.controlnode.store import Store
from daemon.controlnode.views import spot_cost, status
from daemon.model import Event, EventKind, JobState, Node
from daemon.providers.base import Provider, ProviderError

__all__ = ["Supervisor", "PREWARM_WAIT_S"]

log = structlog.get_logger("spotvisor.daemon")

# how long admission waits for a replacement's torchrun to import (trainer "warming", daemon/gpunode/launcher.py)
# before it asks the survivors for the rejoin commit anyway (seconds). The import takes 1.5-2.5 s on a warm page
# cache; the first one on a fresh instance's cold disk can take tens of seconds, during which the survivors train on.
PREWARM_WAIT_S = 60.0


class Supervisor:
    """The control plane for one pool. Constructor does no I/O.

    Lifecycle: ``await start(agent_url=..., job_secrets=...)`` (loads the store, recovers nodes, starts the reconcile
    loop), then ``aclose()`` (idempotent; stops tasks, closes the providers' clients). Parts: ``fleet``
    (provider calls), ``agents`` (register, heartbeat, commands), ``intake`` (reports), ``tracker`` (the
    trainer's status lines), ``operator`` (spotctl's verbs), ``stall`` (a job making no progress).
    """

    def __init__(self, config: Config, *, store: Store, provider: Provider | None = None,
                 providers: Mapping[str, Provider] | None = None, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None, policy: RecoveryPolicy | None = None,
                 on_crash: Callable[[asyncio.Task[Any], BaseException], bool] | None = None) -> None:
        self.config, self.store, self.clock, self.pool = config, store, clock, config.pool.name
        self.on_crash = on_crash  # an owned task's crash: True when handled (HA: Deposed ends the daemon)
        self.policy = policy or get_policy(config.spending_policy())  # recovery
        rng = rng or random.Random()
        self.job = JobView()
        self.nodes: dict[str, Node] = {}
        self.target_nodes = config.pool.target_nodes  # the operator's target (spotctl scale), kept in the store
        self.desired_nodes = config.pool.target_nodes  # 0 while paused or once the job is over
        self.paused = False  # spotctl pause (kept in the store)
        self.rejoin: Rejoin | None = None  # the grow in flight
        self.first_ready_at: float | None = None
        self.agent_url: str | None = None  # from start(): the agents' endpoint,
        self.agent_ca_pem: str | None = None  # and the CA the nodes trust for it (None: plain HTTP)
        self.run_nonce, self.secrets = "", dict[str, str]()  # secrets: the job's, from start(); in memory only
        self.reports_dropped: collections.Counter[str] = collections.Counter()  # by report kind
        self.fleet = Fleet(self, providers=providers, provider=provider, rng=rng)
        self.tracker = JobTracker(self)
        self.agents = AgentLink(self, rng=rng, on_step=self.tracker.on_step, leader=self.tracker.running_leader)
        self.operator, self.code = Operator(self), CodeDelivery(self, terminate=self.fleet.apply)
        self.life = JobLife(self, logs=self.agents.node_logs, launching=lambda: bool(self.fleet.launching))  # fail/down
        self.intake = Intake(self, seen=self.agents.seen, on_status=self.tracker.on_status, code=self.code,
                             published_at=self.fleet.notice_published_at, redact=self.agents.node_logs.redact,
                             failure_count=self.life.workers_failed_count)
        self.actuator = Actuator(self, provider_call=self.fleet.apply, drain=self.operator.drain,  # the apply arm
                                 avoid_zone=self.fleet.avoid_zone_of, watch_flush=self.tracker.watch_flush)
        self.migrator = Migrator(self, fleet=self.fleet, drain=self.operator.drain, policy=self.policy)
        self.placement, self.domain_of = self.migrator.placement, self.migrator.placement.domain_of  # a node's domain
        self.rendezvous = RendezvousWatch(self)  # does the job's rendezvous store answer
        self.stall = StallWatch(self, migrating=self.migrator.holds_job, store_alarm=self.rendezvous.status)
        self._wake, self._event_added, self._released, self._completed = (asyncio.Event() for _ in range(4))
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listeners: list[Callable[[Event], None]] = [self.migrator.on_event, self.stall.on_event, self.life.on_event]
        self._closed = False
        self._reconciler: asyncio.Task[Any] | None = None

    # -- lifecycle ------------------------------------------------------------------
    async def start(self, *, agent_url: str, agent_ca_pem: str | None = None,
                    job_secrets: Mapping[str, str] | None = None,
                    checked: list[CheckResult] | None = None) -> None:  # checked: an HA standby's run
        self.placement.refuse_a_late_start(self.clock())  # DeadlineError: a new job that cannot meet it
        self.agent_url, self.agent_ca_pem, self.secrets = agent_url, agent_ca_pem, dict(job_secrets or {})
        self.agents.node_logs.mask(self.secrets.values())  # a trainer that prints one: spotctl tail shows ***
        self.run_nonce = self.store.get("run_nonce") or secrets.token_hex(4)
        self.store.set("run_nonce", self.run_nonce)
        self.nodes.update((node.id, node) for node in self.store.nodes())
        if self.tracker.pick_up():
            self._released.set()
        self.operator.restore()
        self.life.restore()  # a failed or cancelled job stays so
        self.migrator.restore()
        await self.migrator.capacity.read_past()  # the other pools' records, before the first decision
        await self.fleet.refresh_prices()
        await self.fleet.preflight(checked)  # and the cloud check: nothing is bought before it ran, nor what it failed
        await self.code.publish()  # job.workdir packed, uploaded and pinned for this run (WorkdirError)
        self._reconciler = self.spawn(self._reconcile_loop(), "reconcile")
        if self.config.daemon.verify_commits:
            self.spawn(self.tracker.verify_commits(), "verify-commits")
        self.spawn(self.fleet.price_loop(), "prices")
        self.spawn(self.rendezvous.run(), "rendezvous-probe")
        log.info("supervisor_started", pool=self.pool, nodes=len(self.nodes), policy=self.policy.name)

    async def aclose(self) -> None:
        """Stop the daemon's tasks and close the providers' clients. Idempotent. Never terminates an
        instance: a stop (SIGTERM, ``systemctl stop``) leaves the job running, and billing, for the next
        daemon (``spotctl down`` ends it: :mod:`.job_life`); the ``local`` provider's instances, its children, end with it."""
        if self._closed:
            return
        self._closed = True
        self.agents.close()  # held long-polls answer now
        await stop_tasks(list(self._tasks))  # cancelled again while one runs on, 10 s at most
        for p in self.fleet.all_providers():
            await p.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Start an owned task; a crash is logged, never silent; cancelled on aclose()."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"{name}:{self.pool}")
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and (exc := t.exception()) is not None and not (self.on_crash and self.on_crash(t, exc)):
                log.error("task_crashed", task=t.get_name(), error=repr(exc))

        task.add_done_callback(done)
        return task

    # -- events -----------------------------------------------------------------------
    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def record(self, kind: EventKind | str, node: str | None = None, **data: Any) -> Event:
        """Append an event to the store (assigns ``seq``) and tell listeners."""
        ev = self.store.append_event(kind.value if isinstance(kind, EventKind) else kind, node, data)
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception as exc:  # a listener must not break the daemon
                log.warning("listener_failed", error=repr(exc))
        self._event_added.set()  # wake every waiter of this generation, then start the next one
        self._event_added = asyncio.Event()
        return ev

    async def wait_for_events(self, since: int, timeout_s: float) -> None:
        """Return when an event newer than ``since`` exists, or after ``timeout_s``."""
        while self.store.last_seq() <= since:
            if not await wait_event(self._event_added, timeout_s):
                return

    async def wait_completed(self) -> None:
        await self._completed.wait()

    async def wait_released(self) -> None:
        await self._released.wait()

    def wake(self) -> None:
        self._wake.set()

    def is_healthy(self) -> bool:
        """True while the reconcile loop runs (what the systemd watchdog vouches for)."""
        return self._reconciler is not None and not self._reconciler.done()

    def job_completed(self) -> None:
        """The job reached its target step: the pool holds nothing from now on."""
        self.desired_nodes = 0
        self._completed.set()
        self.wake()

    # -- the loop ---------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        while True:
            try:
                await self.reconcile_once(listing_age_s=self.periodic_pass_s())
            except ProviderError as exc:
                log.error("reconcile_provider_error", error=str(exc))
            self._wake.clear()
            await wait_event(self._wake, self.periodic_pass_s())

    def periodic_pass_s(self) -> float:
        """Seconds between two passes when nothing wakes the loop: ``daemon.reconcile_interval_s``,
        or a quarter of the pool's heartbeat interval when that is longer (a pass plans over
        every node; nothing it finds is fresher than the heartbeats: bench/scale.py), and the
        least age of a listing a pass takes anew. Events (a report, a launch done) wake a pass."""
        return max(self.config.daemon.reconcile_interval_s, self.agents.heartbeat_interval_s / 4)

    async def reconcile_once(self, *, listing_age_s: float = 0.0) -> None:
        """One pass: observe (a listing younger than ``listing_age_s`` stands), decide, act, record."""
        now = self.clock()
        members = {n.id for n in self.nodes.values() if n.state in ADMITTED}
        await self.fleet.observe(listing_age_s)
        await self._after_loss(members, now)
        self.agents.rescale_heartbeat()
        await self.actuator.act_all(self.migrator.check(now))  # a move's next step; nodes outside the job's domain
        d = self.config.daemon
        build = self.migrator.build_domain  # the job's domain; a migration's target while it moves
        await self.actuator.act_all(plan(
            Desired(self.desired_nodes, frozenset(self.config.valid_world_sizes())), self.state().nodes,
            self.code.offers(self.placement.offers_in(build)), self.fleet.history(now), now=now,
            timeouts=Timeouts(heartbeat_timeout_s=d.heartbeat_timeout_s, launch_timeout_s=d.launch_timeout_s),
            domain=build))
        await self._after_loss(members, now)  # heartbeat lost (MarkLost) is a loss too
        await self.actuator.act_all(self.policy.admit(self.state(), self._rules(), now=now))
        await self.actuator.act_all(self.stall.check(now))  # no progress: job_stalled, and a restart in place
        self.life.check(now)  # a job given up (failed), a down's end, their pool_released
        self.operator.check_paused()
        self.tracker.check_flushes()
        self.tracker.confirm_held_resumes()
        if (self.job.state is JobState.COMPLETED and self.desired_nodes == 0 and not self._released.is_set()
                and all(n.state.is_terminal() for n in self.nodes.values())
                and not self.fleet.launching):  # a launch in flight may yet return an instance to release
            # the final bill: every instance is released, so no node's cost grows any more
            self.record(EventKind.POOL_RELEASED, reason=f"job_{self.job.state.value}", **self.spot_cost())
            self._released.set()

    async def _after_loss(self, members: set[str], now: float) -> None:
        """The policy's decision once nodes that were in the job (``members``) have ended."""
        if lost := lost_from_job(members, {n.id: n.state for n in self.nodes.values()}):
            await self.actuator.act_all(self.policy.after_loss(self.state(), lost, now=now))

    def act(self, action: a.Action | Change) -> None:
        """Apply one decision that needs no provider call, or one change a part asks for
        (:mod:`daemon.control.changes`): the supervisor's apply arm (:class:`Actuator`).
        Raises TypeError: neither."""
        self.actuator.act(action)

    # -- state ------------------------------------------------------------------------------
    def set_state(self, node: Node, state: NodeState, detail: str = "") -> None:
        """Move ``node`` through its lifecycle and write it through. Raises IllegalTransition."""
        if state.is_terminal() and node.ended_at is None and not node.state.is_terminal():
            check_transition(node.state, state)  # refused: raise before anything changes
            node.ended_at = self.clock()  # written with the state change: the node's cost stops here
        self.store.set_node_state(node, state, detail=detail)
        if state.is_terminal():
            self.agents.forget(node.id)
        self.agents.poke(node.id)  # its start/stop decision may have changed: answer its long-poll

    def add_node(self, node: Node) -> None:
        """A node joins the pool's record (a launch requested): kept, and written through."""
        self.nodes[node.id] = node
        self.store.put_node(node)

    def state(self) -> a.PoolState:
        """The pool as one value, for the decisions (:mod:`daemon.control`)."""
        rj = self.rejoin
        return a.PoolState(
            nodes=tuple(self.view(n) for n in self.nodes.values()), job=self.job.state, paused=self.paused,
            desired_nodes=self.desired_nodes, target_nodes=self.target_nodes, first_ready_at=self.first_ready_at,
            rejoin=None if rj is None else a.RejoinView(rj.id, frozenset(rj.nodes), rj.requested_at, rj.answered),
            domain=self.migrator.domain, attempt=self.job.attempt or "", world_size=self.job.world_size or 0)

    def view(self, n: Node) -> a.NodeView:
        domain = self.domain_of(n)
        return a.NodeView(id=n.id, state=n.state, gpus=n.gpus, created_at=n.created_at, domain=domain,
                          held=self.migrator.held(domain), market=n.market, attempt=self.tracker.attempt_of(n.id),
                          last_heartbeat=n.last_heartbeat, deadline=n.deadline, replacing=n.replacing, trainer=n.trainer,
                          ordinal=n.ordinal, ready_at=n.ready_at, launch_timeout_s=self.config.launch_timeout_s(n.offer_key),
                          reports_owed_since=self.agents.reports_owed_since(n.id),
                          heartbeat_interval_s=self.agents.interval_of(n.id))

    def _rules(self) -> Rules:
        pool, job = self.config.pool, self.config.job
        return Rules(pool.min_nodes, frozenset(self.config.valid_world_sizes()), self.config.daemon.rejoin_timeout_s,
                     PREWARM_WAIT_S, grow_in_process=job.grow == "in_process", rejoin_commit=job.command is None)

    def limits(self) -> Limits:
        return Limits(max_step=self.config.job.target_steps, max_world_size=self.config.max_world_size())

    def drop(self, node: Node, kind: str, problem: str, what: Any) -> None:
        """A report (or a heartbeat's field) that cannot be used: one log line, one count in
        :attr:`reports_dropped` (``spotvisor_agent_reports_dropped_total``)."""
        self.reports_dropped[kind] += 1
        log.warning("agent_report_dropped", node_id=node.id, kind=kind, problem=problem, report=repr(what)[:200])

    def send(self, node_id: str, command: dict[str, Any]) -> None:
        self.agents.send(node_id, command)

    def job_spec(self, node: Node) -> dict[str, Any]:  # with the job's secrets: for the agent channel only
        return job_spec(self.config, node, self.run_nonce, self.domain_of(node), self.secrets, code=self.code.pin)

    @property
    def domain(self) -> str:
        """The placement domain the job runs in (:class:`Migrator`)."""
        return self.migrator.domain

    # -- views --------------------------------------------------------------------------------
    def spot_cost(self) -> dict[str, Any]:
        return spot_cost(self.nodes.values(), self.clock())

    def status(self) -> dict[str, Any]:
        return status(self.config, self.job, self.nodes.values(), target_nodes=self.target_nodes,
                      desired_nodes=self.desired_nodes, paused=self.paused, now=self.clock(), code=self.code.status(),
                      placement=self.migrator.status(), domain_of=self.domain_of, checks=self.fleet.checks.status(),
                      rendezvous=self.rendezvous.status())
