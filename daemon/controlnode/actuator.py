"""The supervisor's apply arm: what its decisions and its parts' changes do that is not
a provider call — agent commands, node and job state, the supervisor's own fields and
the part of them the store keeps, and their events.

Every decision (:mod:`daemon.control.actions`) and every change a part asks for
(:mod:`daemon.control.changes`) comes in through :meth:`Actuator.act` (the supervisor's
``act``), which looks its type up in one table. :meth:`Actuator.act_all` carries out a
decision's list: the provider calls (launch, terminate, mark lost) go to
:class:`~daemon.controlnode.fleet.Fleet`, concurrently and first, the rest here in
order. Besides the supervisor, this is the one module that writes the supervisor's
fields (:class:`Owner`); ``tests/test_layout.py`` checks it.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Awaitable, Callable, Protocol

import structlog

from daemon.control import actions as a
from daemon.control import changes as c
from daemon.control import migration
from daemon.control.job import JobProgress
from daemon.control.lifecycle import JobState, NodeState
from daemon.control.state import Rejoin
from daemon.controlnode.core import Core, leaves
from daemon.model import EventKind, Node
from daemon.providers.base import ProviderError
from trainer.contract import RDZV_ENDPOINT_ENV, RUN_ID_ENV

__all__ = ["Actuator", "Owner", "TARGET_KEY", "PAUSED_KEY", "JOB_END_KEY"]

log = structlog.get_logger("spotvisor.daemon")

#: how long the wake of a loss's survivors tries to reach the rendezvous store (seconds)
WAKE_TIMEOUT_S = 5.0
# the store's keys for the supervisor's fields that outlive a daemon restart
TARGET_KEY = "target_nodes"  # int: the operator's target (spotctl scale)
PAUSED_KEY = "paused"  # bool: spotctl pause
JOB_END_KEY = "job_end"  # {"state": "failed" | "cancelled", "why": str, "at": unix s} | None
_PROVIDER_ACTIONS = (a.Launch, a.Terminate, a.MarkLost)
ProviderCall = Callable[[a.Launch | a.Terminate | a.MarkLost], Awaitable[None]]


class Owner(Core, Protocol):
    """The supervisor as its apply arm sees it: :class:`Core` and the fields that only
    the supervisor and this arm write (every other part gets :class:`Core`, read-only)."""

    target_nodes: int
    desired_nodes: int
    paused: bool
    first_ready_at: float | None  # when the first node of a pending job was up (unix s)
    rejoin: Rejoin | None
    run_nonce: str


class Actuator:
    """Applies decisions and changes to the supervisor (see the module docstring).

    ``provider_call``: :meth:`Fleet.apply`; ``drain``: :meth:`Operator.drain`;
    ``avoid_zone``: :meth:`Fleet.avoid_zone_of`; ``watch_flush``: :meth:`JobTracker.watch_flush`."""

    def __init__(self, owner: Owner, *, provider_call: ProviderCall, drain: Callable[[Node, str], None],
                 avoid_zone: Callable[[Node], None], watch_flush: Callable[[str, str, float], None]) -> None:
        self.core = owner
        self._provider_call, self._drain = provider_call, drain
        sup = owner
        # one entry per action and change type: the method that applies it
        self._apply: dict[type, Callable[[Any], None]] = {
            a.Admit: self._admit, a.StartJob: self._start_job, a.NoteFirstReady: self._note_first_ready,
            a.Drain: lambda x: drain(sup.nodes[x.node_id], x.reason),
            a.RequestRejoin: self._request_rejoin, a.EndRejoin: self._end_rejoin, a.RestartJob: self._restart_job,
            a.Leave: self._leave, a.AvoidZone: lambda x: avoid_zone(sup.nodes[x.node_id]),
            a.WatchFlush: lambda x: watch_flush(x.notice_id, x.node_id, x.due),
            a.RequestCheckpoint: self._request_checkpoint, a.MarkReplacing: self._mark_replacing,
            a.WakeSurvivors: self._wake_survivors, a.JobStalled: self._stalled,
            c.SetTarget: self._set_target, c.SetDesired: self._set_desired, c.Pause: self._pause,
            c.Unpause: self._unpause, c.EndJob: self._end_job, c.Relaunch: self._relaunch,
            c.CompleteJob: self._complete_job, migration.ResetStart: self._reset_start,
            JobProgress: self._job_progress,
        }

    async def act_all(self, actions: list[a.Action]) -> None:
        """Provider calls first, concurrently (100 terminations one after another kept the loop
        from admitting anyone for ~50 s: bench/scale.py; a failing call cancels the rest, the
        next pass retries them), then the rest in order.

        Raises:
            ProviderError: a provider call failed (the first; the others are logged).
        """
        try:
            async with asyncio.TaskGroup() as tg:
                for action in actions:
                    if isinstance(action, _PROVIDER_ACTIONS):
                        tg.create_task(self._provider_call(action))
        except ExceptionGroup as group:
            errors = list(leaves(group))
            if not all(isinstance(e, ProviderError) for e in errors):
                raise
            for extra in errors[1:]:
                log.error("reconcile_provider_error", error=str(extra))
            raise errors[0] from None  # the loop logs it and retries next pass
        for action in actions:
            if not isinstance(action, _PROVIDER_ACTIONS):
                self.act(action)

    def act(self, action: a.Action | c.Change) -> None:
        """Apply one decision that needs no provider call, or one change.

        Raises:
            TypeError: not such an action (a provider call, or no action at all).
        """
        apply = self._apply.get(type(action))
        if apply is None:
            raise TypeError(f"not an action for act(): {action!r}")
        apply(action)

    # -- the decisions ------------------------------------------------------------------------
    def _admit(self, action: a.Admit) -> None:
        sup, node = self.core, self.core.nodes[action.node_id]
        node.joins_running = action.reason == "join_running"  # its agent starts the join spec
        self._join_cohort(node, action.cohort)
        sup.set_state(node, NodeState.RUNNING)
        sup.record(EventKind.NODE_ADMITTED, action.node_id, reason=action.reason)

    def _join_cohort(self, node: Node, nodes: int) -> None:
        """``node`` starts its torchrun with ``nodes - 1`` others, whose first round waits for
        every one of them until ``rendezvous.start_wait_s`` from now (told in the reply that
        starts it, :meth:`AgentLink.reply`; :mod:`trainer.rendezvous`); 0 or 1: no wait."""
        sup = self.core
        wait_s = sup.config.domain(sup.domain_of(node)).rendezvous.start_wait_s
        node.start_cohort = nodes if nodes > 1 and wait_s > 0 else 0
        node.start_until = sup.clock() + wait_s if node.start_cohort else None

    def _start_job(self, action: a.StartJob) -> None:
        sup = self.core
        sup.job.to(JobState.RUNNING)
        if sup.config.job.command is not None and sup.job.started_at is None:
            sup.job.started_at = sup.clock()  # the user's script reports no start of its own

    def _note_first_ready(self, action: a.NoteFirstReady) -> None:
        self.core.first_ready_at = action.at

    def _job_progress(self, action: JobProgress) -> None:
        """The trainer's word on the job (:mod:`daemon.control.job`)."""
        sup = self.core
        for name, value in action.fields():
            setattr(sup.job, name, value)
        if action.state is not None and sup.job.state is not action.state:
            sup.job.to(action.state)
        if sup.job.started_at is None:
            sup.job.started_at = action.started_at
        if sup.rejoin is not None and sup.rejoin.id in action.answers:
            sup.rejoin.answered = True
            sup.wake()

    def _reset_start(self, action: migration.ResetStart) -> None:
        sup = self.core
        if sup.job.state is JobState.RUNNING:
            sup.job.to(JobState.PENDING)  # the next nodes up start it from its newest commit
        sup.first_ready_at = None

    def _restart_job(self, action: a.RestartJob) -> None:
        sup = self.core
        log.info("restart_all", pool=sup.pool, lost=list(action.lost), reason=action.reason)
        sup.job.to(JobState.PENDING)  # the first nodes up start it together, from its newest commit
        sup.first_ready_at, sup.rejoin = None, None
        sup.wake()

    def _leave(self, action: a.Leave) -> None:
        sup, node = self.core, self.core.nodes[action.node_id]
        if not node.state.is_terminal():
            sup.set_state(node, NodeState.DRAINING, action.reason)
        if sup.rejoin is not None:
            sup.rejoin.nodes.discard(node.id)

    def _request_checkpoint(self, action: a.RequestCheckpoint) -> None:
        sup = self.core
        for nid in action.node_ids:
            sup.send(nid, {"kind": "checkpoint", "reason": action.reason, "id": action.request_id})
        sup.record(EventKind.CHECKPOINT_REQUESTED, action.about, reason=action.reason, request_id=action.request_id)

    def _mark_replacing(self, action: a.MarkReplacing) -> None:
        sup, node = self.core, self.core.nodes[action.node_id]
        node.replacing = True
        sup.store.put_node(node)
        sup.wake()

    def _wake_survivors(self, action: a.WakeSurvivors) -> None:
        sup = self.core
        # the rendezvous store and run id the lost node's workers were given (its domain's)
        env = sup.job_spec(sup.nodes[action.lost[0]])["env"]
        host, _, port = env[RDZV_ENDPOINT_ENV].rpartition(":")
        if not port.isdigit():  # cannot come from job_spec; never crash the reconcile loop over it
            log.warning("wake_survivors_failed", attempt=action.attempt, error=f"endpoint {env[RDZV_ENDPOINT_ENV]!r}")
            return
        sup.spawn(self.wake_survivors(action, (host.strip("[]"), int(port)), env[RUN_ID_ENV]), "wake-survivors")

    async def wake_survivors(self, action: a.WakeSurvivors, endpoint: tuple[str, int], run: str) -> None:
        """Wake every rank of ``action.attempt`` through the rendezvous store at ``endpoint``
        (:func:`trainer.membership.wake_survivors`, in a thread: store round trips). A store
        out of reach is logged: the survivors still re-form at their collective's timeout."""
        try:
            from trainer.membership import wake_survivors  # torch's store client: ImportError without torch

            await asyncio.to_thread(wake_survivors, endpoint, run, action.attempt, action.world_size,
                                    reason=f"daemon: {','.join(action.lost)} lost", timeout_s=WAKE_TIMEOUT_S)
        except Exception as exc:  # torch's store errors: DistError, RuntimeError, OSError; no torch here
            log.warning("wake_survivors_failed", attempt=action.attempt, lost=list(action.lost), error=str(exc))
            return
        log.info("survivors_woken", attempt=action.attempt, world_size=action.world_size, lost=list(action.lost))

    def _stalled(self, action: a.JobStalled) -> None:
        """Record ``job_stalled``; with nodes to restart, move the job to a new rendezvous id
        (a torchrun agent that failed closed the old one for good: torch's launcher shuts
        its rendezvous down on any exit but a signal) and send every node that holds the
        job's spec the new one: ``restart`` to the nodes of ``action.restart`` (their agents
        stop what still runs and start torchrun again, which resumes from the newest
        commit) and to every node registered but not in the job yet (its next start must
        join the new rendezvous, not the old)."""
        sup = self.core
        sup.record(EventKind.JOB_STALLED, None, reason=action.reason, message=action.message,
                   idle_s=round(action.idle_s, 1), bound_s=round(action.bound_s, 1), step=sup.job.step,
                   last_commit_step=sup.job.last_commit_step, restart=list(action.restart))
        if not action.restart:
            return
        sup.run_nonce = secrets.token_hex(4)
        sup.store.set("run_nonce", sup.run_nonce)
        rid = f"restart-{secrets.token_hex(4)}"
        for node in sup.nodes.values():
            if node.id in action.restart or node.state in (NodeState.READY, NodeState.ADMITTING):
                node.joins_running = False  # restarted with the job's torchrun command, not the join one
                if node.id in action.restart:  # they start the new rendezvous together, as at the job's start
                    self._join_cohort(node, len(action.restart))
                sup.store.put_node(node)
                sup.send(node.id, {"kind": "restart", "id": rid, "job": sup.job_spec(node)})
        log.info("trainers_restarting", request_id=rid, nodes=list(action.restart), run_nonce=sup.run_nonce)
        sup.wake()

    def _request_rejoin(self, action: a.RequestRejoin) -> None:
        sup = self.core
        rid = f"rejoin-{secrets.token_hex(4)}"
        sup.rejoin = Rejoin(rid, set(action.nodes), sup.clock())
        for nid in action.nodes:
            sup.set_state(sup.nodes[nid], NodeState.ADMITTING)
        for nid in action.ask:
            sup.send(nid, {"kind": "checkpoint", "reason": "rejoin", "id": rid})
        sup.record(EventKind.CHECKPOINT_REQUESTED, None, reason="rejoin", request_id=rid,
                   for_nodes=sorted(action.nodes))

    def _end_rejoin(self, action: a.EndRejoin) -> None:
        sup = self.core
        if (sup.rejoin.id if sup.rejoin is not None else "") != action.request_id:  # "": none in flight
            return
        if action.reason != "answered":
            log.info("rejoin_ended", request_id=action.request_id, reason=action.reason)
        for nid in action.withdraw_from:
            sup.send(nid, {"kind": "cancel", "id": action.request_id})
        for nid in action.back_to_ready:
            if sup.nodes[nid].state is NodeState.ADMITTING:
                sup.set_state(sup.nodes[nid], NodeState.READY, "rejoin deferred")
        sup.rejoin = None

    # -- the changes a part asks for (daemon.control.changes) ---------------------------------
    def _set_target(self, change: c.SetTarget) -> None:
        sup = self.core
        if change.nodes != sup.target_nodes and not change.restored:
            sup.store.set(TARGET_KEY, change.nodes)
        sup.target_nodes = change.nodes

    def _set_desired(self, change: c.SetDesired) -> None:
        self.core.desired_nodes = change.nodes

    def _pause(self, change: c.Pause) -> None:
        sup = self.core
        sup.paused = True
        sup.store.set(PAUSED_KEY, True)
        sup.job.to(JobState.PAUSED)
        sup.desired_nodes = 0

    def _unpause(self, change: c.Unpause) -> None:
        sup = self.core
        sup.paused = False
        sup.store.set(PAUSED_KEY, False)
        sup.job.to(JobState.PENDING)  # the first nodes up start the job together
        sup.first_ready_at = None
        sup.desired_nodes = sup.target_nodes

    def _end_job(self, change: c.EndJob) -> None:
        sup = self.core
        if sup.job.state is not change.state:
            sup.job.to(change.state)
        sup.job.end_reason = change.why
        sup.paused = False
        if change.at is not None:
            sup.store.set(PAUSED_KEY, False)
            sup.store.set(JOB_END_KEY, {"state": change.state.value, "why": change.why, "at": change.at})
        sup.desired_nodes = 0  # the planner releases every node; the checkpoints stay in the store

    def _relaunch(self, change: c.Relaunch) -> None:
        sup = self.core
        sup.job.to(JobState.PENDING)
        sup.job.end_reason = None
        sup.store.set(JOB_END_KEY, None)
        sup.first_ready_at = None
        sup.desired_nodes = sup.target_nodes

    def _complete_job(self, change: c.CompleteJob) -> None:
        sup = self.core
        sup.job.to(JobState.COMPLETED)
        if change.step is not None:
            sup.job.step = change.step
        sup.record(EventKind.JOB_COMPLETED, change.node, step=sup.job.step, **dict(change.context))
        sup.job_completed()
