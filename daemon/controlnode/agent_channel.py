"""The agents' side of the :class:`~daemon.controlnode.supervisor.Supervisor`: what it answers on
the agent port (``daemon/interfaces/api.py``), and what it makes of the agents' reports.

:class:`AgentChannel` is a base class of ``Supervisor``, kept in its own module so the
supervisor's file holds the reconcile loop, admission and the operator's verbs. It
uses the supervisor's state (``nodes``, ``job``, ``config``, ``store``, ``record``,
``wake``, ``_set_state``, ...) and is not meant to be used alone.

- **Heartbeat interval**: every register and heartbeat reply tells the node when to
  heartbeat next, ``max(agent.heartbeat_interval_s, live nodes /
  daemon.max_heartbeats_per_second)`` (:func:`daemon.control.pool.heartbeat_interval_s`, as
  Nomad does), told as the time to the node's next slot when stretched, so the pool's
  heartbeats arrive evenly spread; the node's lost timeout scales with what it was
  told (``NodeView.heartbeat_interval_s``).
- **Commands** (start the trainer, checkpoint / rejoin, drain, cancel) do not wait for
  a heartbeat: every producer goes through :meth:`AgentChannel._send`, which wakes the
  node's outstanding ``POST /v1/agent/commands`` long-poll (:meth:`wait_commands`),
  held up to ``agent.command_wait_s`` (300 s) when the node has nothing to do.
  Heartbeat replies still carry commands (an older agent, a lost long-poll); whichever
  reply comes first pops them, so each is delivered once.
- **Reports** (``POST /v1/agent/events``): interruption notices, rebalance
  recommendations, the trainer's status lines (``started`` with ``resized:
  "in_process"`` for the survivors' in-process shrink, ``checkpoint_committed``,
  ``completed``), metadata alarms, trainer exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import math
import zlib
from typing import Any, Callable

import structlog
from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from daemon.controlnode import preflight
from daemon.controlnode.gpu_watch import parse_samples
from daemon.gpunode.metadata.registry import DOCUMENTED_LEAD_S
from daemon.control.lifecycle import LIVE, MEMBERS, TrainerState, training
from daemon.model import TORCHRUN_ARGV, EventKind, JobState, Node, NodeState
from daemon.control.pool import heartbeat_interval_s as scaled_heartbeat_interval
from daemon.control.reports import (
    Limits, MetadataAlarm, NoticeReport, ReportError, StatusLine, TrainerExited, parse_report, parse_step,
)

__all__ = ["AgentChannel"]

_TRAINER_VALUES = frozenset(t.value for t in TrainerState)

log = structlog.get_logger("spotvisor.daemon")

# a noticed node's zone is avoided by replacements this long (seconds)
AVOID_ZONE_S = 300.0
# a commit reported just before a notice's deadline may still be on its way (the
# agent's report retry backs off up to 5 s): wait this long past it before saying
# the flush timed out
FLUSH_GRACE_S = 5.0
# a resume whose commit no node has reported yet waits this long (seconds) for the
# report before the daemon reads the commit's manifest from the store itself
RESUME_HOLD_S = 10.0
# reads of that manifest that fail (the store out of reach) before the resume is
# recorded anyway, marked ``commit_unconfirmed``
CONFIRM_ATTEMPTS = 3


class AgentChannel:
    """The agent API handlers and the reports' effects (a base of ``Supervisor``)."""

    def authenticate(self, node_id: str, token: str) -> Node | None:
        node = self.nodes.get(node_id)
        if node is None or not hmac.compare_digest(node.token, token):
            return None
        return node

    def on_register(self, node: Node, *, prewarm: bool = False) -> dict[str, Any]:
        """An agent came up: the node is ``ready``; returns the job spec it runs and its
        heartbeat interval (seconds).

        ``prewarm``: the agent starts a torchrun job's process at once
        (:mod:`daemon.gpunode.launcher`) and its heartbeats say ``warming`` until it has imported;
        for a torchrun job the node is ``warming`` from now, so that admission does not
        ask the survivors for a rejoin commit (and make them hold) before the first
        heartbeat says so (:meth:`Supervisor._admit`)."""
        self._seen(node)
        self._rescale_heartbeat()  # one more live node
        spec = self.job_spec(node)
        if prewarm and tuple(spec["argv"][:2]) == TORCHRUN_ARGV and node.trainer is TrainerState.NOT_STARTED:
            node.trainer = TrainerState.WARMING
            self.store.put_node(node)
        return {"job": spec, "heartbeat_interval_s": self._tell_interval(node)}

    def on_heartbeat(self, node: Node, body: dict[str, Any]) -> dict[str, Any]:
        self._seen(node)
        trainer = body.get("trainer")
        if isinstance(trainer, dict) and trainer.get("state") in _TRAINER_VALUES:
            if trainer["state"] != node.trainer:  # the agent's word: its lifecycle is its own (agent.py)
                node.trainer = TrainerState(trainer["state"])
                self.store.put_node(node)
                self.wake()
        try:
            step = parse_step(body.get("step"), self._limits())
        except ReportError as exc:
            self._drop(node, "heartbeat", str(exc), body.get("step"))
            step = None
        if step is not None:
            node.step = step
            if self.job.step is None or step > self.job.step:
                self.job.step = step
        self.node_logs.feed(node.id, body.get("log"))
        low = self.gpu_watch.observe(node.id, parse_samples(body.get("gpu")), now=self.clock(),
                                     training=training(node))
        if low is not None:
            self.record(EventKind.GPU_UNDERUTILIZED, node.id, **low)
        reply = self._agent_reply(node)
        reply["heartbeat_interval_s"] = self._tell_interval(node)  # when to send the next one
        reply["log"] = self.node_logs.ack(node.id)  # where the next trainer.log chunk starts (daemon/gpunode/nodelog.py)
        return reply

    async def wait_commands(self, node: Node, wait_s: float, *,
                            connected: Callable[[], bool] = lambda: True) -> dict[str, Any] | None:
        """The command long-poll (``POST /v1/agent/commands``): answer at once when
        ``node`` has commands queued or its start/stop decision changed since it was last
        told, else when one of those happens, or after ``wait_s`` with no commands. A
        ``wait_s`` over ``agent.command_wait_s`` is cut to a uniform random share of
        that (Consul too spreads its blocking queries' wake-ups at random,
        https://developer.hashicorp.com/consul/api-docs/features/blocking): nodes that
        registered together re-poll evenly spread from the first poll on.

        Returns the reply (what a heartbeat reply carries, less the heartbeat's own
        fields), or None, taking nothing, when the poll is no longer wanted: a newer
        poll of the same node superseded it, ``connected()`` says its client is gone
        (aiohttp does not cancel a handler whose client left), or the daemon closes.
        Commands taken by a reply are gone from the queue: a heartbeat reply after it
        has none of them.
        """
        self._seen(node)
        cap = self.config.agent.command_wait_s
        wait_s = max(0.0, wait_s) if wait_s <= cap else cap * (1.0 - self._rng.random())
        gen = self._command_polls[node.id] = self._command_polls.get(node.id, 0) + 1
        ready = self._command_ready.get(node.id)
        if ready is None:
            ready = self._command_ready[node.id] = asyncio.Event()
        else:
            ready.set()  # an older poll of this node still held (its connection lost) gives way
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            ready.clear()
            if self._closed or self._command_polls.get(node.id) != gen or not connected():
                return None
            remaining = deadline - loop.time()
            news = bool(self._commands.get(node.id)) or self._told_start.get(node.id, False) != self._start(node)
            if news or remaining <= 0:
                return self._agent_reply(node)
            await wait_event(ready, remaining)

    def _send(self, node_id: str, command: dict[str, Any]) -> None:
        """Queue a command for a node and wake its long-poll: every producer comes here."""
        self._commands.setdefault(node_id, []).append(command)
        self._poke(node_id)

    def _poke(self, node_id: str) -> None:
        ready = self._command_ready.get(node_id)
        if ready is not None:
            ready.set()

    def _start(self, node: Node) -> bool:
        """Whether ``node``'s agent should run the trainer (it starts one if it has none)."""
        return node.state is NodeState.RUNNING and not self.job.state.is_terminal()

    def _agent_reply(self, node: Node) -> dict[str, Any]:
        """Take ``node``'s queued commands and its start/stop decision into a reply."""
        start = self._told_start[node.id] = self._start(node)
        return {"commands": self._commands.pop(node.id, []), "start_trainer": start}

    def _rescale_heartbeat(self) -> None:
        live = sum(1 for n in self.nodes.values() if n.state in LIVE)
        self.heartbeat_interval_s = scaled_heartbeat_interval(
            live, min_interval_s=self.config.agent.heartbeat_interval_s,
            max_per_second=self.config.daemon.max_heartbeats_per_second)

    def _tell_interval(self, node: Node) -> float:
        """The heartbeat interval to tell ``node`` now (seconds), remembered for its lost
        timeout (:meth:`daemon.control.pool.Timeouts.lost_after_s`).

        A stretched interval ``I`` is told as the time to the node's next **slot**: slots
        are ``I`` apart at the node's own phase (from its id, uniform in ``[0, I)``), and
        the next one at least ``I/2`` away, so what is told lies in ``[I/2, 3I/2)``. The
        pool's heartbeats then arrive evenly spread at ``live nodes / I`` a second, the
        cap, however they were bunched before: an extra heartbeat (a trainer that started
        on every node at once) is told the way back to its slot, where a random stagger
        (Nomad's) takes dozens of rounds to undo such a wave.
        """
        floor, interval = self.config.agent.heartbeat_interval_s, self.heartbeat_interval_s
        if interval > floor:
            phase = zlib.crc32(node.id.encode()) / 2**32
            now = self.clock()
            slot = (math.floor(now / interval - phase) + 1 + phase) * interval
            if slot - now < interval / 2:
                slot += interval
            interval = round(max(floor, slot - now), 3)
        self._told_interval[node.id] = interval
        return interval

    def on_reports(self, node: Node, reports: list[dict[str, Any]]) -> None:
        """Apply an agent's batch of reports, in order. Each is parsed and bounded at the
        edge (:func:`daemon.control.reports.parse_report`); one that cannot be used is dropped
        whole with one log line and one count (:meth:`_drop`), never stored, and the rest
        of the batch goes on: raising here would answer 500, and the agent resends a
        failed batch until it is accepted, re-applying the reports before the bad one
        each time and holding back every report after it (a notice, a commit) for good."""
        self._seen(node)
        limits = self._limits()
        for r in reports:
            kind = r.get("kind") if isinstance(r, dict) else None
            try:
                msg = parse_report(r, limits)
            except ReportError as exc:
                self._drop(node, str(kind)[:40], str(exc), r)
                continue
            if msg is None:
                log.warning("unknown_report", node_id=node.id, kind=str(kind)[:40])
            elif isinstance(msg, NoticeReport) and msg.kind == "interruption_notice":
                self._on_notice(node, msg)
            elif isinstance(msg, NoticeReport):
                self._on_rebalance(node, msg)
            elif isinstance(msg, StatusLine):
                self._on_trainer_status(node, msg)
            elif isinstance(msg, MetadataAlarm):
                if msg.kind == "metadata_unreachable":
                    self.record(EventKind.METADATA_UNREACHABLE, node.id, failures=msg.failures,
                                error=msg.error, url=msg.url)
                else:
                    self.record(EventKind.METADATA_RECOVERED, node.id, failures=msg.failures)
            elif isinstance(msg, TrainerExited):
                node.trainer = TrainerState.EXITED
                self.store.put_node(node)
                self.record(EventKind.TRAINER_EXITED, node.id, exit_code=msg.exit_code)
                self.wake()

    def _limits(self) -> Limits:
        return Limits(max_step=self.config.job.target_steps, max_world_size=self.config.max_world_size())

    def _drop(self, node: Node, kind: str, problem: str, what: Any) -> None:
        """A report (or a heartbeat's field) that cannot be used: one log line, one
        count in :attr:`reports_dropped` (``spotvisor_agent_reports_dropped_total``)."""
        self.reports_dropped[kind] += 1
        log.warning("agent_report_dropped", node_id=node.id, kind=kind, problem=problem, report=repr(what)[:200])

    def _seen(self, node: Node) -> None:
        node.last_heartbeat = self.clock()
        if node.state is NodeState.LAUNCHING:
            node.ready_at = node.last_heartbeat
            self._set_state(node, NodeState.READY)
            self.record(EventKind.NODE_READY, node.id, boot_s=round(node.ready_at - node.created_at, 2))
            self.wake()

    def _on_notice(self, node: Node, n: NoticeReport) -> None:
        node.deadline = n.deadline
        seen_at = n.seen_at
        published_at = self._published_at(node, n.provider, node.deadline)
        self.record(EventKind.INTERRUPTION_NOTICE, node.id, notice_id=n.notice_id,
                    action=n.action, deadline=n.notice_deadline, provider=n.provider,
                    notice_published_at=published_at, notice_seen_at=seen_at,
                    detection_latency_s=None if published_at is None or seen_at is None
                    else round(seen_at - published_at, 3))
        if training(node) and n.notice_id is not None:  # its flush must commit before the deadline
            lead = DOCUMENTED_LEAD_S.get(n.provider or "", 120.0)
            due = node.deadline if node.deadline is not None else self.clock() + lead
            self._flushes.setdefault(n.notice_id, (node.id, due + FLUSH_GRACE_S))
        if not node.state.is_terminal() and node.state is not NodeState.DRAINING:
            self._set_state(node, NodeState.DRAINING, "interruption notice")
        # the replacement prefers another zone (SkyPilot's EAGER_NEXT_REGION, first retry)
        self._avoid_zone[zone_key(node.provider, node.region, node.zone)] = self.clock() + AVOID_ZONE_S
        if self._rejoin is not None:
            self._rejoin.nodes.discard(node.id)
        self.wake()

    def _on_rebalance(self, node: Node, n: NoticeReport) -> None:
        """A rebalance recommendation: the pool's policy decides (see PoolSpec.rebalance_policy).

        ``checkpoint``: the job commits now and keeps running, so a notice that follows
        finds little to flush. ``replace``: the node stops counting as capacity, a
        replacement launches now, and the node is drained once the replacement is ready.
        """
        policy = self.config.pool.rebalance_policy
        self.record(EventKind.REBALANCE_RECOMMENDATION, node.id, notice_id=n.notice_id, policy=policy,
                    provider=n.provider, notice_seen_at=n.seen_at)
        if node.state is not NodeState.RUNNING or policy == "ignore":
            return
        if policy == "checkpoint":
            rid = f"rebalance-{n.notice_id}"
            self._send(node.id, {"kind": "checkpoint", "reason": "rebalance", "id": rid})
            self.record(EventKind.CHECKPOINT_REQUESTED, node.id, reason="rebalance", request_id=rid)
        elif not node.replacing:
            node.replacing = True
            self.store.put_node(node)
            self.wake()

    def _published_at(self, node: Node, provider: str | None, deadline: float | None) -> float | None:
        """When the notice appeared: from the provider when it knows (the local fakes),
        else the deadline minus the cloud's documented lead."""
        known = getattr(self.provider_for(node.provider), "notice_published_at", None)
        if known is not None and node.instance_id is not None:
            at = known(node.instance_id)
            if at is not None:
                return at
        lead = DOCUMENTED_LEAD_S.get(provider or "")
        return None if deadline is None or lead is None else deadline - lead

    def _on_trainer_status(self, node: Node, line: StatusLine) -> None:
        """A trainer's ``started``, ``checkpoint_committed`` or ``completed`` line.

        A node's token vouches for that node, not for the job, so a line changes the job
        only when it comes from the node that holds rank 0 of its attempt (the first node
        whose ``started`` line says rank 0 claims the attempt; a line of another node for
        that attempt is dropped), or, for a commit, from the node whose own notice the
        commit answers. ``completed`` must be at ``job.target_steps``. A commit is
        recorded once its manifest verifies in the job's store (:meth:`_verify_commits`,
        ``daemon.verify_commits``).

        Causal order: a ``started`` line that resumes from a commit not recorded yet (the
        survivors of an in-process shrink report their resume while the leaving node,
        which committed, may still be reporting the commit) is held until that commit is
        recorded, and so is a ``completed`` whose final commit is still being verified:
        the event log and the feed never show a resume before the commit it resumes from.
        After :data:`RESUME_HOLD_S` the daemon reads the commit's manifest from the store
        itself (:meth:`_confirm_held_resumes`).
        """
        if node.state not in MEMBERS:
            self._drop(node, "trainer_status", f"node is {node.state.value}, not in the job", line.event)
            return
        leader = self._attempt_leader.get(line.attempt)
        if line.event == "started":
            if line.rank != 0 or (leader is not None and leader != node.id):
                self._drop(node, "trainer_status", f"started of attempt {line.attempt} from rank {line.rank} "
                           f"(attempt held by {leader or 'nobody'})", line.event)
                return
            if line.attempt in self.job.attempts or any(h.attempt == line.attempt for _, h, _ in self._held):
                return
            self._attempt_leader[line.attempt] = node.id
            if line.resumed_from is not None and line.resumed_from not in self.job.commit_steps:
                self._held.append((node.id, line, self.clock()))
                return
            self._record_resume(node.id, line)
            return
        own_notice = any(i.startswith(f"{node.id}:") for i in line.notice_ids)
        if not (leader == node.id or (leader is None and line.rank == 0) or
                (line.event == "checkpoint_committed" and own_notice)):
            self._drop(node, "trainer_status", f"{line.event} of attempt {line.attempt} from rank {line.rank} "
                       f"(attempt held by {leader or 'nobody'})", line.event)
            return
        if line.event == "checkpoint_committed":
            if not self.config.daemon.verify_commits:
                self._record_commit(node.id, line)
            elif not (line.step in self.job.commit_steps and self._answered.issuperset(line.notice_ids)):
                self._to_verify.put_nowait((node.id, line))  # _verify_commits records it once its manifest verifies
        elif line.event == "completed":
            if line.step < self.config.job.target_steps:
                self._drop(node, "trainer_status", f"completed at step {line.step}, before job.target_steps "
                           f"{self.config.job.target_steps}", line.event)
                return
            if self.config.daemon.verify_commits and line.step not in self.job.commit_steps:
                self._held.append((node.id, line, self.clock()))  # its final commit is still being verified
                return
            self._record_completion(node.id, line)

    def _record_completion(self, node_id: str | None, line: StatusLine) -> None:
        if self.job.state is JobState.COMPLETED:
            return
        self.job.to(JobState.COMPLETED)
        self.job.step = line.step
        self.record(EventKind.JOB_COMPLETED, node_id, step=line.step, attempt=line.attempt)
        self.desired_nodes = 0
        self._completed.set()
        self.wake()

    async def _verify_commits(self) -> None:
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
            manifest, error = None, None
            try:
                async for attempt in AsyncRetrying(
                        stop=stop_after_attempt(CONFIRM_ATTEMPTS), wait=wait_exponential(min=1, max=4), reraise=True,
                        before_sleep=lambda rs, step=line.step: log.warning(
                            "commit_verify_failed", step=step, attempt=rs.attempt_number,
                            error=str(rs.outcome.exception())[:200] if rs.outcome else None)):
                    with attempt:
                        manifest = await asyncio.to_thread(self._read_manifest, line.step)
            except Exception as exc:  # noqa: BLE001 - the store out of reach or misconfigured
                log.warning("commit_verify_failed", step=line.step, attempt=CONFIRM_ATTEMPTS, error=str(exc)[:200])
                error = exc
            node = self.nodes.get(node_id)
            if error is not None:
                self._record_commit(node_id, line, unconfirmed=True)
                continue
            problem = None
            if manifest is None:
                problem = f"step {line.step} is not committed in {self.config.checkpoint_uri()}"
            else:
                named = manifest.extra.get("notice_ids") if isinstance(manifest.extra, dict) else None
                if isinstance(named, list) and not set(line.notice_ids) <= set(named):
                    problem = f"the manifest of step {line.step} does not name notices {sorted(set(line.notice_ids) - set(named))}"
            if problem is not None:
                if node is not None:
                    self._drop(node, "trainer_status", problem, line.event)
                continue
            if line.bytes is None:
                line = dataclasses.replace(line, bytes=sum(sh.size for sh in manifest.shards))
            self._record_commit(node_id, line)

    def _record_resume(self, node_id: str | None, line: StatusLine, *, commit_unconfirmed: bool = False) -> None:
        self.job.attempts.add(line.attempt)
        if line.resized == "in_process":
            self.job.resizes_in_process += 1
        if self.job.started_at is None:
            self.job.started_at = self.clock()
        world = line.world_size
        if world != self.job.world_size:
            self.record(EventKind.WORLD_SIZE_CHANGED, None, old=self.job.world_size, new=world)
            self.job.world_size = world
        # lost steps (the daemon's estimate, daemon/controlnode/metrics.py): the highest step reported
        # before this restart minus the step it resumed from
        reached, step = self.job.step, line.step
        lost = reached - step if reached is not None and reached > step else 0
        self.job.step = step
        self.job.resumed_at = self.clock()
        self.record(EventKind.JOB_RESUMED, node_id, attempt=line.attempt, step=step,
                    resumed_from=line.resumed_from, world_size=world, trainer_time=line.time,
                    lost_steps=lost, **({"resized": line.resized} if line.resized else {}),
                    **({"commit_unconfirmed": True} if commit_unconfirmed else {}))

    def _record_commit(self, node_id: str | None, line: StatusLine, *, source: str | None = None,
                       unconfirmed: bool = False) -> None:
        """Record one commit (once per step and notice: the first report of it), apply
        what it answers (notice flushes, the rejoin), then the resumes that waited for it."""
        step, ids = line.step, list(line.notice_ids)
        for nid in ids:
            self._flushes.pop(nid, None)
        if self._rejoin is not None and self._rejoin.id in ids:
            self._rejoin.answered = True
            self.wake()
        if step in self.job.commit_steps and self._answered.issuperset(ids):
            return  # a second report of a recorded commit (rank 0's and the noticed node's)
        # (a commit of a recorded step that answers new notices is recorded again: the
        # survivors of a shrink answering the next notice at the same step boundary)
        self._answered.update(ids)
        self.job.commit_steps.add(step)
        if self.job.last_commit_step is None or step >= self.job.last_commit_step:
            self.job.last_commit_step = step
            self.job.last_commit_time = line.time
        self.record(EventKind.CHECKPOINT_COMMITTED, node_id, step=step, attempt=line.attempt,
                    reason=line.reason, seconds=line.seconds, bytes=line.bytes,
                    notice_ids=ids, kinds=list(line.kinds), trainer_time=line.time,
                    save_s=line.save_s, upload_s=line.upload_s, **({"source": source} if source else {}),
                    **({"commit_unconfirmed": True} if unconfirmed else {}))
        raw = {k: v for k, v in (("seconds", line.seconds), ("bytes", line.bytes), ("save_s", line.save_s),
                                 ("upload_s", line.upload_s)) if v is not None}
        members = sum(1 for n in self.nodes.values() if n.state in MEMBERS)
        for check in preflight.measured_deadline_checks(self.config, raw, nodes=max(1, members),
                                                        world_size=self.job.world_size):
            if check.at_risk:  # the measured flush would not fit a notice window with the safety factor
                self.record(EventKind.CHECKPOINT_DEADLINE_RISK, node_id, step=step,
                            **check.event_data("measured"))
        for held in [h for h in self._held if _waits_on(h[1]) in self.job.commit_steps]:
            self._held.remove(held)
            if held[1].event == "completed":
                self._record_completion(held[0], held[1])
            else:
                self._record_resume(held[0], held[1])

    def _confirm_held_resumes(self) -> None:
        """A reconcile pass: a resume held :data:`RESUME_HOLD_S` for a commit nobody
        reported (the committing node died before its report got out) is settled from
        the store: the commit's manifest read in a thread; found, the commit is recorded
        (``source: "store"``) and the resume after it; not found, the resume is dropped;
        the store out of reach :data:`CONFIRM_ATTEMPTS` times, :data:`RESUME_HOLD_S` apart,
        the resume is recorded with ``commit_unconfirmed: true``."""
        now = self.clock()
        for node_id, line, held_at in list(self._held):
            step = _waits_on(line)
            if now - held_at < RESUME_HOLD_S or step is None or step in self._confirming:
                continue
            self._confirming.add(step)
            self.spawn(self._confirm_commit(step), f"confirm-commit-{step}")

    async def _confirm_commit(self, step: int) -> None:
        try:
            manifest = await asyncio.to_thread(self._read_manifest, step)
        except Exception as exc:  # the store unreachable (or misconfigured): again RESUME_HOLD_S later
            failures = self._confirm_failures[step] = self._confirm_failures.get(step, 0) + 1
            log.warning("commit_confirm_failed", step=step, attempt=failures, error=str(exc)[:200])
            held = [h for h in self._held if _waits_on(h[1]) == step]
            for h in held:
                self._held.remove(h)
                if failures < CONFIRM_ATTEMPTS:
                    self._held.append((h[0], h[1], self.clock()))
                elif h[1].event == "completed":
                    self._record_completion(h[0], h[1])
                else:  # availability over order: the job's view must not freeze with the store out of reach
                    self._record_resume(h[0], h[1], commit_unconfirmed=True)
            return
        finally:
            self._confirming.discard(step)
        if step in self.job.commit_steps:
            return
        if manifest is None:
            for held in [h for h in self._held if _waits_on(h[1]) == step]:
                self._held.remove(held)
                node = self.nodes.get(held[0])
                if node is not None:
                    self._drop(node, "trainer_status", f"{held[1].event} at step {step}, which is not committed",
                               held[1].event)
            return
        extra = manifest.extra if isinstance(manifest.extra, dict) else {}
        self._record_commit(None, StatusLine(
            event="checkpoint_committed", attempt=str(extra.get("attempt") or "?"), rank=None,
            world_size=manifest.world_size, step=step, time=manifest.time,
            notice_ids=tuple(i for i in extra.get("notice_ids") or () if isinstance(i, str)),
            reason=extra.get("reason") if isinstance(extra.get("reason"), str) else None,
            bytes=sum(s.size for s in manifest.shards)), source="store")

    def _read_manifest(self, step: int) -> Any:
        """The verified manifest of ``step`` in the job's checkpoint store, or None (blocking: a thread).

        Raises:
            trainer.storage.StorageError: the store failed (out of reach, no access).
        """
        from trainer.checkpoint import open_store, scan_step

        if self._checkpoint_store is None:  # one client (boto3's are thread-safe), made on first use
            job = self.config.job
            self._checkpoint_store = open_store(self.config.checkpoint_uri(), s3_endpoint_url=job.s3_endpoint_url,
                                                oss_endpoint=job.oss_endpoint)
        return scan_step(self._checkpoint_store, step)


def _waits_on(line: StatusLine) -> int | None:
    """The step whose commit a held line waits for: a resume's origin, a completion's step."""
    return line.step if line.event == "completed" else line.resumed_from


def zone_key(provider: str, region: str, zone: str | None) -> str:
    return f"{provider}/{region}/{zone or '-'}"


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s`` seconds; True if it was set.

    ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11, wait_for
    can swallow a cancellation that arrives as the event is set (gh-86296), and a
    loop that loses its cancel never stops.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
        return True
    except TimeoutError:
        return False
