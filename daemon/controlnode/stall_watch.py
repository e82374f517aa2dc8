"""The edge of stall detection (:mod:`daemon.control.stall`): one look per reconcile pass.

:class:`StallWatch` keeps the job's :class:`~daemon.control.stall.Progress`, fed at
each pass with the supervisor's view (the job's step and attempt, each node's
trainer), and each node's last trainer exit status (from the ``trainer_exited``
events). A stall becomes the actions of :func:`~daemon.control.stall.recover`, which
the actuator carries out (``job_stalled``, then the trainers restarted in place:
:meth:`daemon.controlnode.actuator.Actuator.act`). Short of a stall, in a job whose
joiners join in-process, the nodes the job trains on without
(:func:`~daemon.control.stall.left_behind`) leave, to be replaced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import structlog

from daemon.control.actions import Action, JobStalled, PoolState
from daemon.control.changes import CompleteJob
from daemon.control.lifecycle import ADMITTED
from daemon.control.reactions import script_completed
from daemon.control.stall import Progress, StallRules, check, left_behind, observe, recover
from daemon.controlnode.core import Core
from daemon.controlnode.rendezvous_watch import store_sentence
from daemon.model import Event, EventKind

__all__ = ["StallWatch"]

log = structlog.get_logger("spotvisor.daemon")


class StallWatch:
    """Watches one job for a stall (see the module docstring). Constructor does no I/O.

    ``migrating``: whether a whole-job migration is in flight (no stall then: the
    migration has its own deadlines and events). ``store_alarm``: the rendezvous store's
    alarm while it holds (:meth:`daemon.controlnode.rendezvous_watch.RendezvousWatch.status`,
    ``{}`` otherwise): a stall while the store does not answer says so, for its message
    alone (a torchrun that exits over it reads as ``rendezvous_closed``) would send the
    operator the wrong way."""

    def __init__(self, core: Core, *, migrating: Callable[[], bool],
                 store_alarm: Callable[[], dict[str, Any]] = dict) -> None:
        self.core = core
        self._store_alarm = store_alarm
        spec = core.config.daemon.stall
        self.rules = StallRules(first_step_s=spec.first_step_s, floor_s=spec.floor_s,
                                step_factor=spec.step_factor, exit_grace_s=spec.exit_grace_s)
        self._migrating = migrating
        self.progress: Progress | None = None  # from the first pass (a restarted daemon waits anew)
        self.exit_codes: dict[str, int] = {}  # node id → its trainer's last exit status

    def on_event(self, ev: Event) -> None:
        """An event listener: keeps each node's last trainer exit status."""
        code = ev.data.get("exit_code") if isinstance(ev.data, dict) else None
        if ev.kind == EventKind.TRAINER_EXITED.value and ev.node and isinstance(code, int):
            self.exit_codes[ev.node] = code

    def check(self, now: float) -> list[Action]:
        """One pass (``now``: unix s): the actions for a stall, or none. First, for the
        user's own script (``job.command``): whether it has finished
        (:func:`~daemon.control.reactions.script_completed`), which ends the job."""
        core = self.core
        s = core.state()
        script = core.config.job.command is not None
        if script and script_completed(s, self.exit_codes):
            self._complete_script(s)
            return []
        progress = observe(self.progress or Progress(since=now, attempt=s.attempt), s, step=core.job.step, now=now)
        migrating = self._migrating()
        stall = check(progress, s, now=now, rules=self.rules, exit_codes=self.exit_codes,
                      migrating=migrating, steps_expected=not script or core.job.step is not None)
        if stall is None:
            self.progress = progress
            if core.config.job.grow != "in_process":
                return []
            leave = left_behind(progress, s, now=now, rules=self.rules, exit_codes=self.exit_codes,
                                migrating=migrating)
            for action in leave:
                log.warning("node_left_behind", pool=core.pool, node_id=action.node_id, reason=action.reason,
                            step=core.job.step)
            return leave
        self.progress = progress.recovered(now)  # the next report, if it lasts, one bound later
        actions = recover(s, stall, frozenset(core.config.valid_world_sizes()))
        alarm = self._store_alarm()
        if alarm:
            said = "; " + store_sentence(alarm)
            actions = [dataclasses.replace(a, message=a.message + said) if isinstance(a, JobStalled) else a
                       for a in actions]
        for action in actions:
            if isinstance(action, JobStalled):
                for node_id in action.restart:  # their next exit is the restarted trainer's
                    self.exit_codes.pop(node_id, None)
        log.warning("job_stalled", pool=core.pool, reason=stall.reason, message=stall.message,
                    idle_s=round(stall.idle_s, 1), step=core.job.step, recoveries=self.progress.recoveries)
        return actions

    def _complete_script(self, s: PoolState) -> None:
        """``job_completed`` for a script's end: the job holds nothing from now on."""
        core = self.core
        nodes = sorted(n.id for n in s.in_domain().in_state(*ADMITTED))
        core.act(CompleteJob(context=(("how", "every_trainer_exited_0"), ("nodes", nodes))))  # job_completed
        log.info("job_completed", pool=core.pool, how="every_trainer_exited_0", nodes=nodes)
