"""The edge of the job's life: a job that fails, is cancelled (``spotctl down``) and resumed.

:class:`JobLife` turns the events the daemon records into the observations of
:mod:`daemon.control.tries` (the pure rule that says when a job is given up) and
carries out its verdict, and the operator's ``down`` / ``resume`` verbs:

- **failed**: ``job.max_restarts_on_errors`` tries in a row without progress. The job
  moves to ``failed``, the pool's target to 0 (the planner terminates every node; the
  checkpoints are kept), and ``job_failed`` carries the failing node's last log lines
  (masked, bounded: :data:`TAIL_LINES` lines of at most :data:`TAIL_LINE_CHARS`
  characters) and why, which ``spotctl status`` shows.
- **cancelled**: ``spotctl down`` asks every trainer for a commit through the drain path
  (:meth:`daemon.controlnode.operator.Operator.drain`: the request each trainer answers
  at its next step boundary, then its node is released). The wait is bounded: a node
  whose commit has not come ``daemon.rejoin_timeout_s`` (+ the planner's drain grace)
  after the request is terminated anyway, and the job resumes later from its newest
  commit before that. ``job_cancelling`` now, ``job_cancelled`` (with the commit's step
  and whether it came) once every node is gone.
- ``resume`` takes either back to ``pending`` at the operator's target size; the trainer
  starts from the newest committed checkpoint.

Both ends are kept in the store (``job_end``): a restarted daemon relaunches nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

from daemon.control import changes as c
from daemon.control import operator as op
from daemon.control.lifecycle import ADMITTED, TrainerState
from daemon.control.pool import Timeouts
from daemon.control.tries import Began, Crashed, Disturbed, Ended, Observation, Stepped, Tries, gives_up, observe
from daemon.controlnode.actuator import JOB_END_KEY
from daemon.controlnode.core import Core
from daemon.controlnode.node_logs import NodeLogs
from daemon.model import Event, EventKind, JobState, Node

__all__ = ["JobLife", "TAIL_LINES", "TAIL_LINE_CHARS", "LOG_WAIT_S"]

log = structlog.get_logger("spotvisor.daemon")

TAIL_LINES = 20  # the failing node's last log lines in job_failed
TAIL_LINE_CHARS = 240  # each cut to this many characters (the feed's message stays bounded)
# how long the job_failed event waits for the failing node's next heartbeat, which ships its
# log's last lines (seconds); the nodes are released only after it
LOG_WAIT_S = 10.0
_TAIL_SCAN = 200  # lines looked at for the tail (torchrun's own failure report is cut from them)
_DISTURBING = {EventKind.INTERRUPTION_NOTICE.value, EventKind.NODE_LOST.value, EventKind.NODE_TERMINATED.value,
               EventKind.MIGRATION_STARTED.value}


class JobLife:
    """Failed, cancelled, resumed (see the module docstring). Constructor does no I/O.

    ``logs``: the daemon's copy of the nodes' logs; ``launching``: whether a launch is in
    flight (it may yet return an instance to release)."""

    def __init__(self, core: Core, *, logs: NodeLogs, launching: Callable[[], bool]) -> None:
        self.core = core
        self.max_failures = core.config.job.max_restarts_on_errors
        self.long_s = core.config.daemon.stall.first_step_s
        # a trainer that reports nothing, on an interpreter without spotvisor's launcher, is seen only
        # when its torchrun, given max_failures - 1 restarts of its own (daemon/controlnode/jobspec.py),
        # exits: that exit is max_failures tries
        self.tries_per_exit = self.max_failures if core.config.job.failures_seen_at_exit_only else 1
        self.tries = Tries()
        self._logs, self._launching = logs, launching
        self._give_up_at: float | None = None  # gives_up decided: job_failed once the log is in
        self._released = False  # pool_released recorded for this end
        self._down: dict[str, Any] | None = None  # the down in progress: step and commit when asked
        self._error_line: tuple[str, str] | None = None  # (node, the newest exception its workers_failed said)

    # -- observations ------------------------------------------------------------------------
    def on_event(self, ev: Event) -> None:
        """An event listener: the events that begin, disturb or end a try."""
        if self.core.job.state.is_terminal():
            return
        data = ev.data if isinstance(ev.data, dict) else {}
        k = ev.kind
        if k == EventKind.JOB_RESUMED.value and isinstance(data.get("attempt"), str):
            self._see(Began(ev.time, data.get("step"), data["attempt"]))
        elif k == EventKind.NODE_ADMITTED.value:
            self._see(Began(ev.time, self.core.job.step) if data.get("reason") == "job_start"
                      else Disturbed(f"node_admitted {ev.node}"))
        elif k == EventKind.JOB_STALLED.value and data.get("restart"):
            self._see(Ended(ev.time, "stalled"))
            self._see(Began(ev.time, self.core.job.step))
        elif k == EventKind.TRAINER_EXITED.value and data.get("exit_code") not in (0, None):
            node = self.core.nodes.get(ev.node or "")
            if node is not None and node.state in ADMITTED and not node.joins_running:
                # no try running (its workers' failures ended it): the exit is one more of those
                self._see(Ended(ev.time, "exit", self.tries_per_exit, node.id, data["exit_code"]) if self.tries.running
                          else Crashed(ev.time, node.id, data["exit_code"]))
        elif k == EventKind.WORKERS_FAILED.value:
            node = self.core.nodes.get(ev.node or "")
            if self._counts_failures_of(node):
                assert node is not None
                self._error_line = (node.id, str(data.get("last_line") or ""))
                self._see(Crashed(ev.time, node.id))
        elif k in _DISTURBING or (k == EventKind.CHECKPOINT_REQUESTED.value
                                  and data.get("reason") in ("drain", "rejoin")):
            self._see(Disturbed(k))

    def _counts_failures_of(self, node: Node | None) -> bool:
        """Whether a failure of ``node``'s workers is one of the job's tries: a node of
        the running job's world (a node joining it in-process has its own exit path)."""
        return node is not None and node.state in ADMITTED and not node.joins_running

    def workers_failed_count(self, node: Node, at: float) -> dict[str, int]:
        """What a ``workers_failed`` of ``node`` at ``at`` (unix s) will make of the job's
        count (:func:`daemon.control.tries.observe`, as :meth:`on_event` will apply it):
        ``failed_tries`` in a row then, and ``max_restarts_on_errors``, at which the job
        is failed; empty when it does not count (the job has ended or its failure is
        decided, or the node is not of the running world). torchrun's own budget (1000
        restarts for a status-reporting trainer) is not the job's."""
        if self.core.job.state.is_terminal() or self._give_up_at is not None or not self._counts_failures_of(node):
            return {}
        after = observe(self.tries, Crashed(at, node.id), long_s=self.long_s)
        return {"failed_tries": after.failed, "max_restarts_on_errors": self.max_failures}

    def _see(self, obs: Observation) -> None:
        if self._give_up_at is not None:
            return  # decided: the count job_failed shows is the one that decided it
        self.tries = observe(self.tries, obs, long_s=self.long_s)
        if self._give_up_at is None and gives_up(self.tries, self.max_failures):
            self._give_up_at = self.core.clock()
            log.warning("job_giving_up", pool=self.core.pool, failed_tries=self.tries.failed)
            self.core.wake()

    # -- one reconcile pass ------------------------------------------------------------------
    def check(self, now: float) -> None:
        """A pass: the job's step as progress; the give-up carried out once the failing
        node's log is in; ``job_cancelled`` and ``pool_released`` once every node is gone."""
        core = self.core
        if not core.job.state.is_terminal() and core.job.step is not None:
            self._see(Stepped(core.job.step))
        if self._give_up_at is not None and not core.job.state.is_terminal():
            last = self.tries.last
            node = core.nodes.get(last.node or "") if last is not None else None
            heard = node is None or (node.last_heartbeat or 0) > (last.at if last else 0)
            if heard or now - self._give_up_at >= LOG_WAIT_S:
                self._fail(now)
        if core.job.state not in (JobState.FAILED, JobState.CANCELLED) or self._released:
            return
        if any(not n.state.is_terminal() for n in core.nodes.values()) or self._launching():
            return
        self._released = True
        if core.job.state is JobState.CANCELLED:
            down = self._down or {}
            before = down.get("last_commit_step")
            commit = core.job.last_commit_step
            core.record(EventKind.JOB_CANCELLED, None, last_commit_step=commit,
                        committed=commit is not None and commit != before or (commit == down.get("step")))
        core.record(EventKind.POOL_RELEASED, reason=f"job_{core.job.state.value}", **core.spot_cost())

    def _fail(self, now: float) -> None:
        core, last = self.core, self.tries.last
        why = (f"{self.tries.failed} tries without progress (job.max_restarts_on_errors {self.max_failures})"
               + ("" if last is None else f"; the last {last.why}"
                  + (f" on {last.node}" if last.node else "")
                  + (f" with status {last.exit_code}" if last.exit_code is not None else "")
                  + (f": {self._error_line[1]}" if last.why == "workers_failed" and self._error_line
                     and self._error_line[0] == last.node and self._error_line[1] else "")))
        self._end(JobState.FAILED, why, now)
        core.record(EventKind.JOB_FAILED, last.node if last else None, why=why, failed_tries=self.tries.failed,
                    exit_code=last.exit_code if last else None, step=core.job.step,
                    last_commit_step=core.job.last_commit_step, log_tail=self.log_tail(last.node if last else None))
        log.error("job_failed", pool=core.pool, why=why)

    def log_tail(self, node_id: str | None) -> list[str]:
        """``node_id``'s last :data:`TAIL_LINES` log lines, masked and cut (empty: none held), before
        torchrun's own report of the failure (its traceback ending in ``ChildFailedError``, which
        names the failed rank but would push the script's own last lines out)."""
        if node_id is None:
            return []
        lines = [ln.line for ln in self._logs.tail(node_id, _TAIL_SCAN)]
        end = next((i for i in range(len(lines) - 1, -1, -1) if "ChildFailedError" in lines[i]), None)
        if end is not None:
            start = next((i for i in range(end, -1, -1) if lines[i].startswith("Traceback (most recent call last)")), end)
            lines = lines[:start]
        return [line[:TAIL_LINE_CHARS] for line in lines[-TAIL_LINES:]]  # masked as NodeLogs took them

    def _end(self, state: JobState, why: str, now: float) -> None:
        self.core.act(c.EndJob(state, why, at=now))  # kept in the store; the planner releases every node
        self._released = False
        self.core.wake()

    # -- the operator's verbs ----------------------------------------------------------------
    def down(self) -> dict[str, Any]:
        """``spotctl down``: commit, release every node, end the job ``cancelled``.

        Returns ``{"state": "cancelling", "draining", "committing", "wait_s"}``: ``wait_s``
        bounds the wait for the commit (seconds; then the nodes are released anyway).

        Raises:
            ValueError: the job is already over (completed, failed or cancelled).
        """
        core = self.core
        if core.job.state.is_terminal():
            raise ValueError(f"the job is {core.job.state.value}: nothing runs to take down"
                             + (" (spotctl resume starts it again)" if core.job.state is not JobState.COMPLETED else ""))
        s = core.state()
        running = [n.id for n in s.in_state(*ADMITTED)]
        committing = [n.id for n in s.in_state(*ADMITTED) if n.trainer is TrainerState.RUNNING]
        actions = op.pause(s)  # the same commit-then-release as a pause: a drain of every running node
        self._down = {"step": core.job.step, "last_commit_step": core.job.last_commit_step}
        self._give_up_at = None
        self._end(JobState.CANCELLED, "spotctl down", core.clock())
        for action in actions:
            core.act(action)
        wait_s = core.config.daemon.rejoin_timeout_s + Timeouts().drain_grace_s  # the planner's bound
        core.record(EventKind.JOB_CANCELLING, None, step=core.job.step, last_commit_step=core.job.last_commit_step,
                    draining=running, committing=committing, wait_s=wait_s)
        return {"state": "cancelling", "draining": running, "committing": committing, "wait_s": wait_s}

    def resume(self) -> dict[str, Any]:
        """``spotctl resume`` of a failed or cancelled job: back to ``pending`` at the
        operator's target; the trainer resumes from the newest committed checkpoint.

        Raises:
            ValueError: the job is neither failed nor cancelled, or its nodes are still
                being released (resume once ``pool_released`` is recorded).
        """
        core = self.core
        if core.job.state not in (JobState.FAILED, JobState.CANCELLED):
            raise ValueError(f"the job is {core.job.state.value}, not failed, cancelled or paused: "
                             "there is nothing to resume")
        live = [n.id for n in sorted(core.nodes.values(), key=lambda n: n.ordinal) if not n.state.is_terminal()]
        if live:
            raise ValueError(f"the job is still releasing {', '.join(live)}: resume once they are gone "
                             "(spotctl status, or the pool_released event)")
        was = core.job.state.value
        core.act(c.Relaunch())  # pending at the operator's target, its end cleared
        self.tries, self._give_up_at, self._down = Tries(), None, None
        core.record(EventKind.JOB_RELAUNCHED, None, was=was, target_nodes=core.target_nodes,
                    resume_from_step=core.job.last_commit_step)
        core.wake()
        return {"state": "pending", "was": was, "target_nodes": core.target_nodes,
                "resume_from_step": core.job.last_commit_step}

    def restore(self) -> None:
        """A restarted daemon keeps a failed or cancelled job so: nothing is relaunched."""
        core = self.core
        end = core.store.get(JOB_END_KEY)
        if not isinstance(end, dict) or core.job.state is JobState.COMPLETED:
            return
        try:
            state = JobState(end.get("state"))
        except ValueError:
            log.warning("job_end_unreadable", stored=repr(end)[:200])
            state = JobState.CANCELLED  # fail closed: buy nothing until the operator resumes
        if state not in (JobState.FAILED, JobState.CANCELLED):
            return
        core.act(c.EndJob(state, str(end.get("why") or "")[:500]))  # as the store has it: nothing written
        self._released = all(n.state.is_terminal() for n in core.nodes.values())  # recorded by the last daemon

