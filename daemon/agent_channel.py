"""The agents' side of the :class:`~daemon.supervisor.Supervisor`: what it answers on
the agent port (``daemon/api.py``), and what it makes of the agents' reports.

:class:`AgentChannel` is a base class of ``Supervisor``, kept in its own module so the
supervisor's file holds the reconcile loop, admission and the operator's verbs. It
uses the supervisor's state (``nodes``, ``job``, ``config``, ``store``, ``record``,
``wake``, ``_set_state``, ...) and is not meant to be used alone.

- **Heartbeat interval**: every register and heartbeat reply tells the node when to
  heartbeat next, ``max(agent.heartbeat_interval_s, live nodes /
  daemon.max_heartbeats_per_second)`` (:func:`daemon.pool.heartbeat_interval_s`, as
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
import hmac
import math
import zlib
from typing import Any, Callable

import structlog

from daemon import preflight
from daemon.gpu import parse_samples
from daemon.metadata.registry import DOCUMENTED_LEAD_S
from daemon.model import TORCHRUN_ARGV, TRAINER_STATES, EventKind, JobState, Node, NodeState
from daemon.pool import heartbeat_interval_s as scaled_heartbeat_interval

__all__ = ["AgentChannel"]

log = structlog.get_logger("spotvisor.daemon")

LIVE_STATES = frozenset(
    {NodeState.LAUNCHING, NodeState.READY, NodeState.ADMITTING, NodeState.RUNNING, NodeState.DRAINING}
)
# a noticed node's zone is avoided by replacements this long (seconds)
AVOID_ZONE_S = 300.0
# a commit reported just before a notice's deadline may still be on its way (the
# agent's report retry backs off up to 5 s): wait this long past it before saying
# the flush timed out
FLUSH_GRACE_S = 5.0


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
        (:mod:`daemon.launcher`) and its heartbeats say ``warming`` until it has imported;
        for a torchrun job the node is ``warming`` from now, so that admission does not
        ask the survivors for a rejoin commit (and make them hold) before the first
        heartbeat says so (:meth:`Supervisor._admit`)."""
        self._seen(node)
        self._rescale_heartbeat()  # one more live node
        spec = self.job_spec(node)
        if prewarm and tuple(spec["argv"][:2]) == TORCHRUN_ARGV and node.trainer == "not_started":
            node.trainer = "warming"
            self.store.put_node(node)
        return {"job": spec, "heartbeat_interval_s": self._tell_interval(node)}

    def on_heartbeat(self, node: Node, body: dict[str, Any]) -> dict[str, Any]:
        self._seen(node)
        trainer = body.get("trainer")
        if isinstance(trainer, dict) and trainer.get("state") in TRAINER_STATES:
            if trainer["state"] != node.trainer:
                node.trainer = trainer["state"]
                self.store.put_node(node)
                self.wake()
        step = body.get("step")
        if isinstance(step, int):
            node.step = step
            if self.job.step is None or step > self.job.step:
                self.job.step = step
        self.node_logs.feed(node.id, body.get("log"))
        low = self.gpu_watch.observe(node.id, parse_samples(body.get("gpu")), now=self.clock(),
                                     training=node.state is NodeState.RUNNING and node.trainer == "running")
        if low is not None:
            self.record(EventKind.GPU_UNDERUTILIZED, node.id, **low)
        reply = self._agent_reply(node)
        reply["heartbeat_interval_s"] = self._tell_interval(node)  # when to send the next one
        reply["log"] = self.node_logs.ack(node.id)  # where the next trainer.log chunk starts (daemon/nodelog.py)
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
        return {"commands": self._commands.pop(node.id, []), "start_trainer": start, "stop_trainer": False}

    def _rescale_heartbeat(self) -> None:
        live = sum(1 for n in self.nodes.values() if n.state in LIVE_STATES)
        self.heartbeat_interval_s = scaled_heartbeat_interval(
            live, min_interval_s=self.config.agent.heartbeat_interval_s,
            max_per_second=self.config.daemon.max_heartbeats_per_second)

    def _tell_interval(self, node: Node) -> float:
        """The heartbeat interval to tell ``node`` now (seconds), remembered for its lost
        timeout (:meth:`daemon.pool.Timeouts.lost_after_s`).

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
        """Apply an agent's batch of reports, in order. A report that cannot be used
        (:func:`_report_problem`) is logged and dropped whole before anything of it is
        applied: raising here would answer 500, and the agent resends a failed batch
        until it is accepted, re-applying the reports before the bad one each time and
        holding back every report after it (a notice, a commit) for good."""
        self._seen(node)
        for r in reports:
            problem = _report_problem(r)
            if problem is not None:
                log.warning("agent_report_dropped", node_id=node.id, problem=problem, report=repr(r)[:200])
                continue
            kind = r.get("kind")
            if kind == "interruption_notice":
                self._on_notice(node, r)
            elif kind == "trainer_status" and isinstance(r.get("line"), dict):
                self._on_trainer_status(node, r["line"])
            elif kind == "rebalance_recommendation":
                self._on_rebalance(node, r)
            elif kind == "metadata_unreachable":
                self.record(EventKind.METADATA_UNREACHABLE, node.id, failures=r.get("failures"),
                            error=r.get("error"), url=r.get("url"))
            elif kind == "metadata_recovered":
                self.record(EventKind.METADATA_RECOVERED, node.id, failures=r.get("failures"))
            elif kind == "trainer_exited":
                node.trainer = "exited"
                self.store.put_node(node)
                self.record(EventKind.TRAINER_EXITED, node.id, exit_code=r.get("exit_code"))
                self.wake()
            else:
                log.warning("unknown_report", node_id=node.id, kind=kind)

    def _seen(self, node: Node) -> None:
        node.last_heartbeat = self.clock()
        if node.state is NodeState.LAUNCHING:
            node.ready_at = node.last_heartbeat
            self._set_state(node, NodeState.READY)
            self.record(EventKind.NODE_READY, node.id, boot_s=round(node.ready_at - node.created_at, 2))
            self.wake()

    def _on_notice(self, node: Node, r: dict[str, Any]) -> None:
        notice = r.get("notice") or {}
        node.deadline = r.get("deadline")
        seen_at = r.get("seen_at")
        published_at = self._published_at(node, notice.get("provider"), node.deadline)
        in_job = node.state is NodeState.RUNNING and node.trainer == "running"
        self.record(EventKind.INTERRUPTION_NOTICE, node.id, notice_id=notice.get("id"),
                    action=notice.get("action"), deadline=notice.get("deadline"), provider=notice.get("provider"),
                    notice_published_at=published_at, notice_seen_at=seen_at,
                    detection_latency_s=None if published_at is None or seen_at is None
                    else round(seen_at - published_at, 3))
        if in_job and notice.get("id") is not None:  # its flush must commit before the deadline
            lead = DOCUMENTED_LEAD_S.get(notice.get("provider") or "", 120.0)
            due = node.deadline if node.deadline is not None else self.clock() + lead
            self._flushes.setdefault(str(notice["id"]), (node.id, due + FLUSH_GRACE_S))
        if not node.state.is_terminal() and node.state is not NodeState.DRAINING:
            self._set_state(node, NodeState.DRAINING, "interruption notice")
        # the replacement prefers another zone (SkyPilot's EAGER_NEXT_REGION, first retry)
        self._avoid_zone[zone_key(node.provider, node.region, node.zone)] = self.clock() + AVOID_ZONE_S
        if self._rejoin is not None:
            self._rejoin.nodes.discard(node.id)
        self.wake()

    def _on_rebalance(self, node: Node, r: dict[str, Any]) -> None:
        """A rebalance recommendation: the pool's policy decides (see PoolSpec.rebalance_policy).

        ``checkpoint``: the job commits now and keeps running, so a notice that follows
        finds little to flush. ``replace``: the node stops counting as capacity, a
        replacement launches now, and the node is drained once the replacement is ready.
        """
        notice = r.get("notice") or {}
        policy = self.config.pool.rebalance_policy
        self.record(EventKind.REBALANCE_RECOMMENDATION, node.id, notice_id=notice.get("id"), policy=policy,
                    provider=notice.get("provider"), notice_seen_at=r.get("seen_at"))
        if node.state is not NodeState.RUNNING or policy == "ignore":
            return
        if policy == "checkpoint":
            rid = f"rebalance-{notice.get('id')}"
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

    def _on_trainer_status(self, node: Node, line: dict[str, Any]) -> None:
        event = line.get("event")
        attempt = str(line.get("attempt"))
        if event == "started":
            if attempt in self.job.attempts:
                return
            self.job.attempts.add(attempt)
            if line.get("resized") == "in_process":
                self.job.resizes_in_process += 1
            if self.job.started_at is None:
                self.job.started_at = self.clock()
            world = line.get("world_size")
            if world != self.job.world_size:
                self.record(EventKind.WORLD_SIZE_CHANGED, None, old=self.job.world_size, new=world)
                self.job.world_size = world
            # lost steps (the daemon's estimate, daemon/metrics.py): the highest step reported
            # before this restart minus the step it resumed from
            reached, step = self.job.step, line.get("step")
            lost = reached - step if isinstance(reached, int) and isinstance(step, int) and reached > step else 0
            self.job.step = step
            self.job.resumed_at = self.clock()
            self.record(EventKind.JOB_RESUMED, node.id, attempt=attempt, step=step,
                        resumed_from=line.get("resumed_from"), world_size=world, trainer_time=line.get("time"),
                        lost_steps=lost, **({"resized": line["resized"]} if line.get("resized") else {}))
        elif event == "checkpoint_committed":
            key = (attempt, int(line.get("step", -1)))
            if key in self.job.commits:
                return
            self.job.commits.add(key)
            self.job.last_commit_step = key[1]
            self.job.last_commit_time = line.get("time")
            ids = list(line.get("notice_ids") or [])
            for nid in ids:
                self._flushes.pop(str(nid), None)
            self.record(EventKind.CHECKPOINT_COMMITTED, node.id, step=key[1], attempt=attempt,
                        reason=line.get("reason"), seconds=line.get("seconds"), bytes=line.get("bytes"),
                        notice_ids=ids, kinds=line.get("kinds") or [], trainer_time=line.get("time"),
                        save_s=line.get("save_s"), upload_s=line.get("upload_s"))
            in_job = sum(1 for n in self.nodes.values() if n.state in (NodeState.RUNNING, NodeState.DRAINING))
            for check in preflight.measured_deadline_checks(self.config, line, nodes=max(1, in_job),
                                                            world_size=self.job.world_size):
                if check.at_risk:  # the measured flush would not fit a notice window with the safety factor
                    self.record(EventKind.CHECKPOINT_DEADLINE_RISK, node.id, step=key[1],
                                **check.event_data("measured"))
            if self._rejoin is not None and self._rejoin.id in ids:
                self._rejoin.answered = True
                self.wake()
        elif event == "completed":
            if self.job.state is JobState.COMPLETED:
                return
            self.job.state = JobState.COMPLETED
            self.job.step = line.get("step")
            self.record(EventKind.JOB_COMPLETED, node.id, step=line.get("step"), attempt=attempt)
            self.desired_nodes = 0
            self._completed.set()
            self.wake()


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


def _report_problem(r: Any) -> str | None:
    """Why an agent's report cannot be used, or None if it can: the fields the daemon
    computes with must have their types (a notice's deadline is kept on the node and
    compared with the clock on every reconcile pass)."""
    if not isinstance(r, dict):
        return "not a JSON object"
    kind = r.get("kind")
    if kind in ("interruption_notice", "rebalance_recommendation"):
        if not isinstance(r.get("notice") or {}, dict):
            return "notice is not an object"
        for key in ("deadline", "seen_at"):
            v = r.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return f"{key} is not unix seconds"
    elif kind == "trainer_status":
        line = r.get("line")
        if not isinstance(line, dict):
            return "line is not an object"
        step, ids = line.get("step"), line.get("notice_ids")
        if (step is not None or line.get("event") == "checkpoint_committed") and (
                isinstance(step, bool) or not isinstance(step, int)):
            return "step is not an integer"
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return "notice_ids is not a list of strings"
    return None
