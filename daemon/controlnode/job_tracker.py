"""The job as its trainer reports it: resumes, commits, completion, in causal order.

:class:`JobTracker` takes the trainer's status lines (``started`` with ``resized:
"in_process"`` for the survivors' in-process shrink, ``checkpoint_committed``,
``completed``) from :mod:`.intake` and keeps the supervisor's
:class:`~daemon.control.state.JobView`. A line changes the job only from the node
that holds rank 0 of its attempt (:mod:`daemon.control.attempts` decides who that is;
for a commit, also the node whose own notice it answers), and so does a heartbeat's
step (:meth:`JobTracker.on_step`); a commit is recorded once its manifest verifies in
the job's store; a resume waits for the commit it resumes from; a completion needs its
final commit verified, whatever the wait. It also watches each notice's flush
(:meth:`JobTracker.watch_flush`): a commit that has not come by the notice's deadline
is its own event.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import NamedTuple

import structlog

from daemon.control.attempts import Verdict
from daemon.control.lifecycle import ADMITTED, LIVE, MEMBERS, leaving
from daemon.control.reactions import FLUSH_GRACE_S, world_size_mismatch
from daemon.control.reports import StatusLine
from daemon.controlnode import preflight
from daemon.controlnode.core import Core
from daemon.controlnode.leaders import Leaders
from daemon.controlnode.manifests import CONFIRM_ATTEMPTS, ManifestReader, commit_problem, read_retried
from daemon.model import EventKind, JobState, Node

__all__ = ["JobTracker", "RESUME_HOLD_S", "CONFIRM_ATTEMPTS"]

log = structlog.get_logger("spotvisor.daemon")

# a resume whose commit no node has reported yet waits this long (seconds) for the
# report before the daemon reads the commit's manifest from the store itself
RESUME_HOLD_S = 10.0
# CONFIRM_ATTEMPTS (daemon.controlnode.manifests): reads of that manifest that fail (the store out
# of reach) before the resume is recorded anyway, marked ``commit_unconfirmed`` (a completion
# never is: it waits, and says so)
# a node's reported commits waiting for their manifest's read: one token cannot queue more
VERIFY_PENDING_MAX = 16


class _Early(NamedTuple):
    """A commit reported before its attempt's start was recorded."""

    node: str | None
    line: StatusLine
    since: float
    unconfirmed: bool  # the store was out of reach
    verified: bool  # its manifest was read from the store and verifies


class JobTracker:
    """The trainer's status lines → the job's events (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._flushes: dict[str, tuple[str, float]] = {}  # notice id → (node id, due: unix s) until its commit
        self.leaders = Leaders(core)  # who leads which attempt (daemon.control.attempts)
        self._attempt_leader = self.leaders.of  # trainer attempt → the node of its rank 0
        self._held: list[tuple[str, StatusLine, float]] = []  # (node, started/completed line, since) awaiting a commit
        self._to_verify: asyncio.Queue[tuple[str, StatusLine]] = asyncio.Queue()  # reported commits (verify_commits)
        self._read_manifest = ManifestReader(core).read  # a step's verified manifest, or None (blocking)
        self._confirming: set[int] = set()  # steps whose manifest is being read from the store
        self._confirm_failures: dict[int, int] = {}  # step → failed reads of its manifest
        self._answered: set[str] = set()  # notice and request ids a recorded commit named
        self._started: set[str] = set()  # attempts whose job_resumed is recorded (this daemon or the store)
        self._early_commits: list[_Early] = []  # commits reported before their own attempt's start
        self._verifying: collections.Counter[str] = collections.Counter()  # node → its commits in _to_verify
        self._unconfirmed: set[int] = set()  # commit steps recorded unconfirmed (the store out of reach)
        self._said_unverified: set[int] = set()  # steps whose completion_unverified is recorded
        self.attempt_of = self.leaders.attempt_of
        self.running_leader = self.leaders.running

    def pick_up(self) -> bool:
        """A restarted daemon takes over the job the last one left running.

        Live nodes get a fresh heartbeat clock: their agents kept heartbeating while no
        daemon listened, and the store holds only the heartbeat of their last state
        change, so without this every node would look lost on the first pass. The job
        is ``running`` if a node runs it, a leaving node included (a notice's flush in
        progress when the last daemon died: a ``pending`` job would start a ready
        replacement at once, while the leaving node is still in the job); ``completed``
        (pool target 0) if a ``job_completed`` event is stored, released if a
        ``pool_released`` one is (returns True: the pool was released).
        """
        sup = self.core
        now = sup.clock()
        for node in sup.nodes.values():
            if node.state in LIVE and node.last_heartbeat is not None:
                node.last_heartbeat = now
        if any(n.state in ADMITTED or leaving(n) for n in sup.nodes.values()):
            sup.job.to(JobState.RUNNING)
        for ev in sup.store.events(kinds=[EventKind.JOB_RESUMED.value]):
            if isinstance(ev.data.get("attempt"), str):
                self._started.add(ev.data["attempt"])
                sup.job.attempt = ev.data["attempt"]  # the newest: the attempt running, and its leader
                if ev.node is not None:
                    self._attempt_leader[ev.data["attempt"]] = ev.node
        leader = sup.nodes.get(self.running_leader() or "")
        steps = [n.step for n in ([leader] if leader is not None else sup.nodes.values()) if n.step is not None]
        sup.job.step = max(steps, default=None)
        confirmed: set[int] = set()
        for ev in sup.store.events(kinds=[EventKind.CHECKPOINT_COMMITTED.value]):
            if isinstance(ev.data.get("step"), int):
                sup.job.commit_steps.add(ev.data["step"])
                if not ev.data.get("commit_unconfirmed"):
                    confirmed.add(ev.data["step"])
                self._answered.update(i for i in ev.data.get("notice_ids") or () if isinstance(i, str))
        self._unconfirmed = sup.job.commit_steps - confirmed
        if sup.store.events(kinds=[EventKind.JOB_COMPLETED.value], limit=1):
            sup.job.to(JobState.COMPLETED)
            sup.job_completed()
            return bool(sup.store.events(kinds=[EventKind.POOL_RELEASED.value], limit=1))
        return False

    def watch_flush(self, notice_id: str, node_id: str, due: float) -> None:
        """Notice ``notice_id``'s commit is due by ``due`` (unix s, grace included)."""
        self._flushes.setdefault(notice_id, (node_id, due))

    def check_flushes(self) -> None:
        """A notice whose commit has not come by its deadline (+ grace) is its own event,
        ``checkpoint_flush_timed_out``, so a hung flush never silences the feed; the job
        will resume from ``last_commit_step``."""
        if self.core.job.state.is_terminal():
            self._flushes.clear()
            return
        now = self.core.clock()
        for nid, (node_id, due) in list(self._flushes.items()):
            if now >= due:
                del self._flushes[nid]
                self.core.record(EventKind.CHECKPOINT_FLUSH_TIMED_OUT, node_id, notice_id=nid,
                                 overdue_s=round(now - due + FLUSH_GRACE_S, 1),
                                 last_commit_step=self.core.job.last_commit_step)

    def on_step(self, node: Node, step: int) -> None:
        """A heartbeat's step (bounded already): the node's own; the job's only from the
        node that leads the running attempt, and only forward (a restart sets it back
        through its ``job_resumed``)."""
        node.step = step
        if node.id == self.running_leader() and (self.core.job.step is None or step > self.core.job.step):
            self.core.job.step = step

    def on_status(self, node: Node, line: StatusLine) -> None:
        """A trainer's ``started``, ``checkpoint_committed`` or ``completed`` line.

        A line changes the job only from the node that leads its attempt
        (:mod:`daemon.control.attempts`: every ``started`` line is that rule's input), or,
        for a commit, the node whose own notice it answers; ``completed`` only at
        ``job.target_steps``; a commit once its manifest verifies (:meth:`verify_commits`).

        Causal order: a ``started`` line that resumes from a commit not recorded yet (the
        survivors of an in-process shrink report their resume while the leaving node,
        which committed, may still be reporting the commit) is held until that commit is
        recorded, and so is a ``completed`` whose final commit is still being verified:
        the event log and the feed never show a resume before the commit it resumes from.
        After :data:`RESUME_HOLD_S` the daemon reads the commit's manifest from the store
        itself (:meth:`confirm_held_resumes`).
        """
        if node.state not in MEMBERS:
            self.core.drop(node, "trainer_status", f"node is {node.state.value}, not in the job", line.event)
            return
        leader = self._attempt_leader.get(line.attempt)
        if line.event == "started":
            self.leaders.heard(node.id, line)
            if line.rank == 0 and leader is not None and leader != node.id:
                self.core.drop(node, "trainer_status", f"started of attempt {line.attempt} from rank 0 "
                               f"(attempt held by {leader})", line.event)
            elif line.rank == 0 and leader is None and self._claim(node.id, line) is Verdict.CONFLICT:
                self.core.drop(node, "trainer_status", f"started of attempt {line.attempt} from rank 0, which "
                               "another node claims too: neither is taken", line.event)
            self.settle_claims()  # another node's word may be what a waiting claim needed
            return
        own_notice = any(i.startswith(f"{node.id}:") for i in line.notice_ids)
        commit = line.event == "checkpoint_committed"
        if leader is None and line.rank == 0 and not commit:  # its attempt's start may still be waiting
            self.leaders.hold_unled(node.id, line, self.core.clock())
            return
        if not (leader == node.id or (leader is None and line.rank == 0) or (commit and own_notice)):
            self.core.drop(node, "trainer_status", f"{line.event} of attempt {line.attempt} from rank {line.rank} "
                       f"(attempt held by {leader or 'nobody'})", line.event)
            return
        if commit:
            if not self.core.config.daemon.verify_commits:
                self._record_commit(node.id, line)
            elif not (line.step in self.core.job.commit_steps and self._answered.issuperset(line.notice_ids)):
                if self._verifying[node.id] >= VERIFY_PENDING_MAX:
                    return self.core.drop(node, "trainer_status", "too many commits wait for a read", line.event)
                self._verifying[node.id] += 1
                self._to_verify.put_nowait((node.id, line))  # verify_commits records it once its manifest verifies
        elif line.event == "completed":
            if line.step < self.core.config.job.target_steps:
                self.core.drop(node, "trainer_status", f"completed at step {line.step}, before job.target_steps "
                           f"{self.core.config.job.target_steps}", line.event)
                return
            if not self._settled(line.step):
                self._held.append((node.id, line, self.core.clock()))  # its final commit is still being verified
                return
            self._record_completion(node.id, line)

    def _claim(self, node_id: str, line: StatusLine) -> Verdict:
        """A claim to rank 0 of an attempt nobody leads yet (:func:`claim_verdict`): taken,
        kept waiting for another node's word, or refused for a rival claim."""
        verdict = self.leaders.verdict(node_id, line)
        if verdict is Verdict.ACCEPT:
            self._take(node_id, line)
        return verdict

    def settle_claims(self) -> None:
        """Decide again the claims to rank 0 still waiting (each new ``started`` line, each
        reconcile pass: a node may have left since)."""
        for node_id, line in self.leaders.waiting():
            if line.attempt not in self._attempt_leader:
                self._claim(node_id, line)

    def _take(self, node_id: str, line: StatusLine) -> None:
        """``node_id`` leads ``line.attempt``: its start is recorded (after the commit it
        resumes from), and the lines of that attempt that waited for a leader go on."""
        self._attempt_leader[line.attempt] = node_id
        if not (line.attempt in self.core.job.attempts or any(h.attempt == line.attempt for _, h, _ in self._held)):
            if line.resumed_from is not None and line.resumed_from not in self.core.job.commit_steps:
                self._held.append((node_id, line, self.core.clock()))
            else:
                self._record_resume(node_id, line)
        for unled in self.leaders.take_unled(lambda u: u[1].attempt == line.attempt):
            node = self.core.nodes.get(unled[0])
            if node is not None:
                self.on_status(node, unled[1])

    def _settled(self, step: int) -> bool:
        """A completion at ``step`` may be recorded: its commit is recorded and verified
        (with ``daemon.verify_commits`` off, the operator vouches for the trainer's word)."""
        return not self.core.config.daemon.verify_commits or (
            step in self.core.job.commit_steps and step not in self._unconfirmed)

    def _record_completion(self, node_id: str | None, line: StatusLine) -> None:
        if self.core.job.state is JobState.COMPLETED:
            return
        self.core.job.to(JobState.COMPLETED)
        self.core.job.step = line.step
        self.core.record(EventKind.JOB_COMPLETED, node_id, step=line.step, attempt=line.attempt)
        self.core.job_completed()

    async def verify_commits(self) -> None:
        """The owned task that records reported commits, in the order they were reported,
        each only once its manifest is read from the job's store and verifies
        (``daemon.verify_commits``): a node cannot make the daemon record a checkpoint
        that does not exist. A step with no committed manifest is dropped (one log line,
        one count); a manifest that does not name the notices the report answers, too.
        With the store out of reach :data:`CONFIRM_ATTEMPTS` times (1 s, then 2 s apart; tenacity) the
        commit is recorded with ``commit_unconfirmed: true``: a flush or a rejoin must
        not wait for the control node's view of the store."""
        while True:
            node_id, line = await self._to_verify.get()
            self._verifying[node_id] -= 1
            try:
                manifest = await read_retried(self._read_manifest, line.step)
            except Exception as exc:  # noqa: BLE001 - the store out of reach or misconfigured
                log.warning("commit_verify_failed", step=line.step, attempt=CONFIRM_ATTEMPTS, error=str(exc)[:200])
                self._record_commit(node_id, line, unconfirmed=True)
                continue
            problem = commit_problem(line, manifest, self.core.config.checkpoint_uri(self.core.domain))
            if problem is not None:
                if (node := self.core.nodes.get(node_id)) is not None:
                    self.core.drop(node, "trainer_status", problem, line.event)
                continue
            if line.bytes is None:
                line = dataclasses.replace(line, bytes=sum(sh.size for sh in manifest.shards))
            self._record_commit(node_id, line, verified=True)

    def _record_resume(self, node_id: str | None, line: StatusLine, *, commit_unconfirmed: bool = False) -> None:
        self._record_resume_event(node_id, line, commit_unconfirmed=commit_unconfirmed)
        self._started.add(line.attempt)
        for early in [e for e in self._early_commits if e.line.attempt == line.attempt]:
            self._early_commits.remove(early)
            self._release_early(early)

    def _trusted(self, early: _Early) -> bool:
        """Its manifest verified, or its node leads its attempt or answers its own notice."""
        if early.verified or early.node is None:
            return early.verified
        own = any(i.startswith(f"{early.node}:") for i in early.line.notice_ids)
        return own or self._attempt_leader.get(early.line.attempt) == early.node

    def _release_early(self, early: _Early) -> None:
        """An early commit whose wait is over is recorded if it can be trusted: its manifest
        verified, or its node leads its attempt (or answers its own notice); otherwise it is
        dropped: a report of a node that does not lead the attempt, unverifiable, counts for nothing."""
        node = self.core.nodes.get(early.node or "")
        if self._trusted(early):
            self._record_commit(early.node, early.line, unconfirmed=early.unconfirmed, early_ok=True)
        elif node is not None:
            self.core.drop(node, "trainer_status", f"unverified commit of step {early.line.step} for attempt "
                           f"{early.line.attempt}, which its node does not lead", early.line.event)

    def _record_resume_event(self, node_id: str | None, line: StatusLine, *, commit_unconfirmed: bool) -> None:
        self.core.job.attempts.add(line.attempt)
        self.core.job.attempt = line.attempt
        if line.resized == "in_process":
            self.core.job.resizes_in_process += 1
        if self.core.job.started_at is None:
            self.core.job.started_at = self.core.clock()
        world = line.world_size
        if world != self.core.job.world_size:
            self.core.record(EventKind.WORLD_SIZE_CHANGED, None, old=self.core.job.world_size, new=world)
            self.core.job.world_size = world
        # lost steps (the daemon's estimate, daemon/controlnode/metrics.py): the highest step reported
        # before this restart minus the step it resumed from
        reached, step = self.core.job.step, line.step
        lost = reached - step if reached is not None and reached > step else 0
        self.core.job.step = step
        self.core.job.resumed_at = self.core.clock()
        self.core.record(EventKind.JOB_RESUMED, node_id, attempt=line.attempt, step=step,
                    resumed_from=line.resumed_from, world_size=world, trainer_time=line.time,
                    lost_steps=lost, **({"resized": line.resized} if line.resized else {}),
                    **({"commit_unconfirmed": True} if commit_unconfirmed else {}))
        _check_world_size(self.core, node_id, line)

    def _record_commit(self, node_id: str | None, line: StatusLine, *, source: str | None = None,
                       unconfirmed: bool = False, early_ok: bool = False, verified: bool = False) -> None:
        """Record one commit (once per step and notice: the first report of it), apply
        what it answers (notice flushes, the rejoin), then the resumes that waited for it.

        Causal order, the other way round: a commit of an attempt whose own start is not
        recorded yet (the survivors of a shrink commit at their first step, and the node
        that reports that commit may be faster than rank 0's node reporting their start)
        waits for that start, at most :data:`RESUME_HOLD_S` (``early_ok``: the wait is over;
        :meth:`_release_early` says whether it is recorded then)."""
        early = _Early(node_id, line, self.core.clock(), unconfirmed, verified)
        if source is None and not early_ok and line.attempt not in self._started and (
                self._started or not self._trusted(early)):  # no start recorded yet: no order to keep
            self._early_commits.append(early)
            return
        step, ids = line.step, list(line.notice_ids)
        for nid in ids:
            self._flushes.pop(nid, None)
        if self.core.rejoin is not None and self.core.rejoin.id in ids:
            self.core.rejoin.answered = True
            self.core.wake()
        if step in self.core.job.commit_steps and self._answered.issuperset(ids):
            return  # a second report of a recorded commit (rank 0's and the noticed node's)
        # (a commit of a recorded step that answers new notices is recorded again: the
        # survivors of a shrink answering the next notice at the same step boundary)
        self._answered.update(ids)
        if unconfirmed and step not in self.core.job.commit_steps:
            self._unconfirmed.add(step)
        elif not unconfirmed:
            self._unconfirmed.discard(step)
        self.core.job.commit_steps.add(step)
        if self.core.job.last_commit_step is None or step >= self.core.job.last_commit_step:
            self.core.job.last_commit_step = step
            self.core.job.last_commit_time = line.time
            if line.bytes is not None:
                self.core.job.last_commit_bytes = line.bytes
        self.core.record(EventKind.CHECKPOINT_COMMITTED, node_id, step=step, attempt=line.attempt,
                    reason=line.reason, seconds=line.seconds, bytes=line.bytes,
                    notice_ids=ids, kinds=list(line.kinds), trainer_time=line.time,
                    save_s=line.save_s, upload_s=line.upload_s, **({"source": source} if source else {}),
                    **({"commit_unconfirmed": True} if unconfirmed else {}))
        raw = {k: v for k, v in (("seconds", line.seconds), ("bytes", line.bytes), ("save_s", line.save_s),
                                 ("upload_s", line.upload_s)) if v is not None}
        members = sum(1 for n in self.core.nodes.values() if n.state in MEMBERS)
        for check in preflight.measured_deadline_checks(self.core.config, raw, nodes=max(1, members),
                                                        world_size=self.core.job.world_size):
            if check.at_risk:  # the measured flush would not fit a notice window with the safety factor
                self.core.record(EventKind.CHECKPOINT_DEADLINE_RISK, node_id, step=step,
                            **check.event_data("measured"))
        self._release_held()

    def _release_held(self) -> None:
        """The held lines whose commit is now recorded (verified, for a completion) go on."""
        for held in [h for h in self._held if _waits_on(h[1]) in self.core.job.commit_steps]:
            if held[1].event == "completed" and not self._settled(held[1].step):
                continue
            self._held.remove(held)
            if held[1].event == "completed":
                self._record_completion(held[0], held[1])
            else:
                self._record_resume(held[0], held[1])

    def confirm_held_resumes(self) -> None:
        """A reconcile pass: a resume held :data:`RESUME_HOLD_S` for a commit nobody
        reported (the committing node died before its report got out) is settled from
        the store: the commit's manifest read in a thread; found, the commit is recorded
        (``source: "store"``) and the resume after it; not found, the resume is dropped;
        the store out of reach :data:`CONFIRM_ATTEMPTS` times, :data:`RESUME_HOLD_S` apart,
        the resume is recorded with ``commit_unconfirmed: true``. A held completion is
        never recorded unverified: its final commit is read again every
        :data:`RESUME_HOLD_S`, and after :data:`CONFIRM_ATTEMPTS` failed reads one
        ``completion_unverified`` event says why the job is not over. Also: the claims
        to rank 0 still waiting are decided again (:meth:`settle_claims`), and the lines
        of attempts nobody came to lead are dropped."""
        now = self.core.clock()
        self.settle_claims()
        for early in [e for e in self._early_commits if now - e.since >= RESUME_HOLD_S]:
            self._early_commits.remove(early)  # its attempt's start never came (its rank 0's node died)
            self._release_early(early)
        claims = {(n, s.attempt) for n, s in self.leaders.waiting()}
        # nobody came to lead its attempt, and its node claims it no more
        for unled in self.leaders.take_unled(lambda u: now - u[2] >= RESUME_HOLD_S and (u[0], u[1].attempt) not in claims):
            node = self.core.nodes.get(unled[0])
            if node is not None:
                self.core.drop(node, "trainer_status", f"{unled[1].event} of attempt {unled[1].attempt}, "
                               "which no node leads", unled[1].event)
        for node_id, line, held_at in list(self._held):
            step = _waits_on(line)
            if now - held_at < RESUME_HOLD_S or step is None or step in self._confirming:
                continue
            self._confirming.add(step)
            self.core.spawn(self._confirm_commit(step), f"confirm-commit-{step}")

    async def _confirm_commit(self, step: int) -> None:
        try:
            manifest = await asyncio.to_thread(self._read_manifest, step)
        except Exception as exc:  # the store unreachable (or misconfigured): again RESUME_HOLD_S later
            failures = self._confirm_failures[step] = self._confirm_failures.get(step, 0) + 1
            log.warning("commit_confirm_failed", step=step, attempt=failures, error=str(exc)[:200])
            held = [h for h in self._held if _waits_on(h[1]) == step]
            for h in held:
                self._held.remove(h)
                if failures < CONFIRM_ATTEMPTS or h[1].event == "completed":
                    # fail closed: an unverifiable completion is never a completion; read again later
                    self._held.append((h[0], h[1], self.core.clock()))
                    if h[1].event == "completed" and failures >= CONFIRM_ATTEMPTS and step not in self._said_unverified:
                        self._said_unverified.add(step)  # the operator's reason the job is not over yet
                        self.core.record(EventKind.COMPLETION_UNVERIFIED, h[0], step=step, attempt=h[1].attempt,
                                         reads=failures, error=str(exc)[:200])
                else:  # availability over order: the job's view must not freeze with the store out of reach
                    self._record_resume(h[0], h[1], commit_unconfirmed=True)
            return
        finally:
            self._confirming.discard(step)
        if manifest is None:
            for held in [h for h in self._held if _waits_on(h[1]) == step]:
                self._held.remove(held)
                node = self.core.nodes.get(held[0])
                if node is not None:
                    self.core.drop(node, "trainer_status", f"{held[1].event} at step {step}, which is not committed",
                               held[1].event)
            return
        if step in self.core.job.commit_steps:
            if step in self._unconfirmed:
                self._unconfirmed.discard(step)  # verified after all: a completion waiting on it goes on
                self._release_held()
            return
        extra = manifest.extra if isinstance(manifest.extra, dict) else {}
        self._record_commit(None, StatusLine(
            event="checkpoint_committed", attempt=str(extra.get("attempt") or "?"), rank=None,
            world_size=manifest.world_size, step=step, time=manifest.time,
            notice_ids=tuple(i for i in extra.get("notice_ids") or () if isinstance(i, str)),
            reason=extra.get("reason") if isinstance(extra.get("reason"), str) else None,
            bytes=sum(s.size for s in manifest.shards)), source="store")


def _waits_on(line: StatusLine) -> int | None:
    """The step whose commit a held line waits for: a resume's origin, a completion's step."""
    return line.step if line.event == "completed" else line.resumed_from


def _check_world_size(core: Core, node_id: str | None, line: StatusLine) -> None:
    """``world_size_mismatch`` when a recorded attempt has more ranks than the daemon
    admitted (:func:`daemon.control.reactions.world_size_mismatch`)."""
    found = world_size_mismatch(line.world_size, [core.view(n) for n in core.nodes.values()])
    if found is not None:
        log.warning("world_size_mismatch", attempt=line.attempt, **dataclasses.asdict(found))
        core.record(EventKind.WORLD_SIZE_MISMATCH, node_id, attempt=line.attempt, **dataclasses.asdict(found))
