"""The control plane's view of the job and of one grow in progress. Pure data.

:class:`JobView` is what the daemon knows of the training job from the trainer's own
reports; its state moves only through :meth:`JobView.to`, which checks
:data:`daemon.control.lifecycle.JOB_TRANSITIONS`. :class:`Rejoin` is the one grow in
flight: the nodes waiting in ``admitting`` for the job's rejoin commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.control.lifecycle import JobState, check_job_transition

__all__ = ["JobView", "Rejoin"]


@dataclass(slots=True)
class JobView:
    """What the daemon knows of the training job. Steps are the trainer's optimizer
    steps; times are unix seconds; ``attempts``: the trainer attempts that reported
    ``started`` (a restart or an in-process resize each make one)."""

    _state: JobState = JobState.PENDING
    step: int | None = None
    world_size: int | None = None
    last_commit_step: int | None = None
    last_commit_time: float | None = None
    last_commit_bytes: int | None = None  # the newest commit's size (what a migration copies)
    started_at: float | None = None
    resumed_at: float | None = None
    attempts: set[str] = field(default_factory=set)
    attempt: str | None = None  # the newest attempt recorded (job_resumed): the one running
    resizes_in_process: int = 0  # attempts that were the survivors going on in their processes
    commit_steps: set[int] = field(default_factory=set)  # steps with a checkpoint_committed event
    end_reason: str | None = None  # why the job is failed or cancelled (spotctl status)

    @property
    def state(self) -> JobState:
        return self._state

    def to(self, new: JobState) -> None:
        """Move the job to ``new``.

        Raises:
            daemon.control.lifecycle.IllegalTransition: the table does not allow it
                (the state is unchanged).
        """
        check_job_transition(self._state, new)
        self._state = new


@dataclass(slots=True)
class Rejoin:
    """A grow in flight: ``id`` is the checkpoint request the running nodes were sent,
    ``nodes`` the nodes admitted once it is answered, ``requested_at`` unix seconds."""

    id: str
    nodes: set[str]
    requested_at: float
    answered: bool = False
