"""The job as its trainer reports it: the edge of :mod:`daemon.control.job`.

:class:`JobTracker` takes the trainer's status lines (``started`` with ``resized:
"in_process"`` for the survivors' in-process shrink, ``checkpoint_committed``,
``completed``) from :mod:`.intake`, the heartbeats' steps, each notice's flush and the
reconcile passes, makes each a typed message, calls the pure
:func:`daemon.control.job.step` (whose module docstring has the rules: rank 0, causal
order, bounds) and carries out its actions: events recorded, reports dropped, manifests
read from the job's store (in threads), and the job view's changes handed to the
supervisor (:class:`~daemon.control.job.JobProgress`, applied by its actuator).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import structlog

from daemon.control import job as j
from daemon.control.job import RESUME_HOLD_S, VERIFY_PENDING_MAX
from daemon.control.lifecycle import ADMITTED, LIVE, MEMBERS, leaving
from daemon.control.reactions import world_size_mismatch
from daemon.control.reports import StatusLine
from daemon.controlnode import preflight
from daemon.controlnode.core import Core
from daemon.controlnode.manifests import CONFIRM_ATTEMPTS, ManifestReader, commit_problem, read_retried
from daemon.model import EventKind, Node, NodeState

__all__ = ["JobTracker", "RESUME_HOLD_S", "CONFIRM_ATTEMPTS", "VERIFY_PENDING_MAX"]

log = structlog.get_logger("spotvisor.daemon")


class JobTracker:
    """The trainer's status lines → the job's events (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.state = j.JobTrack(settings=j.Settings(
            verify_commits=core.config.daemon.verify_commits, target_steps=core.config.job.target_steps,
            confirm_attempts=CONFIRM_ATTEMPTS))
        self._to_verify: asyncio.Queue[tuple[str, StatusLine]] = asyncio.Queue()  # reported commits (verify_commits)
        self._changed = asyncio.Event()  # set (and replaced) after each decision: settled() looks again
        self._read_manifest = ManifestReader(core).read  # a step's verified manifest, or None (blocking)

    @property
    def _confirming(self) -> frozenset[int]:
        """Steps whose manifest is being read for a held line."""
        return self.state.confirming

    def running_leader(self) -> str | None:
        """The node that holds rank 0 of the attempt the job runs (None: none recorded)."""
        return self.state.running_leader()

    def attempt_of(self, node_id: str) -> str:
        """The trainer attempt ``node_id``'s workers last reported starting ("" if none)."""
        return self.state.attempt_of(node_id)

    def _step(self, message: j.Message) -> None:
        """Decide on ``message`` (:func:`daemon.control.job.step`) and carry out the actions, in order."""
        core = self.core
        world = j.World(core.clock(), _NodeStates(core.nodes), core.job.state)
        self.state, actions = j.step(self.state, message, world)
        for action in actions:
            self._do(action)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _do(self, action: j.JobAction) -> None:
        core = self.core
        if isinstance(action, j.JobProgress):
            core.act(action)
        elif isinstance(action, j.Drop):
            if (node := core.nodes.get(action.node)) is not None:
                core.drop(node, "trainer_status", action.problem, action.event)
        elif isinstance(action, j.Verify):
            self._to_verify.put_nowait((action.node, action.line))  # verify_commits reads it
        elif isinstance(action, j.ReadCommit):
            core.spawn(self._confirm_commit(action.step), f"confirm-commit-{action.step}")
        elif isinstance(action, j.ResumeRecorded):
            self._resumed(action)
        elif isinstance(action, j.CommitRecorded):
            self._committed(action)
        elif isinstance(action, j.CompletionRecorded):
            core.record(EventKind.JOB_COMPLETED, action.node, step=action.step, attempt=action.attempt)
            core.job_completed()
        elif isinstance(action, j.WorldSizeChanged):
            core.record(EventKind.WORLD_SIZE_CHANGED, None, old=action.old, new=action.new)
        elif isinstance(action, j.FlushTimedOut):
            core.record(EventKind.CHECKPOINT_FLUSH_TIMED_OUT, action.node, notice_id=action.notice_id,
                        overdue_s=action.overdue_s, last_commit_step=action.last_commit_step)
        elif isinstance(action, j.CompletionUnverified):
            core.record(EventKind.COMPLETION_UNVERIFIED, action.node, step=action.step, attempt=action.attempt,
                        reads=action.reads, error=action.error)

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
        resumes = tuple(j.StoredResume(ev.data["attempt"], ev.node, ev.time,
                                       ev.data["world_size"] if isinstance(ev.data.get("world_size"), int) else None)
                        for ev in sup.store.events(kinds=[EventKind.JOB_RESUMED.value])
                        if isinstance(ev.data.get("attempt"), str))
        commits = tuple(j.StoredCommit(ev.data["step"], bool(ev.data.get("commit_unconfirmed")),
                                       tuple(i for i in ev.data.get("notice_ids") or () if isinstance(i, str)),
                                       time=float(ev.data.get("trainer_time") or ev.time),
                                       bytes=ev.data["bytes"] if isinstance(ev.data.get("bytes"), int) else None)
                        for ev in sup.store.events(kinds=[EventKind.CHECKPOINT_COMMITTED.value])
                        if isinstance(ev.data.get("step"), int))
        completed = bool(sup.store.events(kinds=[EventKind.JOB_COMPLETED.value], limit=1))
        self._step(j.Restore(resumes, commits, {n.id: n.step for n in sup.nodes.values()},
                             running=any(n.state in ADMITTED or leaving(n) for n in sup.nodes.values()),
                             completed=completed))
        if completed:
            sup.job_completed()
            return bool(sup.store.events(kinds=[EventKind.POOL_RELEASED.value], limit=1))
        return False

    def watch_flush(self, notice_id: str, node_id: str, due: float) -> None:
        """Notice ``notice_id``'s commit is due by ``due`` (unix s, grace included)."""
        self._step(j.WatchFlush(notice_id, node_id, due))

    def check_flushes(self) -> None:
        """A notice whose commit has not come by its deadline (+ grace) is its own event,
        ``checkpoint_flush_timed_out``, so a hung flush never silences the feed; the job
        will resume from ``last_commit_step``."""
        self._step(j.CheckFlushes())

    def on_step(self, node: Node, step: int) -> None:
        """A heartbeat's step (bounded already): the node's own; the job's only from the
        node that leads the running attempt, and only forward (a restart sets it back
        through its ``job_resumed``)."""
        node.step = step
        self._step(j.Heartbeat(node.id, step))

    def on_status(self, node: Node, line: StatusLine) -> None:
        """A trainer's ``started``, ``checkpoint_committed`` or ``completed`` line (the
        rules: :mod:`daemon.control.job`); with ``daemon.verify_commits`` a commit is
        recorded once its manifest verifies (:meth:`verify_commits`)."""
        self._step(j.Status(node.id, line))

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
            await self._verify(node_id, line)

    async def _verify(self, node_id: str, line: StatusLine) -> None:
        try:
            manifest = await read_retried(self._read_manifest, line.step)
        except Exception as exc:  # noqa: BLE001 - the store out of reach or misconfigured
            log.warning("commit_verify_failed", step=line.step, attempt=CONFIRM_ATTEMPTS, error=str(exc)[:200])
            self._step(j.Verified(node_id, line, unreachable=True))
            return
        problem = commit_problem(line, manifest, self.core.config.checkpoint_uri(self.core.domain))
        if problem is None and line.bytes is None:
            line = dataclasses.replace(line, bytes=sum(sh.size for sh in manifest.shards))
        self._step(j.Verified(node_id, line, problem=problem))

    async def settled(self, node_id: str, timeout_s: float) -> bool:
        """Wait until every line ``node_id`` reported is decided (recorded or dropped; not
        read, held or early: :meth:`JobTrack.undecided`): an agent's report batch is answered
        only then, so a daemon killed before it had decided leaves the report in the
        agent's outbox, resent to the next daemon, instead of acknowledged and lost with
        the daemon's memory. A resume held for another node's commit is decided when that
        commit's report comes. False after ``timeout_s`` seconds (the answer goes out
        anyway: the agent's own timeout is 10 s; a held line's store read is
        :data:`RESUME_HOLD_S` away)."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.state.undecided(node_id):
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True

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
        to rank 0 still waiting are decided again, commits held for an attempt's start
        that never came are recorded or dropped, and the lines of attempts nobody came
        to lead are dropped."""
        self._step(j.CheckHolds())

    async def _confirm_commit(self, step: int) -> None:
        """Read ``step``'s manifest and tell the rules; whatever fails, they hear of it
        (a step left "being read" would hold its lines for good)."""
        try:
            manifest = await asyncio.to_thread(self._read_manifest, step)
            line = None if manifest is None else _store_line(step, manifest)
        except Exception as exc:  # the store unreachable (or misconfigured): again RESUME_HOLD_S later
            log.warning("commit_confirm_failed", step=step, attempt=self.state.confirm_failures.get(step, 0) + 1,
                        error=str(exc)[:200])
            self._step(j.CommitRead(step, error=str(exc)[:200]))
            return
        self._step(j.CommitRead(step, line))

    def _resumed(self, action: j.ResumeRecorded) -> None:
        """Record ``job_resumed``, then ``world_size_mismatch`` when the attempt has more
        ranks than the daemon admitted (:func:`daemon.control.reactions.world_size_mismatch`)."""
        core, line = self.core, action.line
        core.record(EventKind.JOB_RESUMED, action.node, attempt=line.attempt, step=line.step,
                    resumed_from=line.resumed_from, world_size=line.world_size, trainer_time=line.time,
                    lost_steps=action.lost_steps, **({"resized": line.resized} if line.resized else {}),
                    **({"commit_unconfirmed": True} if action.commit_unconfirmed else {}))
        found = world_size_mismatch(line.world_size, [core.view(n) for n in core.nodes.values()])
        if found is not None:
            log.warning("world_size_mismatch", attempt=line.attempt, **dataclasses.asdict(found))
            core.record(EventKind.WORLD_SIZE_MISMATCH, action.node, attempt=line.attempt, **dataclasses.asdict(found))

    def _committed(self, action: j.CommitRecorded) -> None:
        """Record ``checkpoint_committed``, then ``checkpoint_deadline_risk`` when the
        measured flush would not fit a notice window with the safety factor."""
        core, line = self.core, action.line
        core.record(EventKind.CHECKPOINT_COMMITTED, action.node, step=line.step, attempt=line.attempt,
                    reason=line.reason, seconds=line.seconds, bytes=line.bytes,
                    notice_ids=list(line.notice_ids), kinds=list(line.kinds), trainer_time=line.time,
                    save_s=line.save_s, upload_s=line.upload_s, **({"source": action.source} if action.source else {}),
                    **({"commit_unconfirmed": True} if action.unconfirmed else {}))
        raw = {k: v for k, v in (("seconds", line.seconds), ("bytes", line.bytes), ("save_s", line.save_s),
                                 ("upload_s", line.upload_s)) if v is not None}
        members = sum(1 for n in core.nodes.values() if n.state in MEMBERS)
        for check in preflight.measured_deadline_checks(core.config, raw, nodes=max(1, members),
                                                        world_size=action.world_size):
            if check.at_risk:
                core.record(EventKind.CHECKPOINT_DEADLINE_RISK, action.node, step=line.step,
                            **check.event_data("measured"))


class _NodeStates(Mapping[str, NodeState]):
    """The nodes' states, read when the rules ask (a heartbeat reads none of them: no
    copy of a thousand-node pool per heartbeat)."""

    def __init__(self, nodes: Mapping[str, Node]) -> None:
        self._nodes = nodes

    def __getitem__(self, node_id: str) -> NodeState:
        return self._nodes[node_id].state

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)


def _store_line(step: int, manifest: Any) -> StatusLine:
    """The commit of ``step`` as its manifest in the store tells it."""
    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    ids = extra.get("notice_ids")
    return StatusLine(
        event="checkpoint_committed", attempt=str(extra.get("attempt") or "?"), rank=None,
        world_size=manifest.world_size, step=step, time=manifest.time,
        notice_ids=tuple(i for i in ids if isinstance(i, str)) if isinstance(ids, list) else (),
        reason=extra.get("reason") if isinstance(extra.get("reason"), str) else None,
        bytes=sum(s.size for s in manifest.shards))
