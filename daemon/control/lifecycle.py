"""The three lifecycles the control plane reasons about: node, job and trainer.

Each is a string enum (its values are what the store, the API and the feed carry)
with a transition table; a change the table does not list raises
:class:`IllegalTransition` at the moment it is attempted, before anything is written,
so a bug shows up where it happens, not as a leaked instance later.

The **named sets** below are the only spelling of "which nodes count for what":

========================  ============================================================
:data:`LIVE`              has (or is about to have) a heartbeating agent
:data:`COUNTED`           counts as capacity towards the pool's target. ``draining`` is
                          not in it: that is *the* decision that launches a replacement
                          the moment a notice arrives, while the noticed node flushes
:data:`ADMITTED`          admitted into the job by the daemon and not leaving
:data:`MEMBERS`           its trainer may be part of the job: its status lines count
:func:`training`          admitted and its trainer is running (checkpoint requests go here)
:func:`leaving`           draining, trainer still running (its notice commit is pending)
========================  ============================================================

Pure: no I/O, no clock.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, Protocol, TypeVar

__all__ = [
    "IllegalTransition",
    "NodeState",
    "JobState",
    "TrainerState",
    "NODE_TRANSITIONS",
    "JOB_TRANSITIONS",
    "TRAINER_TRANSITIONS",
    "check_transition",
    "check_job_transition",
    "check_trainer_transition",
    "LIVE",
    "COUNTED",
    "ADMITTED",
    "MEMBERS",
    "NOT_IN_JOB_YET",
    "training",
    "leaving",
]


class IllegalTransition(RuntimeError):
    """A lifecycle change that the transition table does not allow."""


class NodeState(str, Enum):
    """Where one node (one spot instance) is in its life.

    requested → launching → (preparing →) ready → (admitting →) running → draining →
    terminated, with ``lost`` (gone without notice) and ``failed`` (launch failed, or its
    ``job.setup`` / code fetch failed while ``preparing``) as the other ends.
    """

    REQUESTED = "requested"  # launch decided, provider call in flight
    LAUNCHING = "launching"  # provider accepted; instance boots; no heartbeat yet
    # agent registered; fetching job.workdir and running job.setup (never admitted while so)
    PREPARING = "preparing"
    READY = "ready"  # agent registered; not yet part of the training job
    ADMITTING = "admitting"  # waiting for the job's rejoin checkpoint before joining
    RUNNING = "running"  # its torchrun agent is part of the job
    DRAINING = "draining"  # interruption notice (or drain request): leaving soon
    TERMINATED = "terminated"  # gone, as planned (after a drain, a release, a scale-in)
    LOST = "lost"  # gone without notice (heartbeat lost or provider says it's gone)
    FAILED = "failed"  # the launch failed (capacity, quota, boot timeout), or its preparation

    @classmethod
    def terminal(cls) -> frozenset["NodeState"]:
        return _NODE_TERMINAL

    def is_terminal(self) -> bool:
        return self in _NODE_TERMINAL


class JobState(str, Enum):
    """The training job's life, as the daemon sees it (from the trainer's own reports).

    pending → running → completed; ``paused`` by the operator (``spotctl pause``) and
    back to ``pending`` on ``resume``; ``running → pending`` when a recovery policy
    restarts the whole pool (:class:`daemon.control.policies.RestartOnPreemption`).
    A job that cannot grow (every offer out of capacity) stays ``pending`` or
    ``running`` and says why in its events; it is never given up for that.

    ``failed``: its trainer failed ``job.max_restarts_on_errors`` tries in a row without
    progress (:mod:`daemon.control.tries`); ``cancelled``: the operator's ``spotctl down``.
    Both hold no node and keep the checkpoints; only the operator's ``spotctl resume``
    takes them back to ``pending``. Terminal (:meth:`is_terminal`): nothing the daemon
    does by itself starts the job again; ``completed`` is the only end for good.
    """

    PENDING = "pending"  # waiting for the first nodes
    RUNNING = "running"  # at least one node's trainer is part of the job
    PAUSED = "paused"  # operator's `spotctl pause`: committed, capacity released; `resume` → pending
    COMPLETED = "completed"  # the trainer reported its target step, final checkpoint committed
    FAILED = "failed"  # job.max_restarts_on_errors tries without progress: every node released
    CANCELLED = "cancelled"  # spotctl down: committed (bounded wait), every node released

    @classmethod
    def terminal(cls) -> frozenset["JobState"]:
        return _JOB_TERMINAL

    def is_terminal(self) -> bool:
        return self in _JOB_TERMINAL


class TrainerState(str, Enum):
    """A node's torchrun, as its agent runs it and its heartbeats report it.

    not_started → (warming →) running → exited. ``warming``: the prewarmed torchrun
    process is importing (``daemon/gpunode/launcher.py``), not yet handed the job; it goes back
    to ``not_started`` once imported (held, ready) or if the import failed. ``exited →
    not_started``: the daemon restarts it in place, the job having stalled
    (:mod:`daemon.control.stall`; a running one is stopped first).
    """

    NOT_STARTED = "not_started"
    WARMING = "warming"
    RUNNING = "running"
    EXITED = "exited"


_N, _J, _T = NodeState, JobState, TrainerState
_NODE_TERMINAL = frozenset({_N.TERMINATED, _N.LOST, _N.FAILED})
_JOB_TERMINAL = frozenset({_J.COMPLETED, _J.FAILED, _J.CANCELLED})

NODE_TRANSITIONS: Mapping[NodeState, frozenset[NodeState]] = {
    _N.REQUESTED: frozenset({_N.LAUNCHING, _N.FAILED, _N.TERMINATED}),
    _N.LAUNCHING: frozenset({_N.READY, _N.PREPARING, _N.LOST, _N.FAILED, _N.TERMINATED, _N.DRAINING}),
    _N.PREPARING: frozenset({_N.READY, _N.LOST, _N.FAILED, _N.TERMINATED, _N.DRAINING}),
    _N.READY: frozenset({_N.ADMITTING, _N.RUNNING, _N.DRAINING, _N.LOST, _N.TERMINATED}),
    _N.ADMITTING: frozenset({_N.RUNNING, _N.READY, _N.DRAINING, _N.LOST, _N.TERMINATED}),
    _N.RUNNING: frozenset({_N.DRAINING, _N.LOST, _N.TERMINATED}),
    _N.DRAINING: frozenset({_N.TERMINATED, _N.LOST}),
    _N.TERMINATED: frozenset(),
    _N.LOST: frozenset(),
    _N.FAILED: frozenset(),
}

JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    _J.PENDING: frozenset({_J.RUNNING, _J.PAUSED, _J.COMPLETED, _J.FAILED, _J.CANCELLED}),
    _J.RUNNING: frozenset({_J.PENDING, _J.PAUSED, _J.COMPLETED, _J.FAILED, _J.CANCELLED}),
    # a pause's drain commit may be the final step: the trainer then reports completed
    _J.PAUSED: frozenset({_J.PENDING, _J.COMPLETED, _J.CANCELLED}),
    _J.COMPLETED: frozenset(),
    _J.FAILED: frozenset({_J.PENDING}),  # spotctl resume
    # spotctl resume; a down's drain commit may be the final step, as for a pause
    _J.CANCELLED: frozenset({_J.PENDING, _J.COMPLETED}),
}

TRAINER_TRANSITIONS: Mapping[TrainerState, frozenset[TrainerState]] = {
    _T.NOT_STARTED: frozenset({_T.WARMING, _T.RUNNING}),
    _T.WARMING: frozenset({_T.NOT_STARTED, _T.RUNNING}),
    _T.RUNNING: frozenset({_T.EXITED}),
    _T.EXITED: frozenset({_T.NOT_STARTED}),  # restarted in place: the job stalled
}

_E = TypeVar("_E", bound=Enum)


def _check(what: str, table: Mapping[_E, frozenset[_E]], old: _E, new: _E) -> None:
    if old is not new and new not in table[old]:
        raise IllegalTransition(f"{what} state {old.value} → {new.value} is not allowed")


def check_transition(old: NodeState, new: NodeState) -> None:
    """Raises IllegalTransition unless ``old → new`` is in :data:`NODE_TRANSITIONS` (same state: no-op)."""
    _check("node", NODE_TRANSITIONS, old, new)


def check_job_transition(old: JobState, new: JobState) -> None:
    """Raises IllegalTransition unless ``old → new`` is in :data:`JOB_TRANSITIONS` (same state: no-op)."""
    _check("job", JOB_TRANSITIONS, old, new)


def check_trainer_transition(old: TrainerState, new: TrainerState) -> None:
    """Raises IllegalTransition unless ``old → new`` is in :data:`TRAINER_TRANSITIONS` (same state: no-op)."""
    _check("trainer", TRAINER_TRANSITIONS, old, new)


LIVE = frozenset({_N.LAUNCHING, _N.PREPARING, _N.READY, _N.ADMITTING, _N.RUNNING, _N.DRAINING})
COUNTED = frozenset({_N.REQUESTED, _N.LAUNCHING, _N.PREPARING, _N.READY, _N.ADMITTING, _N.RUNNING})
ADMITTED = frozenset({_N.RUNNING})
MEMBERS = frozenset({_N.RUNNING, _N.DRAINING})
# removed first when the pool shrinks, in this order: nodes not yet part of the job, youngest first
NOT_IN_JOB_YET = (_N.REQUESTED, _N.LAUNCHING, _N.PREPARING, _N.READY, _N.ADMITTING)


class _HasStates(Protocol):
    @property
    def state(self) -> NodeState: ...
    @property
    def trainer(self) -> TrainerState | str: ...


def training(node: _HasStates) -> bool:
    """Admitted and its trainer runs: the node a checkpoint request or a drain reaches."""
    return node.state is _N.RUNNING and node.trainer == _T.RUNNING


def leaving(node: _HasStates) -> bool:
    """Draining with its trainer still running: still in the job until its notice commit."""
    return node.state is _N.DRAINING and node.trainer == _T.RUNNING
