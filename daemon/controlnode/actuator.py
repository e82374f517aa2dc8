"""What the supervisor's decisions do that is not a provider call: agent commands,
node and job state changes, and their events.

Provider calls (launch, terminate) are :class:`~daemon.controlnode.fleet.Fleet`'s; every
other action of :mod:`daemon.control.actions` comes here.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Callable

import structlog

from daemon.control import actions as a
from daemon.control.job import JobProgress
from daemon.control.lifecycle import JobState, NodeState
from daemon.control.state import Rejoin
from daemon.controlnode.core import Core
from daemon.model import EventKind, Node
from trainer.contract import RDZV_ENDPOINT_ENV, RUN_ID_ENV

__all__ = ["Actuator"]

log = structlog.get_logger("spotvisor.daemon")

#: how long the wake of a loss's survivors tries to reach the rendezvous store (seconds)
WAKE_TIMEOUT_S = 5.0


class Actuator:
    """Turns decisions into agent commands and recorded state (see the module docstring)."""

    def __init__(self, core: Core, *, drain: Callable[[Node, str], None], avoid_zone: Callable[[Node], None],
                 watch_flush: Callable[[str, str, float], None]) -> None:
        self.core = core
        self._drain = drain  # Operator.drain
        self._avoid_zone = avoid_zone  # Fleet.avoid_zone_of
        self._watch_flush = watch_flush  # JobTracker.watch_flush

    def act(self, action: a.Action) -> None:
        """Carry out one decision that needs no provider call. Raises TypeError: not such an action."""
        sup = self.core
        if isinstance(action, a.Admit):
            node = sup.nodes[action.node_id]
            node.joins_running = action.reason == "join_running"  # its agent starts the join spec
            sup.set_state(node, NodeState.RUNNING)
            sup.record(EventKind.NODE_ADMITTED, action.node_id, reason=action.reason)
        elif isinstance(action, a.StartJob):
            sup.job.to(JobState.RUNNING)
            if sup.config.job.command is not None and sup.job.started_at is None:
                sup.job.started_at = sup.clock()  # the user's script reports no start of its own
        elif isinstance(action, a.NoteFirstReady):
            sup.first_ready_at = action.at
        elif isinstance(action, a.Drain):
            self._drain(sup.nodes[action.node_id], action.reason)
        elif isinstance(action, (a.RequestRejoin, a.EndRejoin)):
            self._rejoin(action)
        elif isinstance(action, a.RestartJob):
            log.info("restart_all", pool=sup.pool, lost=list(action.lost), reason=action.reason)
            sup.job.to(JobState.PENDING)  # the first nodes up start it together, from its newest commit
            sup.first_ready_at, sup.rejoin = None, None
            sup.wake()
        elif isinstance(action, a.Leave):
            node = sup.nodes[action.node_id]
            if not node.state.is_terminal():
                sup.set_state(node, NodeState.DRAINING, action.reason)
            if sup.rejoin is not None:
                sup.rejoin.nodes.discard(node.id)
        elif isinstance(action, a.AvoidZone):
            self._avoid_zone(sup.nodes[action.node_id])
        elif isinstance(action, a.WatchFlush):
            self._watch_flush(action.notice_id, action.node_id, action.due)
        elif isinstance(action, a.RequestCheckpoint):
            for nid in action.node_ids:
                sup.send(nid, {"kind": "checkpoint", "reason": action.reason, "id": action.request_id})
            sup.record(EventKind.CHECKPOINT_REQUESTED, action.about, reason=action.reason,
                       request_id=action.request_id)
        elif isinstance(action, a.MarkReplacing):
            sup.nodes[action.node_id].replacing = True
            sup.store.put_node(sup.nodes[action.node_id])
            sup.wake()
        elif isinstance(action, a.WakeSurvivors):
            # the rendezvous store and run id the lost node's workers were given (its domain's)
            env = sup.job_spec(sup.nodes[action.lost[0]])["env"]
            host, _, port = env[RDZV_ENDPOINT_ENV].rpartition(":")
            if not port.isdigit():  # cannot come from job_spec; never crash the reconcile loop over it
                log.warning("wake_survivors_failed", attempt=action.attempt, error=f"endpoint {env[RDZV_ENDPOINT_ENV]!r}")
                return
            sup.spawn(self.wake_survivors(action, (host.strip("[]"), int(port)), env[RUN_ID_ENV]), "wake-survivors")
        elif isinstance(action, a.JobStalled):
            self._stalled(action)
        elif isinstance(action, JobProgress):  # the trainer's word on the job (daemon.control.job)
            for name, value in action.fields():
                setattr(sup.job, name, value)
            if action.state is not None and sup.job.state is not action.state:
                sup.job.to(action.state)
            if sup.job.started_at is None:
                sup.job.started_at = action.started_at
            if sup.rejoin is not None and sup.rejoin.id in action.answers:
                sup.rejoin.answered = True
                sup.wake()
        else:
            raise TypeError(f"not an action for act(): {action!r}")

    async def wake_survivors(self, action: a.WakeSurvivors, endpoint: tuple[str, int], run: str) -> None:
        """Wake every rank of ``action.attempt`` through the rendezvous store at ``endpoint``
        (:func:`trainer.membership.wake_survivors`, in a thread: store round trips). A store
        out of reach is logged: the survivors still re-form at their collective's timeout."""
        from trainer.membership import wake_survivors

        try:
            await asyncio.to_thread(wake_survivors, endpoint, run, action.attempt, action.world_size,
                                    reason=f"daemon: {','.join(action.lost)} lost", timeout_s=WAKE_TIMEOUT_S)
        except Exception as exc:  # torch's store errors: DistError, RuntimeError, OSError
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
                if node.joins_running:  # restarted with the job's torchrun command, not the join one
                    node.joins_running = False
                    sup.store.put_node(node)
                sup.send(node.id, {"kind": "restart", "id": rid, "job": sup.job_spec(node)})
        log.info("trainers_restarting", request_id=rid, nodes=list(action.restart), run_nonce=sup.run_nonce)
        sup.wake()

    def _rejoin(self, action: a.RequestRejoin | a.EndRejoin) -> None:
        sup = self.core
        if isinstance(action, a.RequestRejoin):
            rid = f"rejoin-{secrets.token_hex(4)}"
            sup.rejoin = Rejoin(rid, set(action.nodes), sup.clock())
            for nid in action.nodes:
                sup.set_state(sup.nodes[nid], NodeState.ADMITTING)
            for nid in action.ask:
                sup.send(nid, {"kind": "checkpoint", "reason": "rejoin", "id": rid})
            sup.record(EventKind.CHECKPOINT_REQUESTED, None, reason="rejoin", request_id=rid,
                       for_nodes=sorted(action.nodes))
        elif (sup.rejoin.id if sup.rejoin is not None else "") == action.request_id:  # "": none in flight
            if action.reason != "answered":
                log.info("rejoin_ended", request_id=action.request_id, reason=action.reason)
            for nid in action.withdraw_from:
                sup.send(nid, {"kind": "cancel", "id": action.request_id})
            for nid in action.back_to_ready:
                if sup.nodes[nid].state is NodeState.ADMITTING:
                    sup.set_state(sup.nodes[nid], NodeState.READY, "rejoin deferred")
            sup.rejoin = None
