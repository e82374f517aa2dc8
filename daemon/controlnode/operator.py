"""The operator's verbs at the edge: ``spotctl scale / pause / resume / drain / checkpoint``.

The decisions are :mod:`daemon.control.operator`'s (pure); :class:`Operator` checks,
hands the supervisor the operator's choices as changes (:mod:`daemon.control.changes`:
the supervisor keeps them in the store, so a restarted daemon keeps its target and its
pause), records the events and has the supervisor carry the decisions' actions out.
"""

from __future__ import annotations

import secrets
from typing import Any

import structlog

from daemon.control import changes as c
from daemon.control import operator as op
from daemon.control.actions import Drain
from daemon.control.lifecycle import ADMITTED, TrainerState, training
from daemon.controlnode.actuator import PAUSED_KEY, TARGET_KEY
from daemon.controlnode.core import Core
from daemon.model import EventKind, Node, NodeState

__all__ = ["Operator"]

log = structlog.get_logger("spotvisor.daemon")


class Operator:
    """The verbs of ``spotctl`` that change the pool or the job."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._paused_recorded = False  # job_paused recorded: the pause holds no capacity any more

    def scale(self, nodes: int) -> dict[str, Any]:
        """Set the pool's target size (nodes); kept in the store, so a restarted daemon keeps it.

        Growing launches at once. Shrinking releases nodes not in the job first, then
        drains the youngest running ones (each commits, then leaves): no step is lost.
        While paused, the new target applies at :meth:`resume`.

        Raises:
            ValueError: ``nodes`` outside ``pool.min_nodes..pool.max_nodes``, a world
                size the global batch cannot be split over, or the job is over.
        """
        core, pool, job = self.core, self.core.config.pool, self.core.config.job
        op.check_scale(core.state(), nodes, min_nodes=pool.min_nodes, max_nodes=pool.max_nodes,
                           valid_counts=core.config.valid_node_counts(),
                           gpus_per_node=core.config.offers[0].gpus_per_node,
                           global_batch_size=job.global_batch_size, micro_batch_size=job.micro_batch_size)
        old = core.target_nodes
        core.act(c.SetTarget(nodes))
        draining: list[str] = []
        if not core.paused and not (nodes == old and core.desired_nodes == nodes):  # else: nothing changes
            core.act(c.SetDesired(nodes, "scale"))
            for action in op.scale(core.state(), nodes, old=old):
                core.act(action)
                if isinstance(action, Drain):
                    draining.append(action.node_id)
        core.record(EventKind.POOL_SCALED, None, old=old, new=nodes, paused=core.paused, draining=draining)
        if nodes != old:  # the same target again changes nothing: no pass over every node for it
            core.wake()
        return {"target_nodes": nodes, "old": old, "paused": core.paused, "draining": draining}

    def pause(self) -> dict[str, Any]:
        """Commit a checkpoint and release every node, keeping the job (its checkpoints,
        its target size); :meth:`resume` relaunches it from the last commit.

        ``job_pausing`` now, ``job_paused`` once no capacity is held
        (:meth:`check_paused`). The pause is kept in the store: a restarted daemon stays
        paused.

        Raises:
            ValueError: already paused, or the job is over.
        """
        core = self.core
        s = core.state()
        op.check_pause(s)
        self._paused_recorded = False
        core.act(c.Pause())
        running = [n.id for n in s.in_state(*ADMITTED)]
        committing = [n.id for n in s.in_state(*ADMITTED) if n.trainer is TrainerState.RUNNING]
        for action in op.pause(s):
            core.act(action)
        core.record(EventKind.JOB_PAUSING, None, step=core.job.step, last_commit_step=core.job.last_commit_step,
                    draining=running, committing=committing)
        core.wake()
        return {"state": "pausing", "draining": running, "committing": committing}

    def resume(self) -> dict[str, Any]:
        """Relaunch a paused job to its target size. It resumes from its last committed
        checkpoint (the trainer always starts from the newest verified one).

        Raises:
            ValueError: the job is not paused, or the pause still holds nodes (their
                commit may not be written yet: resume once ``job_paused`` is recorded).
        """
        core = self.core
        op.check_resume(core.state())
        core.act(c.Unpause())  # pending at the target: the first nodes up start the job together
        core.record(EventKind.JOB_UNPAUSED, None, target_nodes=core.target_nodes,
                    resume_from_step=core.job.last_commit_step)
        core.wake()
        return {"state": "pending", "target_nodes": core.target_nodes, "resume_from_step": core.job.last_commit_step}

    def check_paused(self) -> None:
        """A reconcile pass: ``job_paused`` once the pause holds no node any more."""
        core = self.core
        if (core.paused and not self._paused_recorded and not core.job.state.is_terminal()
                and all(n.state.is_terminal() for n in core.nodes.values())):
            self._paused_recorded = True
            core.record(EventKind.JOB_PAUSED, None, last_commit_step=core.job.last_commit_step)

    def restore(self) -> None:
        """``spotctl scale`` and ``pause`` outlive a daemon restart (kept in the store)."""
        core, pool = self.core, self.core.config.pool
        target = core.store.get(TARGET_KEY)
        if isinstance(target, int):
            core.act(c.SetTarget(min(max(target, pool.min_nodes), pool.max_nodes), restored=True))
            if core.target_nodes != target:
                log.warning("scaled_target_clamped", stored=target, target_nodes=core.target_nodes)
        if bool(core.store.get(PAUSED_KEY, False)) and not core.job.state.is_terminal():
            core.act(c.Pause("restored"))  # the job paused, nothing desired
            self._paused_recorded = all(n.state.is_terminal() for n in core.nodes.values())
        elif not core.job.state.is_terminal():
            core.act(c.SetDesired(core.target_nodes, "restored"))

    def request_checkpoint(self, reason: str = "manual") -> str | None:
        """Ask the job to commit a checkpoint at its next step boundary and keep training.

        Returns the request id, or None when no node is running the job's trainer.
        """
        core = self.core
        running = [n for n in core.nodes.values() if training(n)]
        if not running:
            return None
        rid = f"{reason}-{secrets.token_hex(4)}"
        for n in running:  # one rank seeing it is enough (the guard all-reduces); all get it
            core.send(n.id, {"kind": "checkpoint", "reason": reason, "id": rid})
        core.record(EventKind.CHECKPOINT_REQUESTED, None, reason=reason, request_id=rid)
        return rid

    def drain(self, node: Node, reason: str) -> None:
        """Make ``node`` leave the job cleanly: its trainer commits a checkpoint and holds,
        then its agent stops torchrun (a daemon-initiated interruption; no cloud notice)."""
        core = self.core
        if node.state.is_terminal() or node.state is NodeState.DRAINING:
            return
        # named like a notice id (<node id>:...): the node's own report of the commit that
        # answers it counts, as for a notice (JobTracker.on_status), rather than being dropped
        rid = f"{node.id}:drain-{secrets.token_hex(4)}"
        # a drain that never completes (a hung trainer) must not block admission
        # forever: past this deadline (+ grace) the planner terminates the node
        node.deadline = core.clock() + core.config.daemon.rejoin_timeout_s
        core.set_state(node, NodeState.DRAINING, reason)
        if node.trainer is TrainerState.RUNNING:
            core.send(node.id, {"kind": "drain", "id": rid})
            core.record(EventKind.CHECKPOINT_REQUESTED, node.id, reason="drain", request_id=rid, why=reason)
        core.wake()
