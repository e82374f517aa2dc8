"""The daemon's core: pool reconciliation, job admission, and the event log.

One :class:`Supervisor` per pool/job. It owns:

- the **store** (events with persisted ``seq``, node rows);
- the **reconcile loop**: observe (``describe(tag)``, heartbeats) → :func:`daemon.control.pool.plan`
  → apply (the only code that calls the provider);
- **admission**: the first nodes start the job together; a node that registers
  while the job runs is admitted only after the job committed a ``rejoin``
  checkpoint and is holding at that step, so growing the world loses no steps
  (DESIGN.md, loop step 7);
- the **agent API** handlers (register, heartbeat, command long-poll, reports) and
  the views that ``spotctl`` reads. The handlers and the heartbeat-interval and
  command-channel logic live in :class:`daemon.controlnode.agent_channel.AgentChannel`, a base
  class of :class:`Supervisor`.

Example (target 3, one worker each): n1 n2 n3 run at world size 3. n2's agent
reports an interruption notice → n2 ``draining`` and the planner launches n4 at
once; the trainer commits at step S, n2 leaves, n1 n3 go on at world size 2 from
S in their running workers (the trainer's in-process shrink). n4 registers → ``checkpoint_requested(rejoin)`` on n1 n3 → they commit
(or find S already committed) and hold → n4 admitted, starts torchrun → world
size 3 resumes from the same step.
"""

from __future__ import annotations

import asyncio
import collections
import random
import secrets
import time
from typing import Any, Awaitable, Callable, Iterator, Mapping

import structlog

from daemon.controlnode import preflight
from daemon.controlnode.agent_channel import FLUSH_GRACE_S, AgentChannel, wait_event
from daemon.config import Config
from daemon.controlnode.gpu_watch import GpuWatch
from daemon.control.lifecycle import ADMITTED, LIVE, TrainerState, leaving, training
from daemon.control.actions import (Action, Admit, Drain, EndRejoin, Launch, MarkLost, NodeView, NoteFirstReady,
                                    PoolState, RejoinView, RequestRejoin, RestartJob, StartJob, Terminate)
from daemon.control.admission import Rules
from daemon.control.policies import DEFAULT_POLICY, RecoveryPolicy, get_policy, lost_from_job
from daemon.control.state import JobView, Rejoin
from daemon.model import Event, EventKind, JobState, Node, NodeState, check_transition
from daemon.controlnode.node_logs import NodeLogs
from daemon.control.offers import History, Offer, capacity_backoff_s
from daemon.control.pool import Desired, Timeouts, plan
from daemon.providers.base import (NODE_TAG, POOL_TAG, AuthError, CapacityError, Instance, NodeSpec, Provider,
                                   ProviderError, QuotaError)
from daemon.control.reports import StatusLine
from daemon.controlnode.store import Store

__all__ = ["Supervisor"]

log = structlog.get_logger("spotvisor.daemon")

_PRICE_REFRESH_S = 300.0
# how long admission waits for a replacement's torchrun to import (trainer "warming",
# daemon/gpunode/launcher.py) before it asks the survivors for the rejoin commit anyway
# (seconds). The import takes 1.5-2.5 s on a warm page cache; the first one on a fresh
# instance's cold disk can take tens of seconds, during which the survivors train on.
PREWARM_WAIT_S = 60.0


class Supervisor(AgentChannel):
    """The control plane for one pool. Constructor does no I/O.

    Lifecycle: ``await start(agent_url=...)`` (opens the store, recovers nodes,
    starts the reconcile loop), then ``aclose()`` (idempotent; stops tasks,
    releases local capacity, closes the store).
    """

    def __init__(self, config: Config, *, store: Store, provider: Provider | None = None,
                 providers: Mapping[str, Provider] | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 policy: RecoveryPolicy | None = None) -> None:
        if provider is None and not providers:
            raise ValueError("Supervisor needs a provider (or providers by name)")
        self.config = config
        self.policy = policy or get_policy(DEFAULT_POLICY)  # how the pool reacts to preemptions
        # offers name their provider; ``provider`` (if given) serves any name not in ``providers``
        self.providers: dict[str, Provider] = dict(providers or {})
        self._default_provider = provider
        self.store = store
        self.clock = clock
        self.pool = config.pool.name
        self.job = JobView()
        self.nodes: dict[str, Node] = {}
        self.desired_nodes = config.pool.target_nodes
        self.target_nodes = config.pool.target_nodes  # the operator's target (spotctl scale), kept in the store
        self.paused = False  # spotctl pause (kept in the store); desired_nodes is 0 while paused
        self._paused_recorded = False  # job_paused recorded: the pause holds no capacity any more
        self.node_logs = NodeLogs()  # each node's trainer.log tail, shipped with its heartbeats
        self.gpu_watch = GpuWatch(threshold_pct=config.daemon.gpu_underutilized_pct,
                                  window_s=config.daemon.gpu_underutilized_window_s)
        self.agent_url: str | None = None
        self._commands: dict[str, list[dict[str, Any]]] = {}  # node id → commands not yet delivered
        self._command_ready: dict[str, asyncio.Event] = {}  # node id → set when a command is queued
        self._command_polls: dict[str, int] = {}  # node id → generation of its newest long-poll
        self._told_start: dict[str, bool] = {}  # node id → the start_trainer it was last told
        self._told_interval: dict[str, float] = {}  # node id → the heartbeat interval it was last told (s)
        self.heartbeat_interval_s = config.agent.heartbeat_interval_s  # the pool's, now (_rescale_heartbeat)
        self._rejoin: Rejoin | None = None
        self._backoff: dict[int, float] = {}
        self._capacity_failures: dict[int, int] = {}  # offer index → failures in a row
        self._avoid_zone: dict[str, float] = {}  # "provider/region/zone" → until (unix s)
        self._rng = rng or random.Random()
        self._prices: dict[int, float | None] = {}
        self._unusable: frozenset[int] = frozenset()  # offers whose GPUs cannot hold the job: never bought
        self._flushes: dict[str, tuple[str, float]] = {}  # notice id → (node id, due: unix s) until its commit
        self._attempt_leader: dict[str, str] = {}  # trainer attempt → the node of its rank 0
        self._held: list[tuple[str, StatusLine, float]] = []  # (node, started/completed line, since) awaiting a commit
        self._to_verify: asyncio.Queue[tuple[str, StatusLine]] = asyncio.Queue()  # reported commits (_verify_commits)
        self._checkpoint_store: Any = None  # the job's store, opened by the first manifest read
        self._confirming: set[int] = set()  # steps whose manifest is being read from the store
        self._confirm_failures: dict[int, int] = {}  # step → failed reads of its manifest
        self._answered: set[str] = set()  # notice and request ids a recorded commit named
        self.reports_dropped: collections.Counter[str] = collections.Counter()  # by report kind
        self._wake = asyncio.Event()
        self._event_added = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listeners: list[Callable[[Event], None]] = []
        self._first_ready_at: float | None = None
        self._released = asyncio.Event()
        self._completed = asyncio.Event()
        self._closed = False
        self._reconciler: asyncio.Task[Any] | None = None
        self._launching: set[str] = set()  # node ids whose provider.launch call is in flight
        self._released_unowned: set[str] = set()  # instance ids _settle_unowned terminated
        self.run_nonce = ""

    # -- lifecycle ------------------------------------------------------------------
    async def start(self, *, agent_url: str) -> None:
        self.agent_url = agent_url
        self.run_nonce = self.store.get("run_nonce") or secrets.token_hex(4)
        self.store.set("run_nonce", self.run_nonce)
        for node in self.store.nodes():
            self.nodes[node.id] = node
        self._pick_up_from_store()
        self._restore_operator_state()
        await self._refresh_prices()
        pre = preflight.at_start(self.config)  # pure: GPU memory per offer, estimated flush per notice window
        self._unusable = pre.unusable
        if pre.note:
            log.info("preflight_skipped", pool=self.pool, note=pre.note)
        for kind, data in pre.events:
            self.record(EventKind(kind), None, **data)
        self._reconciler = self.spawn(self._reconcile_loop(), "reconcile")
        if self.config.daemon.verify_commits:
            self.spawn(self._verify_commits(), "verify-commits")
        self.spawn(self._price_loop(), "prices")
        log.info("supervisor_started", pool=self.pool, nodes=len(self.nodes))

    def _pick_up_from_store(self) -> None:
        """A restarted daemon takes over the job the last one left running.

        Live nodes get a fresh heartbeat clock: their agents kept heartbeating while
        no daemon listened, and the store holds only the heartbeat of their last
        state change, so without this every node would look lost (and be
        terminated) on the first pass. They have ``heartbeat_timeout_s`` to reach
        this daemon. The job is ``running`` if a node runs it, a draining node whose
        trainer has not left yet included (a notice's flush in progress when the last
        daemon died: a ``pending`` job would start a ready replacement at once, while
        the leaving node is still in the job); ``completed`` (pool target 0) if a
        ``job_completed`` event is stored, and already released if a
        ``pool_released`` one is.
        """
        now = self.clock()
        for node in self.nodes.values():
            if node.state in LIVE and node.last_heartbeat is not None:
                node.last_heartbeat = now
        if any(n.state is NodeState.RUNNING or leaving(n) for n in self.nodes.values()):
            self.job.to(JobState.RUNNING)
        steps = [n.step for n in self.nodes.values() if n.step is not None]
        self.job.step = max(steps, default=None)
        for ev in self.store.events(kinds=[EventKind.CHECKPOINT_COMMITTED.value]):
            if isinstance(ev.data.get("step"), int):
                self.job.commit_steps.add(ev.data["step"])
                self._answered.update(i for i in ev.data.get("notice_ids") or () if isinstance(i, str))
        if self.store.events(kinds=[EventKind.JOB_COMPLETED.value], limit=1):
            self.job.to(JobState.COMPLETED)
            self.desired_nodes = 0
            self._completed.set()
            if self.store.events(kinds=[EventKind.POOL_RELEASED.value], limit=1):
                self._released.set()

    async def aclose(self) -> None:
        """Stop the daemon's tasks and close the providers' clients. Idempotent.

        Never terminates an instance: a stop (SIGTERM, ``systemctl restart``) leaves
        the job running and the next daemon picks it up from the store. The one
        exception is by design: the ``local`` provider's instances are this
        process's children and end with it (:mod:`daemon.providers.local`).
        """
        if self._closed:
            return
        self._closed = True
        for ready in self._command_ready.values():  # held long-polls answer now
            ready.set()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=10.0)
            for t in stuck:
                log.error("task_ignored_cancel", task=t.get_name())
        for p in self._all_providers():
            await p.aclose()

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Start an owned task; a crash is logged, never silent; cancelled on aclose()."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"{name}:{self.pool}")
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("task_crashed", task=t.get_name(), error=repr(t.exception()))

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
        # wake every waiter of this generation, then start the next one
        self._event_added.set()
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

    # -- reconcile ----------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except ProviderError as exc:
                log.error("reconcile_provider_error", error=str(exc))
            self._wake.clear()
            await wait_event(self._wake, self.periodic_pass_s())

    def periodic_pass_s(self) -> float:
        """Seconds between two reconcile passes when nothing wakes the loop:
        ``daemon.reconcile_interval_s``, or a quarter of the pool's heartbeat interval when
        that is longer. A pass lists the pool's instances (``describe``: one cloud API call
        per provider, pages of 1,000 instances) and plans over every node; nothing it finds
        is fresher than the heartbeats, so a 1,000-node pool (40 s heartbeats) passes every
        10 s instead of every second (bench/scale.py: the pass was 40 % of the idle daemon's
        CPU). Events (a report, a launch done, spotctl) still wake a pass at once."""
        return max(self.config.daemon.reconcile_interval_s, self.heartbeat_interval_s / 4)

    async def reconcile_once(self) -> None:
        """One pass: observe, decide (the policy on losses, the planner, admission), act, record."""
        now = self.clock()
        members = {n.id for n in self.nodes.values() if n.state in ADMITTED}
        await self._observe_instances()
        await self._after_loss(members, now)
        self._rescale_heartbeat()
        actions = plan(
            Desired(self.desired_nodes, frozenset(self.valid_world_sizes())),
            [self._view(n) for n in self.nodes.values()],
            [self._offer(i) for i in range(len(self.config.offers)) if i not in self._unusable],
            History(backoff_until=dict(self._backoff),
                    avoid_zones=frozenset(z for z, until in self._avoid_zone.items() if until > now)),
            now=now,
            timeouts=Timeouts(
                heartbeat_timeout_s=self.config.daemon.heartbeat_timeout_s,
                launch_timeout_s=self.config.daemon.launch_timeout_s,
            ),
        )
        # Concurrently: with 100 nodes noticed at once, one terminate call after another
        # (~0.5 s each on a cloud) kept the loop from admitting anyone for ~50 s
        # (bench/scale.py). A failing call cancels the rest; the next pass retries them.
        try:
            async with asyncio.TaskGroup() as tg:
                for action in actions:
                    tg.create_task(self._apply(action))
        except ExceptionGroup as group:
            errors = list(_leaves(group))
            if not all(isinstance(e, ProviderError) for e in errors):
                raise
            for extra in errors[1:]:
                log.error("reconcile_provider_error", error=str(extra))
            raise errors[0] from None  # the loop logs it and retries next pass
        await self._after_loss(members, now)  # heartbeat lost (MarkLost) is a loss too
        for action in self.policy.admit(self._state(), self._rules(), now=now):
            self._act(action)
        self._check_paused()
        self._check_flushes()
        self._confirm_held_resumes()
        if (
            self.job.state.is_terminal()
            and self.desired_nodes == 0
            and not self._released.is_set()
            and all(n.state.is_terminal() for n in self.nodes.values())
            and not self._launching  # a launch still in flight may yet return an instance to release
        ):
            # the final bill: every instance is released, so no node's cost grows any more
            self.record(EventKind.POOL_RELEASED, reason=f"job_{self.job.state.value}", **self.spot_cost())
            self._released.set()

    async def _after_loss(self, members: set[str], now: float) -> None:
        """The policy's decision once nodes that were in the job (``members``) have ended."""
        lost = lost_from_job(members, {n.id: n.state for n in self.nodes.values()})
        if not lost:
            return
        actions = self.policy.after_loss(self._state(), lost, now=now)
        for action in actions:
            if isinstance(action, (Launch, Terminate, MarkLost)):
                await self._apply(action)
        for action in actions:
            if not isinstance(action, (Launch, Terminate, MarkLost)):
                self._act(action)

    async def _observe_instances(self) -> None:
        alive: dict[int, set[str]] = {}
        found: list[tuple[Provider, Instance]] = []
        for p in self._all_providers():
            instances = await p.describe(self.pool)
            alive[id(p)] = {i.id for i in instances}
            found += [(p, i) for i in instances]
        await self._settle_unowned(found)
        for node in list(self.nodes.values()):
            if node.state not in LIVE or node.instance_id is None:
                continue
            if node.instance_id in alive.get(id(self.provider_for(node.provider)), set()):
                continue
            if node.state is NodeState.DRAINING:
                self._set_state(node, NodeState.TERMINATED, "instance gone after notice")
                self.record(EventKind.NODE_TERMINATED, node.id, reason="spot_reclaimed")
            else:
                self._set_state(node, NodeState.LOST, "instance gone without notice")
                self.record(EventKind.NODE_LOST, node.id, reason="instance_gone", last_step=node.step)

    async def _settle_unowned(self, found: list[tuple[Provider, Instance]]) -> None:
        """What a daemon killed at any instant leaves behind (DESIGN: Store), settled from
        the pool's instances as the providers list them (their node tag names the node).

        - A node still ``requested`` with no launch call in flight in this process: the
          previous daemon died inside ``provider.launch``. Its instance found → adopted
          (``launching``, ``node_launched`` with ``adopted``); not found → ``failed``
          (``node_launch_failed``, ``error: interrupted``) and the planner launches
          another node, so the pool neither duplicates the node nor waits for it forever.
        - An instance whose node is over (terminated, lost, failed) with no launch in
          flight: a launch that landed after its node was given up, or a terminate the
          dead daemon never sent. Terminated once (retried next pass if that fails), so
          nothing is leaked.

        Example: daemon A records ``node_launch_requested`` for n1 and is SIGKILLed while
        RunInstances is on the wire. Daemon B starts: if EC2 created n1's instance, B
        adopts it; if not, n1 fails and B launches n2; if n1's instance shows up later
        anyway, B terminates it.
        """
        by_node = {i.node_id: (p, i) for p, i in found if i.node_id}
        for node in list(self.nodes.values()):
            if node.state is not NodeState.REQUESTED or node.id in self._launching:
                continue
            hit = by_node.get(node.id)
            if hit is not None:
                node.instance_id = hit[1].id
                self._set_state(node, NodeState.LAUNCHING, "adopted after a daemon restart")
                self.record(EventKind.NODE_LAUNCHED, node.id, instance_id=node.instance_id, offer=node.offer_key,
                            price_usd_h=node.price_usd_h, adopted=True)
            else:
                self._set_state(node, NodeState.FAILED, "launch interrupted by a daemon restart")
                self.record(EventKind.NODE_LAUNCH_FAILED, node.id, error="interrupted", offer=node.offer_key,
                            message="the daemon stopped during the launch call; no instance of this node exists")
        for p, inst in found:
            node = self.nodes.get(inst.node_id)
            if node is None or not node.state.is_terminal() or node.id in self._launching:
                continue
            if inst.id in self._released_unowned:
                continue
            try:
                await p.terminate(inst.id)
            except ProviderError as exc:
                log.warning("unowned_instance_terminate_failed", node_id=node.id, instance_id=inst.id, error=str(exc))
                continue
            self._released_unowned.add(inst.id)
            if node.instance_id is None:  # it cost something after all (Node.hours_held)
                node.instance_id = inst.id
                node.ended_at = self.clock()
                self.store.put_node(node)
            self.record(EventKind.NODE_TERMINATED, node.id, reason="unowned_instance", instance_id=inst.id)

    async def _apply(self, action: Launch | Terminate | MarkLost) -> None:
        if isinstance(action, Launch):
            self._launch(action.offer_index, action.reason)
        elif isinstance(action, MarkLost):
            node = self.nodes[action.node_id]
            self._set_state(node, NodeState.LOST, action.reason)
            self.record(EventKind.NODE_LOST, node.id, reason=action.reason, last_step=node.step)
            if node.instance_id:
                await self.provider_for(node.provider).terminate(node.instance_id)
        elif isinstance(action, Terminate):
            node = self.nodes[action.node_id]
            if node.instance_id:
                await self.provider_for(node.provider).terminate(node.instance_id)
            self._set_state(node, action.final_state, action.reason)
            self.record(EventKind.NODE_TERMINATED, node.id, reason=action.reason, **dict(action.context))

    def _launch(self, offer_index: int, reason: str) -> None:
        ordinal = max((n.ordinal for n in self.nodes.values()), default=0) + 1
        offer = self.config.offers[offer_index]
        node = Node(
            id=f"{self.pool}-{ordinal}", ordinal=ordinal, provider=offer.provider, market=offer.market,
            region=offer.region, zone=offer.zone, instance_type=offer.instance_type, gpus=offer.gpus_per_node,
            price_usd_h=self._prices.get(offer_index) or 0.0, token=secrets.token_urlsafe(24), created_at=self.clock(),
        )
        self.nodes[node.id] = node
        self.store.put_node(node)
        self.record(EventKind.NODE_LAUNCH_REQUESTED, node.id, offer=self._offer(offer_index).key, reason=reason)
        self._launching.add(node.id)
        task = self.spawn(self._launch_call(node, offer_index), f"launch:{node.id}")

        def landed(_: asyncio.Task[Any], node_id: str = node.id) -> None:
            self._launching.discard(node_id)
            self.wake()

        task.add_done_callback(landed)

    async def _launch_call(self, node: Node, offer_index: int) -> None:
        assert self.agent_url is not None
        spec = NodeSpec(node_id=node.id, pool=self.pool, token=node.token, daemon_url=self.agent_url,
                        tags={POOL_TAG: self.pool, NODE_TAG: node.id})
        offer = self._offer(offer_index)
        try:
            inst = await self.provider_for(offer.provider).launch(offer, spec)
        except CapacityError as exc:
            n = self._capacity_failures.get(offer_index, 0) + 1
            self._capacity_failures[offer_index] = n
            wait = capacity_backoff_s(n, self._rng)
            self._backoff[offer_index] = self.clock() + wait
            self._launch_failed(node, str(exc))
            self.record(EventKind.NODE_LAUNCH_FAILED, node.id, error="capacity", message=str(exc), offer=offer.key,
                        backoff_s=round(wait, 1), failures=n)
        except (QuotaError, AuthError) as exc:
            # no retry helps: every offer of this provider is out until the daemon restarts
            for o in range(len(self.config.offers)):
                if self.config.offers[o].provider == offer.provider:
                    self._backoff[o] = float("inf")
            self._launch_failed(node, str(exc))
            log.error("provider_disabled", provider=offer.provider, error=type(exc).__name__, message=str(exc))
            self.record(EventKind.NODE_LAUNCH_FAILED, node.id, error=type(exc).__name__, message=str(exc),
                        offer=offer.key, provider_disabled=offer.provider)
        except ProviderError as exc:
            self._backoff[offer_index] = self.clock() + capacity_backoff_s(1, self._rng)
            self._launch_failed(node, str(exc))
            self.record(EventKind.NODE_LAUNCH_FAILED, node.id, error=type(exc).__name__, message=str(exc),
                        offer=offer.key)
        else:
            self._capacity_failures.pop(offer_index, None)
            node.instance_id = inst.id
            if node.state.is_terminal():
                # released while its launch was in flight (job completed, scale-in): the
                # instance exists only now; give it back at once rather than leak it
                await self.provider_for(offer.provider).terminate(inst.id)
                node.ended_at = self.clock()
                self.store.put_node(node)
                self.record(EventKind.NODE_TERMINATED, node.id, reason="released_while_launching",
                            instance_id=inst.id)
            else:
                self._set_state(node, NodeState.LAUNCHING)
                self.record(EventKind.NODE_LAUNCHED, node.id, instance_id=inst.id, offer=offer.key,
                            price_usd_h=node.price_usd_h)
        self.wake()

    def _launch_failed(self, node: Node, detail: str) -> None:
        """The launch call failed: the node is ``failed`` (unless it was released meanwhile)."""
        if not node.state.is_terminal():
            self._set_state(node, NodeState.FAILED, detail)

    # -- admission --------------------------------------------------------------------------
    def valid_world_sizes(self) -> list[int]:
        return self.config.job.valid_world_sizes(self.config.max_world_size())

    def _state(self) -> PoolState:
        """The pool as one value, for the decisions (:mod:`daemon.control`)."""
        rj = self._rejoin
        return PoolState(
            nodes=tuple(self._view(n) for n in self.nodes.values()), job=self.job.state, paused=self.paused,
            desired_nodes=self.desired_nodes, target_nodes=self.target_nodes,
            rejoin=None if rj is None else RejoinView(rj.id, frozenset(rj.nodes), rj.requested_at, rj.answered),
            first_ready_at=self._first_ready_at)

    def _rules(self) -> Rules:
        return Rules(min_nodes=self.config.pool.min_nodes, valid_world_sizes=frozenset(self.valid_world_sizes()),
                     rejoin_timeout_s=self.config.daemon.rejoin_timeout_s, prewarm_wait_s=PREWARM_WAIT_S)

    def _act(self, action: Action) -> None:
        """Carry out one of the decisions' actions that need no provider call."""
        if isinstance(action, Admit):
            self._start_node(self.nodes[action.node_id], action.reason)
        elif isinstance(action, StartJob):
            self.job.to(JobState.RUNNING)
        elif isinstance(action, NoteFirstReady):
            self._first_ready_at = action.at
        elif isinstance(action, Drain):
            self.drain(self.nodes[action.node_id], action.reason)
        elif isinstance(action, EndRejoin):
            self._end_rejoin(action)
        elif isinstance(action, RequestRejoin):
            self._request_rejoin(action)
        elif isinstance(action, RestartJob):
            log.info("restart_all", pool=self.pool, lost=list(action.lost), reason=action.reason)
            self.job.to(JobState.PENDING)  # the first nodes up start it together, from its newest commit
            self._first_ready_at = None
            self._rejoin = None
            self.wake()
        else:
            raise TypeError(f"not an action for _act: {action!r}")

    def _request_rejoin(self, a: RequestRejoin) -> None:
        rid = f"rejoin-{secrets.token_hex(4)}"
        self._rejoin = Rejoin(rid, set(a.nodes), self.clock())
        for nid in a.nodes:
            self._set_state(self.nodes[nid], NodeState.ADMITTING)
        for nid in a.ask:
            self._send(nid, {"kind": "checkpoint", "reason": "rejoin", "id": rid})
        self.record(EventKind.CHECKPOINT_REQUESTED, None, reason="rejoin", request_id=rid, for_nodes=sorted(a.nodes))

    def request_checkpoint(self, reason: str = "manual") -> str | None:
        """Ask the job to commit a checkpoint at its next step boundary and keep training.

        Returns the request id, or None when no node is running the job's trainer.
        """
        running = [n for n in self.nodes.values() if training(n)]
        if not running:
            return None
        rid = f"{reason}-{secrets.token_hex(4)}"
        for n in running:  # one rank seeing it is enough (the guard all-reduces); all get it
            self._send(n.id, {"kind": "checkpoint", "reason": reason, "id": rid})
        self.record(EventKind.CHECKPOINT_REQUESTED, None, reason=reason, request_id=rid)
        return rid

    def drain(self, node: Node, reason: str) -> None:
        """Make ``node`` leave the job cleanly: its trainer commits a checkpoint and holds,
        then its agent stops torchrun (a daemon-initiated interruption; no cloud notice)."""
        if node.state.is_terminal() or node.state is NodeState.DRAINING:
            return
        rid = f"drain-{secrets.token_hex(4)}"
        # a drain that never completes (a hung trainer) must not block admission
        # forever: past this deadline (+ grace) the planner terminates the node
        node.deadline = self.clock() + self.config.daemon.rejoin_timeout_s
        self._set_state(node, NodeState.DRAINING, reason)
        if node.trainer is TrainerState.RUNNING:
            self._send(node.id, {"kind": "drain", "id": rid})
            self.record(EventKind.CHECKPOINT_REQUESTED, node.id, reason="drain", request_id=rid, why=reason)
        self.wake()

    # -- operator actions (spotctl scale / pause / resume) ---------------------------------------
    def scale(self, nodes: int) -> dict[str, Any]:
        """Set the pool's target size (nodes); kept in the store, so a restarted daemon keeps it.

        Growing launches at once. Shrinking releases nodes not in the job first, then
        drains the youngest running ones (each commits, then leaves): no step is lost.
        While paused, the new target applies at :meth:`resume`.

        Raises:
            ValueError: ``nodes`` outside ``pool.min_nodes..pool.max_nodes``, a world
                size the global batch cannot be split over, or the job is over.
        """
        pool = self.config.pool
        if not pool.min_nodes <= nodes <= pool.max_nodes:
            raise ValueError(f"scale {nodes}: the pool allows {pool.min_nodes}..{pool.max_nodes} nodes "
                             "(pool.min_nodes / pool.max_nodes in the config)")
        if self.job.state.is_terminal():
            raise ValueError(f"the job is {self.job.state.value}: there is nothing to scale")
        ok = self.config.valid_node_counts()  # None for mixed offers: admission decides the world size
        if ok is not None and nodes not in ok:
            g, job = self.config.offers[0].gpus_per_node, self.config.job
            raise ValueError(f"scale {nodes}: world size {nodes * g} cannot share global batch "
                             f"{job.global_batch_size} in micro batches of {job.micro_batch_size} "
                             f"(node counts that can: {', '.join(map(str, ok)) or 'none'})")
        old, self.target_nodes = self.target_nodes, nodes
        if nodes != old:
            self.store.set("target_nodes", nodes)
        draining: list[str] = []
        if not self.paused and not (nodes == old and self.desired_nodes == nodes):  # else: nothing changes
            self.desired_nodes = nodes
            # the planner releases surplus nodes not in the job; running ones leave by a drain
            in_job = sorted((n for n in self.nodes.values() if n.state in ADMITTED and not n.replacing),
                            key=lambda n: -n.ordinal)
            if nodes < old:  # no half-done grow: withdraw its checkpoint request
                self._end_rejoin_for("scale_in")
            for n in in_job[: max(0, len(in_job) - nodes)]:
                self.drain(n, "scale_in")
                draining.append(n.id)
        self.record(EventKind.POOL_SCALED, None, old=old, new=nodes, paused=self.paused, draining=draining)
        if nodes != old:  # the same target again changes nothing: no pass over every node for it
            self.wake()
        return {"target_nodes": nodes, "old": old, "paused": self.paused, "draining": draining}

    def pause(self) -> dict[str, Any]:
        """Commit a checkpoint and release every node, keeping the job (its checkpoints,
        its target size); :meth:`resume` relaunches it from the last commit.

        Every running node is drained: its trainer commits at the next step boundary
        (one commit answers all the nodes' requests) and leaves; nodes not in the job
        are released at once. ``job_pausing`` now, ``job_paused`` once no capacity is
        held. The pause is kept in the store: a restarted daemon stays paused.

        Raises:
            ValueError: already paused, or the job is over.
        """
        if self.job.state.is_terminal():
            raise ValueError(f"the job is {self.job.state.value}: there is nothing to pause")
        if self.paused:
            raise ValueError("the job is already paused (spotctl resume relaunches it)")
        self.paused, self._paused_recorded = True, False
        self.store.set("paused", True)
        self.job.to(JobState.PAUSED)
        self.desired_nodes = 0
        running = sorted((n for n in self.nodes.values() if n.state in ADMITTED), key=lambda n: n.ordinal)
        self._end_rejoin_for("pause")
        committing = [n.id for n in running if n.trainer is TrainerState.RUNNING]
        for n in running:
            self.drain(n, "pause")
        self.record(EventKind.JOB_PAUSING, None, step=self.job.step, last_commit_step=self.job.last_commit_step,
                    draining=[n.id for n in running], committing=committing)
        self.wake()
        return {"state": "pausing", "draining": [n.id for n in running], "committing": committing}

    def resume(self) -> dict[str, Any]:
        """Relaunch a paused job to its target size. It resumes from its last committed
        checkpoint (the trainer always starts from the newest verified one).

        Raises:
            ValueError: the job is not paused, or the pause still holds nodes (their
                commit may not be written yet: resume once ``job_paused`` is recorded).
        """
        if self.job.state.is_terminal() or not self.paused:
            raise ValueError(f"the job is {self.job.state.value}, not paused: there is nothing to resume")
        live = [n.id for n in sorted(self.nodes.values(), key=lambda n: n.ordinal) if not n.state.is_terminal()]
        if live:
            raise ValueError(f"the pause is still releasing {', '.join(live)}: resume once they are gone "
                             "(spotctl status, or the job_paused event)")
        self.paused = False
        self.store.set("paused", False)
        self.job.to(JobState.PENDING)  # the first nodes up start the job together
        self._first_ready_at = None
        self.desired_nodes = self.target_nodes
        self.record(EventKind.JOB_UNPAUSED, None, target_nodes=self.target_nodes,
                    resume_from_step=self.job.last_commit_step)
        self.wake()
        return {"state": "pending", "target_nodes": self.target_nodes, "resume_from_step": self.job.last_commit_step}

    def _check_paused(self) -> None:
        if (self.paused and not self._paused_recorded and not self.job.state.is_terminal()
                and all(n.state.is_terminal() for n in self.nodes.values())):
            self._paused_recorded = True
            self.record(EventKind.JOB_PAUSED, None, last_commit_step=self.job.last_commit_step)

    def _restore_operator_state(self) -> None:
        """``spotctl scale`` and ``pause`` outlive a daemon restart (kept in the store)."""
        pool = self.config.pool
        target = self.store.get("target_nodes")
        if isinstance(target, int):
            self.target_nodes = min(max(target, pool.min_nodes), pool.max_nodes)
            if self.target_nodes != target:
                log.warning("scaled_target_clamped", stored=target, target_nodes=self.target_nodes)
        self.paused = bool(self.store.get("paused", False)) and not self.job.state.is_terminal()
        if self.paused:
            self.job.to(JobState.PAUSED)
            self._paused_recorded = all(n.state.is_terminal() for n in self.nodes.values())
        if not self.job.state.is_terminal():
            self.desired_nodes = 0 if self.paused else self.target_nodes

    def _check_flushes(self) -> None:
        """A notice whose commit has not come by its deadline (+ grace) is its own event,
        ``checkpoint_flush_timed_out``, so a hung flush never silences the feed; the job
        will resume from ``last_commit_step``."""
        if self.job.state.is_terminal():
            self._flushes.clear()
            return
        now = self.clock()
        for nid, (node_id, due) in list(self._flushes.items()):
            if now >= due:
                del self._flushes[nid]
                self.record(EventKind.CHECKPOINT_FLUSH_TIMED_OUT, node_id, notice_id=nid,
                            overdue_s=round(now - due + FLUSH_GRACE_S, 1),
                            last_commit_step=self.job.last_commit_step)

    def _end_rejoin(self, a: EndRejoin) -> None:
        """End the grow in flight: withdraw its request from the nodes' notice files and put
        the nodes that waited for it back in ``ready``."""
        if self._rejoin is None or self._rejoin.id != a.request_id:
            return
        if a.reason != "answered":
            log.info("rejoin_ended", request_id=a.request_id, reason=a.reason)
        for nid in a.withdraw_from:
            self._send(nid, {"kind": "cancel", "id": a.request_id})
        for nid in a.back_to_ready:
            self._set_state(self.nodes[nid], NodeState.READY, "rejoin deferred")
        self._rejoin = None

    def _end_rejoin_for(self, reason: str) -> None:
        """Withdraw the grow in flight, if any, from every node in the job (scale-in, pause)."""
        if self._rejoin is not None:
            s = self._state()
            self._end_rejoin(EndRejoin(self._rejoin.id, reason, withdraw_from=tuple(n.id for n in s.in_state(*ADMITTED)),
                                       back_to_ready=tuple(n.id for n in s.in_state(NodeState.ADMITTING))))

    def _start_node(self, node: Node, reason: str) -> None:
        self._set_state(node, NodeState.RUNNING)
        self.record(EventKind.NODE_ADMITTED, node.id, reason=reason)

    # -- job spec -------------------------------------------------------------------------------
    def job_spec(self, node: Node) -> dict[str, Any]:
        """The torchrun command line (after ``python``) and environment for ``node``."""
        c, rdzv, job = self.config, self.config.rendezvous, self.config.job
        rdzv_conf = ",".join(
            [
                "is_host=false",  # the rendezvous store runs on the control node, never on a spot node
                f"last_call_timeout={rdzv.last_call_timeout_s:g}",
                f"keep_alive_interval={rdzv.keep_alive_interval_s:g}",
                f"keep_alive_max_attempt={rdzv.keep_alive_max_attempt}",
                f"join_timeout={rdzv.join_timeout_s:g}",
            ]
        )
        argv = [
            "-m", "torch.distributed.run",
            f"--nnodes={c.pool.min_nodes}:{c.pool.max_nodes}",
            f"--nproc-per-node={node.gpus}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv.host}:{rdzv.port}",
            f"--rdzv-id={job.id}-{self.run_nonce}",
            f"--rdzv-conf={rdzv_conf}",
            f"--max-restarts={rdzv.max_restarts}",
            "--monitor-interval=0.5",
            "-m", job.module,
            "--target-steps", str(job.target_steps),
            "--global-batch-size", str(job.global_batch_size),
            "--micro-batch-size", str(job.micro_batch_size),
            "--checkpoint-uri", c.checkpoint_uri(),
            "--checkpoint-interval", str(job.checkpoint_interval_steps),
            "--hold-timeout-s", f"{job.hold_timeout_s:g}",
            *job.args,
        ]
        env = {
            # pytorch#135712: a node joining a surviving group otherwise deadlocks (ELASTIC.md)
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # the survivors of a notice re-form their group here, in-process (trainer/runtime.py)
            "SPOTVISOR_RDZV_ENDPOINT": f"{rdzv.host}:{rdzv.port}",
        }
        if job.s3_endpoint_url:
            env["SPOTVISOR_S3_ENDPOINT_URL"] = job.s3_endpoint_url
        if job.oss_endpoint:
            env["SPOTVISOR_OSS_ENDPOINT"] = job.oss_endpoint
        return {"argv": argv, "env": env}

    # -- views ------------------------------------------------------------------------------------
    def spot_cost(self) -> dict[str, Any]:
        """What the pool's instances cost so far: ``cost_usd`` = Σ over nodes of
        ``price_usd_h`` (the spot price at launch, USD/hour) × hours held
        (:meth:`Node.hours_held`: launch request → terminal state, or now);
        ``node_hours``; ``instances`` (nodes that got an instance)."""
        now = self.clock()
        held = [n for n in self.nodes.values() if n.instance_id is not None]
        return {
            "cost_usd": round(sum(n.price_usd_h * n.hours_held(now) for n in held), 6),
            "node_hours": round(sum(n.hours_held(now) for n in held), 6),
            "instances": len(held),
        }

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "pool": {"name": self.pool, "target_nodes": self.target_nodes, "desired_nodes": self.desired_nodes,
                     "min_nodes": self.config.pool.min_nodes, "max_nodes": self.config.pool.max_nodes,
                     "paused": self.paused},
            "job": {
                "id": self.config.job.id, "state": self.job.state.value, "step": self.job.step,
                "target_steps": self.config.job.target_steps, "world_size": self.job.world_size,
                "last_commit_step": self.job.last_commit_step, "last_commit_time": self.job.last_commit_time,
                "restarts": max(0, len(self.job.attempts) - 1 - self.job.resizes_in_process),
                "resizes_in_process": self.job.resizes_in_process,
            },
            "nodes": [
                {
                    "id": n.id, "provider": n.provider, "zone": n.zone, "instance_type": n.instance_type,
                    "gpus": n.gpus, "state": n.state.value, "instance_id": n.instance_id,
                    "uptime_s": None if n.ready_at is None or n.state.is_terminal() else round(now - n.ready_at, 1),
                    "price_usd_h": n.price_usd_h, "step": n.step, "detail": n.detail,
                }
                for n in sorted(self.nodes.values(), key=lambda n: n.ordinal)
            ],
        }

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def provider(self) -> Provider:
        """The provider of the local pool (chaos hooks), else the default one."""
        return self.providers.get("local") or self._default_provider or next(iter(self.providers.values()))

    def provider_for(self, name: str) -> Provider:
        p = self.providers.get(name) or self._default_provider
        if p is None:
            raise ProviderError(f"no provider {name!r} is configured (add providers.{name})")
        return p

    def _all_providers(self) -> list[Provider]:
        seen: dict[int, Provider] = {}
        for p in [*self.providers.values(), *([self._default_provider] if self._default_provider else [])]:
            seen.setdefault(id(p), p)
        return list(seen.values())

    async def _refresh_prices(self) -> None:
        for i in range(len(self.config.offers)):
            o = self.config.offers[i]
            try:
                self._prices[i] = await self.provider_for(o.provider).spot_price(self._offer(i))
            except ProviderError as exc:
                log.warning("spot_price_failed", offer=self._offer(i).key, error=str(exc))

    async def _price_loop(self) -> None:
        while True:
            await asyncio.sleep(_PRICE_REFRESH_S)  # a refresh period, not synchronisation
            await self._refresh_prices()

    def _set_state(self, node: Node, state: NodeState, detail: str = "") -> None:
        if state.is_terminal() and node.ended_at is None and not node.state.is_terminal():
            check_transition(node.state, state)  # refused: raise before anything changes
            node.ended_at = self.clock()  # written with the state change: the node's cost stops here
        self.store.set_node_state(node, state, detail=detail)
        if state.is_terminal():
            self._told_interval.pop(node.id, None)
        self._poke(node.id)  # its start/stop decision may have changed: answer its long-poll

    def _offer(self, i: int) -> Offer:
        o = self.config.offers[i]
        return Offer(index=i, provider=o.provider, region=o.region, zone=o.zone, instance_type=o.instance_type,
                     gpus_per_node=o.gpus_per_node, price_usd_h=self._prices.get(i),
                     max_price_usd_h=o.max_price_usd_h, on_demand=o.market == "on_demand")

    def _view(self, n: Node) -> NodeView:
        return NodeView(id=n.id, state=n.state, gpus=n.gpus, created_at=n.created_at,
                        last_heartbeat=n.last_heartbeat, deadline=n.deadline, replacing=n.replacing,
                        trainer=n.trainer, ordinal=n.ordinal, ready_at=n.ready_at,
                        # not told by this daemon (it restarted): what it would be told now
                        heartbeat_interval_s=self._told_interval.get(n.id, self.heartbeat_interval_s))


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    """The exceptions of a (nested) exception group, depth first."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
