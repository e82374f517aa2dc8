"""The agents' channel: what the daemon answers on the agent port (``interfaces/api.py``).

- **Register and heartbeat**: every register and heartbeat reply tells the node when to
  heartbeat next, ``max(agent.heartbeat_interval_s, live nodes /
  daemon.max_heartbeats_per_second)`` (:func:`daemon.control.pool.heartbeat_interval_s`, as
  Nomad does), told as the time to the node's next slot when stretched, so the pool's
  heartbeats arrive evenly spread; the node's lost timeout scales with what it was
  told (``NodeView.heartbeat_interval_s``). A heartbeat carries the trainer's state and
  step, the GPUs' figures (:mod:`.gpu_watch`) and a ``trainer.log`` chunk (:mod:`.node_logs`).
- **Join credentials**: every reply that tells a node to start its trainer carries the
  node's credential (:meth:`AgentLink.credential`, :mod:`trainer.credential`), issued
  with the pool's join key, which the store keeps (``spotvisord.db``, 0600): the node's
  workers prove with it that the daemon admitted their node when they join a running
  group through the rendezvous store. It travels in this channel only (TLS beyond
  loopback), never in a log line.
- **Commands** (start the trainer, checkpoint / rejoin, drain, cancel) do not wait for
  a heartbeat: every producer goes through :meth:`AgentLink.send`, which wakes the
  node's outstanding ``POST /v1/agent/commands`` long-poll (:meth:`AgentLink.wait_commands`),
  held up to ``agent.command_wait_s`` (300 s) when the node has nothing to do.
  Heartbeat replies still carry commands (an older agent, a lost long-poll); whichever
  reply comes first pops them, so each is delivered once.

Reports (``POST /v1/agent/events``) are :mod:`.intake`'s.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import random
import zlib
from typing import Any, Callable

from daemon.control.lifecycle import LIVE, TrainerState, training
from daemon.control.pool import heartbeat_interval_s as scaled_heartbeat_interval
from daemon.control.progress import ProgressWindow, Sample
from daemon.control.reports import ReportError, parse_progress, parse_reports_pending, parse_step
from daemon.controlnode.core import Core, wait_event
from daemon.controlnode.gpu_watch import GpuWatch, parse_samples
from daemon.controlnode.jobspec import prepares, run_id
from daemon.controlnode.node_logs import NodeLogs
from daemon.model import TORCHRUN_ARGV, EventKind, Node, NodeState
from trainer.credential import Authority

__all__ = ["AgentLink"]

_TRAINER_VALUES = frozenset(t.value for t in TrainerState)
JOIN_KEY = "join_key"  # the store's key for the pool's join key (hex of its 32 bytes)


class AgentLink:
    """Register, heartbeat and command long-poll of every node of one pool."""

    def __init__(self, core: Core, *, rng: random.Random, on_step: Callable[[Node, int], None],
                 leader: Callable[[], str | None] = lambda: None) -> None:
        self.core = core
        self._on_step = on_step  # JobTracker.on_step: whose step is the job's is the tracker's rule
        self._leader = leader  # the node that leads the running attempt (JobTracker.running_leader)
        # the job's progress, one sample per heartbeat of the leading node (daemon/control/progress.py)
        self.progress = ProgressWindow()
        self._rng = rng
        config = core.config
        self.node_logs = NodeLogs()  # each node's trainer.log tail, shipped with its heartbeats
        self.gpu_watch = GpuWatch(threshold_pct=config.daemon.gpu_underutilized_pct,
                                  window_s=config.daemon.gpu_underutilized_window_s)
        self.heartbeat_interval_s = config.agent.heartbeat_interval_s  # the pool's, now (rescale_heartbeat)
        self._commands: dict[str, list[dict[str, Any]]] = {}  # node id → commands not yet delivered
        self._command_ready: dict[str, asyncio.Event] = {}  # node id → set when a command is queued
        self._command_polls: dict[str, int] = {}  # node id → generation of its newest long-poll
        self._told_start: dict[str, bool] = {}  # node id → the start_trainer it was last told
        self.told_interval: dict[str, float] = {}  # node id → the heartbeat interval it was last told (s)
        # node id → since when its agent says reports wait for an answer (None: none); a node
        # not heard since this daemon started owes them since then (reports_owed_since)
        self.reports_owed: dict[str, float | None] = {}
        self.started_at = core.clock()
        self._authority: Authority | None = None  # the pool's join key, from the store on first use
        self._credentials: dict[str, tuple[str, str]] = {}  # node id → (run id, the join credential it is given)

    def close(self) -> None:
        """The daemon closes: every held long-poll answers now."""
        for ready in self._command_ready.values():
            ready.set()

    def authenticate(self, node_id: str, token: str) -> Node | None:
        node = self.core.nodes.get(node_id)
        if node is None or not hmac.compare_digest(node.token, token):
            return None
        return node

    def on_register(self, node: Node, *, prewarm: bool = False) -> dict[str, Any]:
        """An agent came up: the node is ``ready``; returns the job spec it runs and its
        heartbeat interval (seconds). The node keeps the ``job.workdir`` version the spec
        hands it (``Node.code_version``: the daemon run's pin, :mod:`.code_delivery`).

        ``prewarm``: the agent starts a torchrun job's process at once
        (:mod:`daemon.gpunode.launcher`) and its heartbeats say ``warming`` until it has imported;
        for a torchrun job the node is ``warming`` from now, so that admission does not
        ask the survivors for a rejoin commit (and make them hold) before the first
        heartbeat says so (:func:`daemon.control.admission.admit`)."""
        self.seen(node)
        self.rescale_heartbeat()  # one more live node
        spec = self.core.job_spec(node)
        version = spec.get("workdir", {}).get("sha256", "")
        if version != node.code_version:
            node.code_version = version
            self.core.store.put_node(node)
        if prewarm and tuple(spec["argv"][:2]) == TORCHRUN_ARGV and node.trainer is TrainerState.NOT_STARTED \
                and node.state is not NodeState.PREPARING:  # a preparing agent prewarms once prepared
            node.trainer = TrainerState.WARMING
            self.core.store.put_node(node)
        return {"job": spec, "heartbeat_interval_s": self.tell_interval(node)}

    def on_heartbeat(self, node: Node, body: dict[str, Any]) -> dict[str, Any]:
        self.seen(node)
        trainer = body.get("trainer")
        if isinstance(trainer, dict) and trainer.get("state") in _TRAINER_VALUES:
            if trainer["state"] != node.trainer:  # the agent's word: its lifecycle is its own (agent.py)
                node.trainer = TrainerState(trainer["state"])
                self.core.store.put_node(node)
                self.core.wake()
        self._on_reports_pending(node, body.get("reports_pending"))
        try:
            step = parse_step(body.get("step"), self.core.limits())
        except ReportError as exc:
            self.core.drop(node, "heartbeat", str(exc), body.get("step"))
            step = None
        if step is not None:
            self._on_step(node, step)
        self._on_progress(node, body.get("progress"))
        self.node_logs.feed(node.id, body.get("log"))
        samples = parse_samples(body.get("gpu"), drop=lambda problem, what: self.core.drop(node, "gpu", problem, what))
        low = self.gpu_watch.observe(node.id, samples, now=self.core.clock(), training=training(node))
        if low is not None:
            self.core.record(EventKind.GPU_UNDERUTILIZED, node.id, **low)
        reply = self.reply(node)
        reply["heartbeat_interval_s"] = self.tell_interval(node)  # when to send the next one
        reply["log"] = self.node_logs.ack(node.id)  # where the next trainer.log chunk starts (daemon/gpunode/nodelog.py)
        return reply

    def _on_reports_pending(self, node: Node, value: Any) -> None:
        """A heartbeat's ``reports_pending``: kept as since when the node owes reports."""
        try:
            pending = parse_reports_pending(value)
        except ReportError as exc:
            self.core.drop(node, "reports_pending", str(exc), value)
            return
        if pending == 0:
            if self.reports_owed.get(node.id, 0.0) is not None:  # its reports are in: a drained node may go
                self.core.wake()
            self.reports_owed[node.id] = None
        elif self.reports_owed.get(node.id) is None:
            self.reports_owed[node.id] = self.core.clock()

    def interval_of(self, node_id: str) -> float:
        """The heartbeat interval ``node_id`` was last told (s); not told by this daemon (it
        restarted): what it would be told now."""
        return self.told_interval.get(node_id, self.heartbeat_interval_s)

    def forget(self, node_id: str) -> None:
        """``node_id`` ended: what is kept of its agent goes."""
        self.told_interval.pop(node_id, None)
        self.reports_owed.pop(node_id, None)

    def reports_owed_since(self, node_id: str) -> float | None:
        """Since when ``node_id``'s agent has owed reports (unix s; None: none): this daemon's
        start for a node it has not heard from yet."""
        return self.reports_owed.get(node_id, self.started_at)

    def _on_progress(self, node: Node, value: Any) -> None:
        """A heartbeat's ``progress``: a sample of the job's only from the node leading its attempt."""
        try:
            p = parse_progress(value, self.core.limits())
        except ReportError as exc:
            self.core.drop(node, "progress", str(exc), value)
            return
        if p is not None and node.id == self._leader():
            self.progress.add(node.id, Sample(t=self.core.clock(), step=p.step, tokens=p.tokens, loss=p.loss))

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
        self.seen(node)
        cap = self.core.config.agent.command_wait_s
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
            if self.core.closed or self._command_polls.get(node.id) != gen or not connected():
                return None
            remaining = deadline - loop.time()
            news = bool(self._commands.get(node.id)) or self._told_start.get(node.id, False) != self.should_run(node)
            if news or remaining <= 0:
                return self.reply(node)
            await wait_event(ready, remaining)

    def send(self, node_id: str, command: dict[str, Any]) -> None:
        """Queue a command for a node and wake its long-poll: every producer comes here."""
        self._commands.setdefault(node_id, []).append(command)
        self.poke(node_id)

    def poke(self, node_id: str) -> None:
        """Answer ``node_id``'s held long-poll now: its commands or its start decision changed."""
        ready = self._command_ready.get(node_id)
        if ready is not None:
            ready.set()

    def should_run(self, node: Node) -> bool:
        """Whether ``node``'s agent should run the trainer (it starts one if it has none)."""
        return node.state is NodeState.RUNNING and not self.core.job.state.is_terminal()

    def reply(self, node: Node) -> dict[str, Any]:
        """Take ``node``'s queued commands and its start/stop decision into a reply, with
        where the node's rendezvous store is (``host:port`` of this daemon's, for its
        domain: after an HA takeover, the new leader's)."""
        start = self._told_start[node.id] = self.should_run(node)
        rdzv = self.core.config.domain(self.core.domain_of(node)).rendezvous  # this daemon's store (HA: moved)
        reply: dict[str, Any] = {"commands": self._commands.pop(node.id, []), "start_trainer": start,
                                 "rendezvous": f"{rdzv.host}:{rdzv.port}"}
        if start:
            reply["join_credential"] = self.credential(node)  # the workers' proof that the daemon admitted it
        if start and node.joins_running:
            reply["join"] = True  # start the job spec's "join" launcher: into the running group
        elif start and node.start_cohort and node.start_until is not None:
            # admitted at the job's start with others: its torchrun waits for theirs first
            reply["start_cohort"] = {"nodes": node.start_cohort, "until": node.start_until}
        return reply

    def withdraw(self, node: Node, reply: dict[str, Any]) -> None:
        """``reply`` (from :meth:`reply`) was not sent (its state not durable yet): its
        commands go back to the front of ``node``'s queue, in order, and its start
        decision counts as untold, so the node's next poll is answered with both."""
        commands = reply.get("commands") or []
        if commands:
            self._commands[node.id] = [*commands, *self._commands.get(node.id, [])]
        self._told_start.pop(node.id, None)

    def credential(self, node: Node) -> str:
        """``node``'s join credential for the job's run id now (:meth:`trainer.credential.Authority.issue`),
        issued once per node, run and daemon (a stalled job's restart moves it to a new run
        id: a new one then): a secret, for the agent's reply only. The pool's join key is
        made (32 bytes from :mod:`secrets`) the first time and kept in the store."""
        run = run_id(self.core.config, self.core.run_nonce)
        held = self._credentials.get(node.id)
        if held is not None and held[0] == run:
            return held[1]
        if self._authority is None:
            seed = self.core.store.get(JOIN_KEY)
            self._authority = Authority(bytes.fromhex(seed)) if seed else Authority.generate()
            if not seed:
                self.core.store.set(JOIN_KEY, self._authority.seed.hex())
        cred = self._authority.issue(run=run, node=node.id, now=self.core.clock())
        self._credentials[node.id] = (run, cred)
        return cred

    def rescale_heartbeat(self) -> None:
        """The pool's heartbeat interval for its live nodes now (:func:`daemon.control.pool.heartbeat_interval_s`)."""
        live = sum(1 for n in self.core.nodes.values() if n.state in LIVE)
        self.heartbeat_interval_s = scaled_heartbeat_interval(
            live, min_interval_s=self.core.config.agent.heartbeat_interval_s,
            max_per_second=self.core.config.daemon.max_heartbeats_per_second)

    def tell_interval(self, node: Node) -> float:
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
        floor, interval = self.core.config.agent.heartbeat_interval_s, self.heartbeat_interval_s
        if interval > floor:
            phase = zlib.crc32(node.id.encode()) / 2**32
            now = self.core.clock()
            slot = (math.floor(now / interval - phase) + 1 + phase) * interval
            if slot - now < interval / 2:
                slot += interval
            interval = round(max(floor, slot - now), 3)
        self.told_interval[node.id] = interval
        return interval

    def seen(self, node: Node) -> None:
        """A sign of life from ``node``'s agent: its heartbeat clock, and ``ready`` on the first
        (``preparing`` when it has a ``job.workdir`` or ``job.setup`` to prepare: :mod:`.code_delivery`)."""
        node.last_heartbeat = self.core.clock()
        if node.state is NodeState.LAUNCHING and prepares(self.core.config):
            self.core.set_state(node, NodeState.PREPARING)
        elif node.state is NodeState.LAUNCHING:
            node.ready_at = node.last_heartbeat
            self.core.set_state(node, NodeState.READY)
            self.core.record(EventKind.NODE_READY, node.id, boot_s=round(node.ready_at - node.created_at, 2))
            self.core.wake()
