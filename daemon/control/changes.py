"""Changes of the supervisor's own state that its parts ask for: typed values the
supervisor applies. Nothing here does I/O.

The supervisor (:class:`daemon.controlnode.supervisor.Supervisor`) is the only code that
changes its state: the operator's target and pause, what the pool should hold now, the
job's lifecycle (:class:`~daemon.control.state.JobView`), the grow in flight. A part
(:mod:`daemon.controlnode.operator`, :mod:`daemon.controlnode.job_life`, ...) parses its
input, decides (a pure function where there is a decision), and hands the supervisor
the change as one of these values: ``core.act(change)``, the same door as a decision's
:mod:`~daemon.control.actions`. Its apply arm (:class:`daemon.controlnode.actuator.Actuator`)
carries it out and writes to the store what must outlive a daemon restart;
``tests/test_layout.py`` checks that no other module assigns the supervisor's fields.

- :class:`SetTarget`: the operator's target size (``spotctl scale``).
- :class:`SetDesired`: what the pool should hold now (the planner's goal).
- :class:`Pause` / :class:`Unpause`: ``spotctl pause`` / ``resume`` of a paused job.
- :class:`EndJob` / :class:`Relaunch`: the job ends failed or cancelled / starts again.
- :class:`CompleteJob`: the job is done; the pool holds nothing from now on.

Adding one: a frozen dataclass here whose docstring says what it changes (and what it
writes to the store), a member of :data:`Change`, and its entry in the actuator's table
(``Actuator.__init__``: the type → the method that applies it).

Example: ``spotctl scale 4`` while 2 nodes run → the operator checks it
(:func:`daemon.control.operator.check_scale`), then ``act(SetTarget(4))``,
``act(SetDesired(4, "scale"))``; the next pass plans two launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from daemon.control.job_types import JobProgress
from daemon.control.lifecycle import JobState
from daemon.control.migration import ResetStart

__all__ = ["SetTarget", "SetDesired", "Pause", "Unpause", "EndJob", "Relaunch", "CompleteJob", "Change"]


@dataclass(frozen=True, slots=True)
class SetTarget:
    """The operator's target size (``spotctl scale``; nodes), which a pending job waits
    for. Written to the store when it changes, so a restarted daemon keeps it; not when
    ``restored`` (read back from the store at start, perhaps clamped to the config's
    bounds: the stored value stays as the operator set it)."""

    nodes: int
    restored: bool = False


@dataclass(frozen=True, slots=True)
class SetDesired:
    """What the pool should hold now (nodes): the planner launches or releases towards
    it. ``reason``: who asked (``scale``, ``restored``)."""

    nodes: int
    reason: str


@dataclass(frozen=True, slots=True)
class Pause:
    """``spotctl pause``: the job ``paused`` and the pool's desired size 0; the pause is
    written to the store (a restarted daemon stays paused). The target is kept."""

    reason: str = "spotctl pause"


@dataclass(frozen=True, slots=True)
class Unpause:
    """``spotctl resume`` of a paused job: the pause is cleared (in the store too), the
    job is ``pending`` (its first nodes up start it together; the wait for them starts
    over) and the pool's desired size is the operator's target again."""

    reason: str = "spotctl resume"


@dataclass(frozen=True, slots=True)
class EndJob:
    """The job ends ``state`` (failed or cancelled) because of ``why`` (``spotctl status``
    shows it): no pause, desired size 0 (the planner releases every node; the checkpoints
    stay). ``at`` (unix s): written to the store as ``job_end`` with the pause cleared;
    None: the end was read back from the store at start (nothing is written)."""

    state: JobState
    why: str
    at: float | None = None


@dataclass(frozen=True, slots=True)
class Relaunch:
    """``spotctl resume`` of a failed or cancelled job: its end is cleared (in the store
    too), the job is ``pending`` and the pool's desired size is the operator's target."""

    reason: str = "spotctl resume"


@dataclass(frozen=True, slots=True)
class CompleteJob:
    """The job is done: ``completed``, at ``step`` (None: the step it last reported),
    ``job_completed`` recorded about ``node`` with the step and ``context``'s fields, and
    the pool holds nothing from now on (the supervisor's ``job_completed``)."""

    node: str | None = None
    step: int | None = None
    context: tuple[tuple[str, Any], ...] = ()


# with the job tracker's JobProgress (control/job.py) and the migrator's ResetStart (control/migration.py)
Change = Union[SetTarget, SetDesired, Pause, Unpause, EndJob, Relaunch, CompleteJob, JobProgress, ResetStart]
