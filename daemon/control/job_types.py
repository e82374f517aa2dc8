"""The job tracker's types (:mod:`daemon.control.job` has the rules): its frozen state,
the messages :func:`daemon.control.job.step` takes, the actions it returns, and the caps
on what one node can make it keep. Times are unix seconds, sizes bytes, steps the
trainer's optimizer steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from daemon.control.lifecycle import JobState, NodeState
from daemon.control.reports import StatusLine

__all__ = [
    "RESUME_HOLD_S", "VERIFY_PENDING_MAX", "STARTS_KEPT", "UNLED_KEPT", "HELD_KEPT", "EARLY_KEPT",
    "Settings", "JobRecord", "JobTrack", "World", "Held", "EarlyCommit", "Flush",
    "StoredResume", "StoredCommit", "Restore", "Status", "Heartbeat", "Verified", "CommitRead", "WatchFlush",
    "CheckFlushes", "CheckHolds", "Message",
    "JobProgress", "ResumeRecorded", "CommitRecorded", "CompletionRecorded", "WorldSizeChanged", "FlushTimedOut",
    "CompletionUnverified", "Drop", "Verify", "ReadCommit", "JobAction",
]

#: a resume whose commit no node has reported yet (and a commit whose attempt's start has
#: not come) waits this long (seconds) before the store settles it
RESUME_HOLD_S = 10.0
#: a node's reported commits waiting for their manifest's read: one token cannot queue more
VERIFY_PENDING_MAX = 16
#: the ``started`` lines kept per node (its newest): the other nodes' word on who leads an attempt
STARTS_KEPT = 4
#: lines of an attempt nobody leads yet, kept per node until it is led (its oldest goes first)
UNLED_KEPT = 4
#: resumes and completions held for their commit, per node (more: the newest is dropped)
HELD_KEPT = 16
#: commits held for their attempt's start, per node (more: the newest is dropped)
EARLY_KEPT = 16


# -- the state ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """The job's settings the rules read: ``verify_commits`` (a commit counts once its
    manifest verifies: ``daemon.verify_commits``), ``target_steps`` (a completion counts
    only there), ``confirm_attempts`` (failed reads of a held line's commit before a
    resume is recorded unconfirmed)."""

    verify_commits: bool = True
    target_steps: int = 0
    confirm_attempts: int = 3


@dataclass(frozen=True, slots=True)
class JobRecord:
    """The job view's fields only the trainer's lines change (:class:`~daemon.control.state.JobView`
    has the same names): steps are optimizer steps, times unix seconds, bytes bytes."""

    step: int | None = None
    attempt: str | None = None  # the newest attempt recorded: the one running
    attempts: frozenset[str] = frozenset()
    world_size: int | None = None
    resumed_at: float | None = None
    last_commit_step: int | None = None
    last_commit_time: float | None = None  # the trainer's clock (unix s)
    last_commit_bytes: int | None = None
    commit_steps: frozenset[int] = frozenset()
    resizes_in_process: int = 0


@dataclass(frozen=True, slots=True)
class Held:
    """A line waiting: a resume or a completion for its commit, or a line of an attempt
    nobody leads yet for its leader; ``since`` unix s (None ``node``: the store's word)."""

    node: str | None
    line: StatusLine
    since: float


@dataclass(frozen=True, slots=True)
class EarlyCommit:
    """A commit reported before its attempt's start was recorded; ``unconfirmed``: the
    store was out of reach; ``verified``: its manifest was read and verifies."""

    node: str | None
    line: StatusLine
    since: float
    unconfirmed: bool = False
    verified: bool = False


@dataclass(frozen=True, slots=True)
class Flush:
    """A notice's commit due from ``node`` by ``due`` (unix s, grace included)."""

    node: str
    due: float


@dataclass(frozen=True, slots=True)
class JobTrack:
    """Everything the tracker knows (frozen: :func:`step` returns a new one). The
    mappings are never changed in place."""

    settings: Settings = Settings()
    record: JobRecord = JobRecord()
    leader_of: Mapping[str, str] = field(default_factory=dict)  # attempt → the node of its rank 0 (taken)
    starts: Mapping[str, tuple[StatusLine, ...]] = field(default_factory=dict)  # node → its newest started lines
    node_attempt: Mapping[str, str] = field(default_factory=dict)  # node → the attempt its workers last started
    unled: tuple[Held, ...] = ()  # lines of attempts nobody leads yet
    held: tuple[Held, ...] = ()  # resumes and completions waiting for their commit
    early: tuple[EarlyCommit, ...] = ()  # commits waiting for their attempt's start
    flushes: Mapping[str, Flush] = field(default_factory=dict)  # notice id → its flush, until its commit
    verifying: Mapping[str, int] = field(default_factory=dict)  # node → its commits waiting for a read
    confirming: frozenset[int] = frozenset()  # steps whose manifest is being read for a held line
    confirm_failures: Mapping[int, int] = field(default_factory=dict)  # step → failed reads
    answered: frozenset[str] = frozenset()  # notice and request ids a recorded commit named
    started: frozenset[str] = frozenset()  # attempts whose resume is recorded
    unconfirmed: frozenset[int] = frozenset()  # commit steps recorded with the store out of reach
    said_unverified: frozenset[int] = frozenset()  # steps whose completion_unverified is recorded
    attempt_time: float | None = None  # the running attempt's started line's time (the trainer's clock, unix s)

    def running_leader(self) -> str | None:
        """The node that holds rank 0 of the attempt the job runs (None: none recorded)."""
        return self.leader_of.get(self.record.attempt or "")

    def attempt_of(self, node: str) -> str:
        """The attempt ``node``'s workers last reported starting ("" if none)."""
        return self.node_attempt.get(node, "")

    def undecided(self, node: str) -> int:
        """``node``'s lines not decided yet (neither recorded nor dropped): its commits
        waiting for a read, its lines held for a commit or waiting for their attempt's
        leader, its commits waiting for their attempt's start. Only memory holds them."""
        return self.verifying.get(node, 0) + sum(1 for h in (*self.held, *self.unled, *self.early) if h.node == node)


@dataclass(frozen=True, slots=True)
class World:
    """What the rules read of the supervisor: ``now`` (unix s), every known node's state,
    the job's state."""

    now: float
    nodes: Mapping[str, NodeState]
    job_state: JobState = JobState.RUNNING


# -- the messages -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredResume:
    """A ``job_resumed`` event in the store: ``attempt``, led by ``node``; when (``time``,
    unix s) and at which ``world_size`` (None: not stored)."""

    attempt: str
    node: str | None
    time: float | None = None
    world_size: int | None = None


@dataclass(frozen=True, slots=True)
class StoredCommit:
    """A ``checkpoint_committed`` event in the store."""

    step: int
    unconfirmed: bool
    notice_ids: tuple[str, ...] = ()
    time: float | None = None  # the trainer's time of the commit (the event's ``trainer_time``)
    bytes: int | None = None  # its size, when the trainer reported it


@dataclass(frozen=True, slots=True)
class Restore:
    """A restarted daemon takes over: the store's resumes and commits (oldest first), each
    node's last step, whether a node is in the job (``running``), whether a
    ``job_completed`` is stored."""

    resumes: tuple[StoredResume, ...] = ()
    commits: tuple[StoredCommit, ...] = ()
    node_steps: Mapping[str, int | None] = field(default_factory=dict)
    running: bool = False
    completed: bool = False


@dataclass(frozen=True, slots=True)
class Status:
    """A trainer's status line (``line.event``: ``started``, ``checkpoint_committed`` or
    ``completed``) as ``node``'s agent forwarded it."""

    node: str
    line: StatusLine


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A heartbeat of ``node`` at optimizer step ``step`` (bounded already)."""

    node: str
    step: int


@dataclass(frozen=True, slots=True)
class Verified:
    """The manifest read of a commit ``node`` reported (:class:`Verify`): ``problem`` why
    the store does not bear it out (None: it does; ``line.bytes`` then filled from the
    manifest), ``unreachable``: the store was out of reach every try."""

    node: str
    line: StatusLine
    problem: str | None = None
    unreachable: bool = False


@dataclass(frozen=True, slots=True)
class CommitRead:
    """The read of ``step``'s manifest for a held line (:class:`ReadCommit`): ``line`` the
    commit as the manifest tells it (None: not committed), or ``error`` (the store out of
    reach)."""

    step: int
    line: StatusLine | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WatchFlush:
    """Notice ``notice_id``'s commit is due from ``node`` by ``due`` (unix s, grace included)."""

    notice_id: str
    node: str
    due: float


@dataclass(frozen=True, slots=True)
class CheckFlushes:
    """A reconcile pass: a notice whose commit has not come by its deadline is its own event."""


@dataclass(frozen=True, slots=True)
class CheckHolds:
    """A reconcile pass: decide waiting claims again, end the holds that are over."""


Message = Union[Restore, Status, Heartbeat, Verified, CommitRead, WatchFlush, CheckFlushes, CheckHolds]


# -- the actions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobProgress:
    """The job view's new fields, for the supervisor to apply: ``record`` replaces the
    fields of :class:`JobRecord`; ``started_at`` (unix s) is the job's start where it has
    none yet; ``state`` moves the job (None: stays); ``answers``: the notice and request
    ids a commit answered (a rejoin in flight whose request is among them is answered)."""

    record: JobRecord
    started_at: float | None = None
    state: JobState | None = None
    answers: tuple[str, ...] = ()

    def fields(self) -> list[tuple[str, object]]:
        """``record``'s fields as the job view holds them (sets, not frozensets)."""
        return [(f.name, set(v) if isinstance(v := getattr(self.record, f.name), frozenset) else v)
                for f in dataclasses.fields(self.record)]


@dataclass(frozen=True, slots=True)
class ResumeRecorded:
    """Record ``job_resumed`` of ``line`` from ``node`` (None: released by the store's
    word); ``lost_steps``: the highest step reached before minus the one resumed at."""

    node: str | None
    line: StatusLine
    lost_steps: int
    commit_unconfirmed: bool = False


@dataclass(frozen=True, slots=True)
class CommitRecorded:
    """Record ``checkpoint_committed`` of ``line``; ``source`` ``"store"`` when the store's
    manifest told it; ``world_size`` the job's (for the measured deadline checks)."""

    node: str | None
    line: StatusLine
    world_size: int | None
    source: str | None = None
    unconfirmed: bool = False


@dataclass(frozen=True, slots=True)
class CompletionRecorded:
    """Record ``job_completed`` at ``step`` of ``attempt``: the job is over."""

    node: str | None
    step: int
    attempt: str


@dataclass(frozen=True, slots=True)
class WorldSizeChanged:
    """Record ``world_size_changed`` from ``old`` to ``new`` ranks."""

    old: int | None
    new: int | None


@dataclass(frozen=True, slots=True)
class FlushTimedOut:
    """Record ``checkpoint_flush_timed_out`` of ``notice_id`` (``overdue_s`` seconds past
    its deadline); the job will resume from ``last_commit_step``."""

    node: str
    notice_id: str
    overdue_s: float
    last_commit_step: int | None


@dataclass(frozen=True, slots=True)
class CompletionUnverified:
    """Record ``completion_unverified``: the final commit at ``step`` could not be read
    ``reads`` times (``error``), so the job is not over yet."""

    node: str | None
    step: int
    attempt: str
    reads: int
    error: str


@dataclass(frozen=True, slots=True)
class Drop:
    """Drop ``node``'s line (``event``): one log line, one count; ``problem`` says why."""

    node: str
    problem: str
    event: str


@dataclass(frozen=True, slots=True)
class Verify:
    """Read the manifest of the commit ``node`` reported, then send :class:`Verified`."""

    node: str
    line: StatusLine


@dataclass(frozen=True, slots=True)
class ReadCommit:
    """Read ``step``'s manifest for the lines held on it, then send :class:`CommitRead`."""

    step: int


JobAction = Union[JobProgress, ResumeRecorded, CommitRecorded, CompletionRecorded, WorldSizeChanged, FlushTimedOut,
                  CompletionUnverified, Drop, Verify, ReadCommit]
