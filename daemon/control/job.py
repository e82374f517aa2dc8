"""The job as its trainer reports it, decided purely: attempts, commits, resumes and the
completion, in causal order, and only from the node that holds rank 0.

:func:`step` takes the tracker's state (:class:`JobTrack`), one message and the
:class:`World` (the time and the supervisor's view of the nodes and the job) and returns
the new state and the actions the :class:`~daemon.controlnode.job_tracker.JobTracker`
carries out: events to record, reports to drop, manifests to read, and
:class:`JobProgress`, the job view's changes, which the supervisor's actuator applies.

Messages: :class:`Restore` (a restarted daemon's store), :class:`Status` (a trainer's
``started``, ``checkpoint_committed`` or ``completed`` line), :class:`Heartbeat` (a
heartbeat's step), :class:`Verified` (a reported commit's manifest read),
:class:`CommitRead` (a held line's commit read from the store), :class:`WatchFlush`,
:class:`CheckFlushes` and :class:`CheckHolds` (a reconcile pass).

Rank 0 (:mod:`daemon.control.attempts` decides who leads an attempt: every ``started``
line is that rule's input). A line changes the job only from the node that leads its
attempt, or, for a commit, the node whose own notice it answers (its notice ids start
with ``<node>:``); a line of an attempt nobody leads yet, from rank 0, waits for its
leader (:data:`UNLED_KEPT` a node, :data:`RESUME_HOLD_S` at most); ``completed`` counts
only at the job's target step; a heartbeat's step is the job's only from the running
attempt's leader, and only forward.

Causal order, both ways: a resume (``started`` with ``resumed_from``) whose commit is not
recorded yet is held until it is, and so is a completion whose final commit is not
verified; a commit of an attempt whose start is not recorded yet waits for that start.
A node's starts are recorded in its order: a start taken while an earlier one of its
node is held waits behind it, and a claim taken takes its node's earlier waiting claims
first (rule 1 would take them right after; recorded after their successor, an older
resume would read as the job going back to a commit it had passed).
Holds end: a held resume or completion after :data:`RESUME_HOLD_S` asks for its commit's
manifest (:class:`ReadCommit`): found, the commit is recorded (``source: "store"``) and
the line goes on; not committed, the line is dropped; the store out of reach
``confirm_attempts`` times, a resume is recorded ``commit_unconfirmed`` (a completion
never is: it waits, and one :class:`CompletionUnverified` says why). An early commit
after :data:`RESUME_HOLD_S` is recorded if it can be trusted (its manifest verified, or
its node leads its attempt or answers its own notice), else dropped; but while its
attempt's start is itself held (for a commit the store will settle) it waits on, and a
held line whose commit is such an early commit reads nothing: that commit is known, and
goes on with its attempt's start (except a held start whose own attempt reported that
commit again, a notice answered at the step it resumed from: the store settles it). (Before the job's first start is recorded there is no
order to keep: a commit that can be trusted is recorded at once.)

Example: n1 leads ``a1``; n1 is noticed, commits step 40 and leaves; the survivor n2
reports ``started`` of ``a2`` (rank 0, resumed from 40) before n1's commit report
arrives. n2's claim is taken (it is the only admitted node), its resume is held; n1's
commit of 40 is recorded, then the resume: the event log shows ``checkpoint_committed
40`` before ``job_resumed a2``.

Bounds: what one node sends cannot grow the state without bound: its kept ``started``
lines (:data:`STARTS_KEPT`), its lines waiting for a leader (:data:`UNLED_KEPT`, the
oldest goes), its commits waiting for a read (:data:`VERIFY_PENDING_MAX`), its held
lines (:data:`HELD_KEPT`) and early commits (:data:`EARLY_KEPT`; past these, the newest
is dropped). The attempts recorded (and their leaders) grow by one per start the rules
accept: the job's own history, which only a node admitted to the job can add to.
"""

from __future__ import annotations

import dataclasses

from daemon.control.attempts import StartReport, Verdict, claim_verdict
from daemon.control.job_types import (
    EARLY_KEPT, HELD_KEPT, RESUME_HOLD_S, STARTS_KEPT, UNLED_KEPT, VERIFY_PENDING_MAX, CheckFlushes, CheckHolds,
    CommitRead, CommitRecorded, CompletionRecorded, CompletionUnverified, Drop, EarlyCommit, Flush, FlushTimedOut,
    Heartbeat, Held, JobAction, JobProgress, JobRecord, JobTrack, Message, ReadCommit, Restore, ResumeRecorded,
    Settings, Status, StoredCommit, StoredResume, Verified, Verify, WatchFlush, World, WorldSizeChanged,
)
from daemon.control.lifecycle import ADMITTED, MEMBERS, JobState
from daemon.control.reactions import FLUSH_GRACE_S
from daemon.control.reports import StatusLine

__all__ = [  # the types re-exported: one import for the tracker's whole vocabulary
    "RESUME_HOLD_S", "VERIFY_PENDING_MAX", "STARTS_KEPT", "UNLED_KEPT", "HELD_KEPT", "EARLY_KEPT",
    "Settings", "JobRecord", "JobTrack", "World", "Held", "EarlyCommit", "Flush",
    "StoredResume", "StoredCommit", "Restore", "Status", "Heartbeat", "Verified", "CommitRead", "WatchFlush",
    "CheckFlushes", "CheckHolds", "Message",
    "JobProgress", "ResumeRecorded", "CommitRecorded", "CompletionRecorded", "WorldSizeChanged", "FlushTimedOut",
    "CompletionUnverified", "Drop", "Verify", "ReadCommit", "JobAction", "step", "waits_on",
]


def waits_on(line: StatusLine) -> int | None:
    """The step whose commit a held line waits for: a resume's origin, a completion's step."""
    return line.step if line.event == "completed" else line.resumed_from


def step(state: JobTrack, message: Message, world: World) -> tuple[JobTrack, list[JobAction]]:
    """The tracker's state after ``message``, and what to do (in order).

    Raises:
        TypeError: ``message`` is not one of :data:`Message`.
    """
    run = _Run(state, world)
    handler = _HANDLERS.get(type(message))
    if handler is None:
        raise TypeError(f"not a job message: {message!r}")
    handler(run, message)
    return run.freeze(), run.actions


# -- the rules ----------------------------------------------------------------------------


def _own_notice(node: str | None, line: StatusLine) -> bool:
    return node is not None and any(i.startswith(f"{node}:") for i in line.notice_ids)


class _Run:
    """One :func:`step`: a working copy of the state (each field replaced, never changed
    in place, so the input state is untouched) and the actions so far."""

    def __init__(self, state: JobTrack, world: World) -> None:
        for f in dataclasses.fields(JobTrack):
            setattr(self, f.name, getattr(state, f.name))
        self.world = world
        self.job_state = world.job_state
        self.actions: list[JobAction] = []

    def freeze(self) -> JobTrack:
        return JobTrack(**{f.name: getattr(self, f.name) for f in dataclasses.fields(JobTrack)})

    # -- small helpers
    def progress(self, *, started_at: float | None = None, state: JobState | None = None,
                 answers: tuple[str, ...] = (), **changes: object) -> None:
        self.record = dataclasses.replace(self.record, **changes)
        if state is not None:
            self.job_state = state
        self.actions.append(JobProgress(self.record, started_at=started_at, state=state, answers=answers))

    def drop(self, node: str | None, problem: str, event: str) -> None:
        if node is not None and node in self.world.nodes:
            self.actions.append(Drop(node, problem, event))

    def mine(self, held: tuple[Held, ...] | tuple[EarlyCommit, ...], node: str | None) -> int:
        return sum(1 for h in held if h.node == node)

    def running_leader(self) -> str | None:
        return self.leader_of.get(self.record.attempt or "")

    def settled(self, step_: int) -> bool:
        """A completion at ``step_`` may be recorded: its commit recorded and verified."""
        return not self.settings.verify_commits or (
            step_ in self.record.commit_steps and step_ not in self.unconfirmed)

    # -- rank 0
    def status(self, node: str, line: StatusLine) -> None:
        state = self.world.nodes.get(node)
        if state not in MEMBERS:
            state_word = state.value if state is not None else "unknown"
            return self.drop(node, f"node is {state_word}, not in the job", line.event)
        leader = self.leader_of.get(line.attempt)
        if line.event == "started":
            return self.on_started(node, line, leader)
        commit = line.event == "checkpoint_committed"
        if leader is None and line.rank == 0 and not commit:  # its attempt's start may still be waiting
            mine = [u for u in self.unled if u.node == node]
            self.unled = tuple(u for u in self.unled if len(mine) < UNLED_KEPT or u is not mine[0])
            self.unled += (Held(node, line, self.world.now),)
            return None
        if not (leader == node or (leader is None and line.rank == 0) or (commit and _own_notice(node, line))):
            return self.drop(node, f"{line.event} of attempt {line.attempt} from rank {line.rank} "
                             f"(attempt held by {leader or 'nobody'})", line.event)
        if commit:
            return self.reported_commit(node, line)
        if line.event == "completed":
            return self.completed(node, line)
        return None

    def on_started(self, node: str, line: StatusLine, leader: str | None) -> None:
        self.node_attempt = {**self.node_attempt, node: line.attempt}
        self.starts = {**self.starts, node: (*self.starts.get(node, ()), line)[-STARTS_KEPT:]}
        if line.rank == 0 and leader is not None and leader != node:
            self.drop(node, f"started of attempt {line.attempt} from rank 0 (attempt held by {leader})", line.event)
        elif line.rank == 0 and leader is None and self.claim(node, line) is Verdict.CONFLICT:
            self.drop(node, f"started of attempt {line.attempt} from rank 0, which another node claims too: "
                      "neither is taken", line.event)
        self.settle_claims()  # another node's word may be what a waiting claim needed

    def claim(self, node: str, line: StatusLine) -> Verdict:
        """A claim to rank 0 of an attempt nobody leads yet: taken, kept waiting, or refused."""
        nodes = self.world.nodes
        verdict = claim_verdict(
            StartReport(node, line.attempt, line.rank, line.world_size), running_leader=self.running_leader(),
            admitted=frozenset(n for n, s in nodes.items() if s in ADMITTED),
            reports=[StartReport(n, s.attempt, s.rank, s.world_size) for n, lines in self.starts.items() for s in lines])
        if verdict is Verdict.ACCEPT:
            self.take(node, line)
        return verdict

    def waiting(self) -> list[tuple[str, StatusLine]]:
        """The claims to rank 0 nobody has taken yet; the lines of nodes out of the job go first."""
        self.starts = {n: lines for n, lines in self.starts.items() if self.world.nodes.get(n) in MEMBERS}
        return [(n, s) for n, lines in self.starts.items() for s in lines if s.rank == 0 and s.attempt not in self.leader_of]

    def settle_claims(self) -> None:
        for node, line in self.waiting():
            if line.attempt not in self.leader_of:
                self.claim(node, line)

    def take(self, node: str, line: StatusLine) -> None:
        """``node`` leads ``line.attempt``; its own earlier claims nobody took go first, in
        its order (rule 1 would take them right after this one: the log keeps the node's
        order instead of recording its older attempts after their successor)."""
        mine = self.starts.get(node, ())
        before = mine[:max((i for i, s in enumerate(mine) if s == line), default=0)]
        for older in before:
            if older.rank == 0 and older.attempt not in self.leader_of and older.attempt != line.attempt:
                self.lead(node, older)
        self.lead(node, line)

    def lead(self, node: str, line: StatusLine) -> None:
        """``node`` leads ``line.attempt``: its start is recorded (after the commit it
        resumes from, and after the node's earlier starts still held), and the lines of
        that attempt that waited for a leader go on."""
        self.leader_of = {**self.leader_of, line.attempt: node}
        if not (line.attempt in self.record.attempts or any(h.line.attempt == line.attempt for h in self.held)):
            if ((line.resumed_from is not None and line.resumed_from not in self.record.commit_steps)
                    or any(h.node == node and h.line.event == "started" for h in self.held)):
                self.hold(node, line)
            else:
                self.resume(node, line)
        led = [u for u in self.unled if u.line.attempt == line.attempt]
        self.unled = tuple(u for u in self.unled if u.line.attempt != line.attempt)
        for u in led:
            if u.node is not None:
                self.status(u.node, u.line)

    def hold(self, node: str | None, line: StatusLine) -> None:
        if self.mine(self.held, node) >= HELD_KEPT:
            return self.drop(node, f"too many lines wait for their commit ({HELD_KEPT})", line.event)
        self.held += (Held(node, line, self.world.now),)
        return None

    # -- commits
    def reported_commit(self, node: str, line: StatusLine) -> None:
        if not self.settings.verify_commits:
            return self.commit(node, line)
        if line.step in self.record.commit_steps and self.answered.issuperset(line.notice_ids):
            return None  # a second report of a recorded commit
        if self.verifying.get(node, 0) >= VERIFY_PENDING_MAX:
            return self.drop(node, "too many commits wait for a read", line.event)
        self.verifying = {**self.verifying, node: self.verifying.get(node, 0) + 1}
        self.actions.append(Verify(node, line))
        return None

    def verified(self, m: Verified) -> None:
        left = self.verifying.get(m.node, 0) - 1
        self.verifying = {n: c for n, c in {**self.verifying, m.node: left}.items() if c > 0}
        if m.unreachable:
            self.commit(m.node, m.line, unconfirmed=True)
        elif m.problem is not None:
            self.drop(m.node, m.problem, m.line.event)
        else:
            self.commit(m.node, m.line, verified=True)

    def trusted(self, early: EarlyCommit) -> bool:
        """Its manifest verified, or its node leads its attempt or answers its own notice."""
        if early.verified or early.node is None:
            return early.verified
        return _own_notice(early.node, early.line) or self.leader_of.get(early.line.attempt) == early.node

    def commit(self, node: str | None, line: StatusLine, *, source: str | None = None, unconfirmed: bool = False,
               early_ok: bool = False, verified: bool = False) -> None:
        """Record one commit (once per step and notices), what it answers, then the lines
        that waited for it; a commit of an attempt whose start is not recorded waits."""
        early = EarlyCommit(node, line, self.world.now, unconfirmed, verified)
        if source is None and not early_ok and line.attempt not in self.started and (
                self.started or not self.trusted(early)):  # no start recorded yet: no order to keep
            if self.mine(self.early, node) >= EARLY_KEPT:
                return self.drop(node, f"too many commits wait for their attempt's start ({EARLY_KEPT})", line.event)
            self.early += (early,)
            return None
        step_, ids = line.step, tuple(line.notice_ids)
        self.flushes = {k: v for k, v in self.flushes.items() if k not in ids}
        if step_ in self.record.commit_steps and self.answered.issuperset(ids):
            if ids:  # a second report of a recorded commit (rank 0's and the noticed node's)
                self.actions.append(JobProgress(self.record, answers=ids))
            return None
        self.answered |= frozenset(ids)
        if unconfirmed and step_ not in self.record.commit_steps:
            self.unconfirmed |= {step_}
        elif not unconfirmed:
            self.unconfirmed -= {step_}
        changes: dict[str, object] = {"commit_steps": self.record.commit_steps | {step_}}
        last = self.record.last_commit_step
        if last is None or step_ >= last:
            changes.update(last_commit_step=step_, last_commit_time=line.time)
            if line.bytes is not None:
                changes["last_commit_bytes"] = line.bytes
        self.progress(answers=ids, **changes)
        self.actions.append(CommitRecorded(node, line, self.record.world_size, source, unconfirmed))
        self.release_held()
        return None

    def release_early(self, early: EarlyCommit) -> None:
        """An early commit whose wait is over: recorded if trusted, else dropped."""
        if self.trusted(early):
            self.commit(early.node, early.line, unconfirmed=early.unconfirmed, early_ok=True)
        else:
            self.drop(early.node, f"unverified commit of step {early.line.step} for attempt {early.line.attempt}, "
                      "which its node does not lead", early.line.event)

    # -- resumes and the completion
    def resume(self, node: str | None, line: StatusLine, *, commit_unconfirmed: bool = False) -> None:
        """Record ``line``'s start. One that a newer attempt's start overtook while it
        waited for its commit (its line older than the running attempt's) is recorded
        as it happened, but the job stays on the newer attempt, its step and world."""
        rec, now = self.record, self.world.now
        if (line.attempt != rec.attempt and line.time is not None and self.attempt_time is not None
                and line.time < self.attempt_time):
            self.progress(attempts=rec.attempts | {line.attempt})
            self.actions.append(ResumeRecorded(node, line, 0, commit_unconfirmed))
        else:
            reached = rec.step
            lost = reached - line.step if reached is not None and reached > line.step else 0
            old_world = rec.world_size
            self.progress(attempts=rec.attempts | {line.attempt}, attempt=line.attempt, step=line.step,
                          resumed_at=now, resizes_in_process=rec.resizes_in_process + (line.resized == "in_process"),
                          world_size=line.world_size, started_at=now)
            self.attempt_time = line.time
            if line.world_size != old_world:
                self.actions.append(WorldSizeChanged(old_world, line.world_size))
            self.actions.append(ResumeRecorded(node, line, lost, commit_unconfirmed))
        self.started |= {line.attempt}
        released = [e for e in self.early if e.line.attempt == line.attempt]
        self.early = tuple(e for e in self.early if e.line.attempt != line.attempt)
        for early in released:
            self.release_early(early)

    def completed(self, node: str, line: StatusLine) -> None:
        target = self.settings.target_steps
        if line.step < target:
            return self.drop(node, f"completed at step {line.step}, before job.target_steps {target}", line.event)
        if not self.settled(line.step):
            return self.hold(node, line)  # its final commit is still being verified
        return self.complete(node, line)

    def complete(self, node: str | None, line: StatusLine) -> None:
        if self.job_state is JobState.COMPLETED:
            return
        self.progress(step=line.step, state=JobState.COMPLETED)
        self.actions.append(CompletionRecorded(node, line.step, line.attempt))

    def release_held(self) -> None:
        """The held lines whose commit is now recorded (verified, for a completion), and
        that wait behind no start of their node, go on; until none is left to go."""
        while True:
            ready = [h for h in self.held if (waits_on(h.line) is None or waits_on(h.line) in self.record.commit_steps)
                     and not _behind(self.held, h)
                     and not (h.line.event == "completed" and not self.settled(h.line.step))]
            if not ready:
                return
            held = ready[0]
            self.held = _without(self.held, held)
            if held.line.event == "completed":
                self.complete(held.node, held.line)
            else:
                self.resume(held.node, held.line)

    # -- the reconcile pass
    def check_holds(self) -> None:
        now = self.world.now
        self.settle_claims()
        # an early commit whose attempt's start is itself held (for a commit the store will
        # settle) waits on: that start is coming, or is dropped and the next pass ends this
        starting = {h.line.attempt for h in self.held if h.line.event == "started"}
        over = [e for e in self.early if now - e.since >= RESUME_HOLD_S and e.line.attempt not in starting]
        self.early = tuple(e for e in self.early if e not in over)
        for early in over:  # its attempt's start never came (its rank 0's node died)
            self.release_early(early)
        claims = {(n, s.attempt) for n, s in self.waiting()}
        # nobody came to lead its attempt, and its node claims it no more
        gone = [u for u in self.unled if now - u.since >= RESUME_HOLD_S and (u.node, u.line.attempt) not in claims]
        self.unled = tuple(u for u in self.unled if u not in gone)
        for u in gone:
            self.drop(u.node, f"{u.line.event} of attempt {u.line.attempt}, which no node leads", u.line.event)
        for held in self.held:
            waited = waits_on(held.line)
            # a commit reported early is known: it goes on with its attempt's start, unless
            # that start is this held line (its survivors committed again at the step they
            # resumed from, answering a notice): then only the store can settle it
            # (nor is a commit whose attempt's start waits behind this very line: neither
            # would ever go; the store settles it)
            reported = {e.line.step for e in self.early
                        if (e.line.attempt != held.line.attempt or held.line.event != "started")
                        and e.line.attempt not in _queued_behind(self.held, held)}
            if now - held.since < RESUME_HOLD_S or waited is None or waited in self.confirming | reported or (
                    held.line.event == "started" and waited in self.record.commit_steps):  # only behind another
                continue
            self.confirming |= {waited}
            self.actions.append(ReadCommit(waited))


def _commit_read(run: _Run, m: CommitRead) -> None:
    """A held line's commit read from the store: recorded, the line dropped, or read again."""
    run.confirming -= {m.step}
    mine = [h for h in run.held if waits_on(h.line) == m.step]
    if m.error is not None:
        return _read_failed(run, m.step, mine, m.error)
    if m.line is None:
        run.held = tuple(h for h in run.held if h not in mine)
        for h in mine:
            run.drop(h.node, f"{h.line.event} at step {m.step}, which is not committed", h.line.event)
        run.release_held()  # the starts that waited behind them
        return None
    if m.step in run.record.commit_steps:
        if m.step in run.unconfirmed:
            run.unconfirmed -= {m.step}  # verified after all: a completion waiting on it goes on
            run.release_held()
        return None
    return run.commit(None, m.line, source="store")


def _read_failed(run: _Run, step_: int, mine: list[Held], error: str) -> None:
    """The store out of reach for a held line's commit: read again later, or (a start,
    after ``confirm_attempts`` failures, behind no other) recorded ``commit_unconfirmed``."""
    failures = run.confirm_failures.get(step_, 0) + 1
    run.confirm_failures = {**run.confirm_failures, step_: failures}
    for h in mine:
        if failures < run.settings.confirm_attempts or h.line.event == "completed" or _behind(run.held, h):
            # fail closed: an unverifiable completion is never a completion; read again later
            # (in its place: a start of its node held behind it stays behind it)
            run.held = tuple(Held(h.node, h.line, run.world.now) if x is h else x for x in run.held)
            if (h.line.event == "completed" and failures >= run.settings.confirm_attempts
                    and step_ not in run.said_unverified):
                run.said_unverified |= {step_}  # the operator's reason the job is not over yet
                run.actions.append(CompletionUnverified(h.node, step_, h.line.attempt, failures, error))
        else:  # availability over order: the job's view must not freeze with the store out of reach
            run.held = _without(run.held, h)
            run.resume(h.node, h.line, commit_unconfirmed=True)
    run.release_held()  # the starts that waited behind them


def _behind(held: tuple[Held, ...], one: Held) -> bool:
    """``one``, a held start, waits behind an earlier held start of its own node (a node's
    starts are recorded in the order it reported them)."""
    if one.line.event != "started":
        return False
    for h in held:
        if h is one:
            return False
        if h.node == one.node and h.line.event == "started":
            return True
    return False


def _queued_behind(held: tuple[Held, ...], one: Held) -> set[str]:
    """The attempts whose held start waits behind ``one`` (its node's, after it)."""
    after = held[held.index(one) + 1:]
    return {h.line.attempt for h in after if h.node == one.node and h.line.event == "started"}


def _heartbeat(run: _Run, m: Heartbeat) -> None:
    """The running attempt's leader's step is the job's, only forward."""
    if m.node == run.running_leader() and (run.record.step is None or m.step > run.record.step):
        run.progress(step=m.step)


def _restore(run: _Run, m: Restore) -> None:
    """The store's word after a daemon restart: the attempts started and their leaders (the
    newest runs), the commits; the job's step is its leader's (else the highest any node has);
    its start is its first resume's time, its world size the newest resume's."""
    started = next((r.time for r in m.resumes if r.time is not None), None)
    if m.running:
        run.progress(state=JobState.RUNNING, started_at=started)
    attempt, world = run.record.attempt, run.record.world_size
    for r in m.resumes:
        run.started |= {r.attempt}
        attempt = r.attempt  # the newest: the attempt running, and its leader
        world = r.world_size if r.world_size is not None else world
        if r.node is not None:
            run.leader_of = {**run.leader_of, r.attempt: r.node}
    leader = run.leader_of.get(attempt or "")
    nodes = [leader] if leader in m.node_steps else list(m.node_steps)
    steps = [s for n in nodes if (s := m.node_steps[n]) is not None]
    commits = frozenset(c.step for c in m.commits)
    run.answered |= frozenset(i for c in m.commits for i in c.notice_ids)
    run.unconfirmed = commits - {c.step for c in m.commits if not c.unconfirmed}
    # the newest commit is the one to resume from (and the one a migration copies): without
    # it a taken-over job looked as if nothing was committed until its next commit
    newest: dict[str, object] = {}
    if m.commits:
        top = max(m.commits, key=lambda c: c.step)
        last = run.record.last_commit_step
        if last is None or top.step >= last:
            newest = {"last_commit_step": top.step, "last_commit_time": top.time}
            if top.bytes is not None:
                newest["last_commit_bytes"] = top.bytes
    run.progress(attempt=attempt, step=max(steps, default=None), commit_steps=run.record.commit_steps | commits,
                 world_size=world, state=JobState.COMPLETED if m.completed else None, **newest)


def _check_flushes(run: _Run) -> None:
    """Each notice whose commit has not come by its deadline is its own event, once."""
    if run.job_state.is_terminal():
        run.flushes = {}
        return
    now = run.world.now
    for nid, flush in run.flushes.items():
        if now >= flush.due:
            run.actions.append(FlushTimedOut(flush.node, nid, round(now - flush.due + FLUSH_GRACE_S, 1),
                                             run.record.last_commit_step))
    run.flushes = {k: v for k, v in run.flushes.items() if now < v.due}


def _watch_flush(run: _Run, m: WatchFlush) -> None:
    """The first deadline of a notice stands."""
    if m.notice_id not in run.flushes:
        run.flushes = {**run.flushes, m.notice_id: Flush(m.node, m.due)}


def _without(held: tuple[Held, ...], one: Held) -> tuple[Held, ...]:
    i = held.index(one)
    return held[:i] + held[i + 1:]


_HANDLERS = {
    Restore: _restore,
    Status: lambda run, m: run.status(m.node, m.line),
    Heartbeat: _heartbeat,
    Verified: _Run.verified,
    CommitRead: _commit_read,
    WatchFlush: _watch_flush,
    CheckFlushes: lambda run, m: _check_flushes(run),
    CheckHolds: lambda run, m: run.check_holds(),
}
