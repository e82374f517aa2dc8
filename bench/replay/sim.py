"""A market replay that runs the daemon's own decisions on a simulated clock.

:class:`Replay` drives one recovery policy (:mod:`daemon.control.policies`) through a
:class:`~bench.replay.traces.Trace`. Each pass calls exactly what ``spotvisord``'s
reconcile loop calls: :func:`daemon.control.pool.plan`, the policy's ``after_loss`` and
``admit``, and :func:`daemon.control.reactions.on_notice` when a node's notice arrives;
the simulation only carries out the actions they return, against a simulated cloud and
a simulated job:

- **the cloud**: each offer is a trace zone; a launch succeeds while the pool holds fewer
  of that zone's nodes than the trace's capacity then (otherwise a capacity error, and
  the offer backs off as :func:`daemon.control.offers.capacity_backoff_s` says); an
  instance boots in ``JobModel.boot_s``; when the trace's capacity falls below what the
  pool holds, the youngest nodes there are taken, each after an interruption notice
  ``JobModel.lead_s`` before (AWS's documented 120 s: no trace records notices); spot
  nodes are billed at the trace's price (or the offer's), on-demand ones at the
  on-demand price, from the launch to their end.
- **the job** (:class:`JobModel`): steps take ``step_s × ref_gpus / world`` (the global
  batch is constant: data parallel, ideal scaling unless ``scaling`` < 1); a commit
  takes ``checkpoint_bytes / (nodes × upload_bytes_s)``; periodic commits every
  ``checkpoint_every_steps``; a restart (a torchrun restart, a grow, a restart of the
  whole pool) costs ``restart_s`` plus loading the checkpoint; an in-process shrink
  after a notice costs ``resize_s``; with ``grow_in_process`` (``job.grow: in_process``)
  a grow is in-process too: the survivors pause :meth:`JobModel.grow_s` while the
  joiners take the state from one of them, and nothing restarts. A policy that acts on notices commits at the next
  step boundary after one and loses nothing; one that does not loses what was trained
  since the last periodic commit when the node is taken.

Pure simulation: no I/O, no wall clock; 45 days of a 9-zone trace take seconds.
"""

from __future__ import annotations

import heapq
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

from daemon.control import actions as a
from daemon.control.admission import Rules
from daemon.control.availability import Availability
from daemon.control import migration as mig
from daemon.control.deadline import Progress, in_markets, narrow
from daemon.control.lifecycle import ADMITTED, LIVE, JobState, NodeState, TrainerState, training
from daemon.control.offers import History, Offer, capacity_backoff_s
from daemon.control.policies import RecoveryPolicy, lost_from_job
from daemon.control.pool import Desired, Timeouts, plan
from daemon.control.reactions import on_notice

from bench.replay.traces import Trace

__all__ = ["JobModel", "Market", "Replay", "Result", "region_of"]

_ZONE = re.compile(r"^([a-z]{2}(?:-[a-z]+)+-\d+)[a-z]$")  # us-east-1c -> us-east-1 (AWS, GCP-like names)


def region_of(zone: str) -> str:
    """The region of an AWS-style zone name (``us-east-1c`` → ``us-east-1``); other names
    are their own region."""
    m = _ZONE.match(zone)
    return m.group(1) if m else zone



@dataclass(frozen=True)
class JobModel:
    """What the job costs in time. Seconds, bytes, bytes/second.

    The defaults are a 1.3 B-parameter data-parallel job on 1-GPU nodes (Bamboo's p3.2xlarge
    setting): 16 GB of checkpoint (2 B weights + 12 B fp32 master and Adam states per
    parameter), 1 GB/s per node to the store, a 120 s boot (an EC2 GPU instance to its
    agent's registration), 60 s of restart (torchrun's re-rendezvous, process start,
    CUDA and NCCL init: bench/README's restart_on_preemption figures scaled to a GPU
    node), 2 s of in-process shrink (bench/README: notice → resume, max 1.4 s here),
    1.25 GB/s from node to node (a p3.2xlarge's 10 Gb/s) for an in-process grow's state.
    """

    target_steps: int = 10_000
    step_s: float = 2.0  # seconds per step at ref_gpus GPUs
    ref_gpus: int = 32
    scaling: float = 1.0  # step time ∝ (ref_gpus / world) ** scaling
    checkpoint_bytes: float = 16e9
    upload_bytes_s: float = 1e9  # per node, to the store
    download_bytes_s: float = 1e9  # per node, from the store
    checkpoint_every_steps: int = 100
    boot_s: float = 120.0
    restart_s: float = 60.0
    resize_s: float = 2.0
    lead_s: float = 120.0
    peer_bytes_s: float = 1.25e9  # node to node: an in-process grow's state to its joiners

    def grow_s(self) -> float:
        """An in-process grow's pause of the survivors (``job.grow: in_process``): the group
        re-formed (``resize_s``) and the state (``checkpoint_bytes``: weights, fp32 masters,
        Adam's moments) broadcast from one survivor to the joiners at ``peer_bytes_s``
        (``trainer.resize``'s ``send_state``; a broadcast, so one copy's time for any
        number of joiners). Seconds."""
        return self.resize_s + self.checkpoint_bytes / self.peer_bytes_s

    def step_time(self, gpus: int) -> float:
        return self.step_s * (self.ref_gpus / max(1, gpus)) ** self.scaling

    def save_s(self, nodes: int) -> float:
        return self.checkpoint_bytes / (max(1, nodes) * self.upload_bytes_s)

    def load_s(self, nodes: int) -> float:
        return self.checkpoint_bytes / (max(1, nodes) * self.download_bytes_s)


@dataclass(frozen=True)
class Market:
    """How the pool buys: ``gpus_per_node``, the on-demand price (USD/hour), the spot price
    when the trace has none, and whether it buys on demand only (``on_demand``)."""

    gpus_per_node: int = 1
    on_demand_usd_h: float = 3.06  # p3.2xlarge, us-east-1
    spot_usd_h: float = 0.918  # p3.2xlarge spot, the trace's floor, when the trace has no price
    on_demand: bool = False


@dataclass
class _Node:
    id: str
    zone: str
    offer: int
    ordinal: int
    created_at: float
    gpus: int
    on_demand: bool
    state: NodeState = NodeState.LAUNCHING
    ready_at: float | None = None
    trainer: TrainerState = TrainerState.NOT_STARTED
    deadline: float | None = None
    taken_at: float | None = None  # when the market takes it (its notice came lead_s before)
    ended_at: float | None = None
    noticed: bool = False
    left_cleanly: bool = False  # left after its notice's commit (nothing lost)
    replacing: bool = False  # a spot node is coming to take its place (then it is drained)
    domain: str = ""
    held: bool = False  # a migration's source node, kept (and billed) until the move is done

    def view(self) -> a.NodeView:
        return a.NodeView(id=self.id, state=self.state, gpus=self.gpus, created_at=self.created_at,
                          last_heartbeat=None, deadline=self.deadline, trainer=self.trainer,
                          ordinal=self.ordinal, ready_at=self.ready_at, replacing=self.replacing,
                          market="on_demand" if self.on_demand else "spot", domain=self.domain, held=self.held)


@dataclass
class _Move:
    """A whole-job migration in flight (:mod:`daemon.control.migration`'s phases)."""

    source: str
    target: str
    reason: str
    started_at: float
    phase: mig.Phase = mig.Phase.BOOTING
    markets: frozenset[str] | None = None  # the target's markets while the move is in flight
    switch_at: float | None = None  # the copy is done then: the job's domain becomes the target


@dataclass
class Result:
    """One policy on one trace. Hours, USD, steps."""

    policy: str
    hours: float
    steps: int
    lost_steps: int
    cost_usd: float
    node_hours: float
    restarts: int
    resizes: int
    completed_at_h: float | None
    world_hours: dict[int, float] = field(default_factory=dict)
    deadline_h: float | None = None
    on_demand_node_hours: float = 0.0
    timeline: list[tuple[float, int, float, int]] = field(default_factory=list)  # (h, world, usd, steps)
    migrations: int = 0
    migrations_failed: int = 0
    egress_usd: float = 0.0
    domain_hours: dict[str, float] = field(default_factory=dict)  # hours the job's domain was each
    optimum_usd: float | None = None  # a lower bound on the cost of the same work (bench.replay.optimum)

    @property
    def usd_per_step(self) -> float | None:
        return None if self.steps == 0 else self.cost_usd / self.steps

    @property
    def steps_per_hour(self) -> float:
        return self.steps / self.hours if self.hours > 0 else 0.0

    @property
    def deadline_met(self) -> bool | None:
        """Completed by the deadline (None: no deadline)."""
        if self.deadline_h is None:
            return None
        return self.completed_at_h is not None and self.completed_at_h <= self.deadline_h + 1e-9

    @property
    def goodput(self) -> float | None:
        done = self.steps + self.lost_steps
        return None if done == 0 else self.steps / done

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "hours": round(self.hours, 3), "steps": self.steps,
                "lost_steps": self.lost_steps, "cost_usd": round(self.cost_usd, 2),
                "usd_per_step": None if self.usd_per_step is None else round(self.usd_per_step, 5),
                "steps_per_hour": round(self.steps_per_hour, 1), "goodput": self.goodput,
                "node_hours": round(self.node_hours, 2), "restarts": self.restarts, "resizes": self.resizes,
                "completed_at_h": self.completed_at_h, "deadline_h": self.deadline_h,
                "deadline_met": self.deadline_met, "on_demand_node_hours": round(self.on_demand_node_hours, 2),
                "migrations": self.migrations, "migrations_failed": self.migrations_failed,
                "egress_usd": round(self.egress_usd, 2),
                "optimum_usd": None if self.optimum_usd is None else round(self.optimum_usd, 2),
                "domain_hours": {k: round(v, 3) for k, v in sorted(self.domain_hours.items())},
                "world_hours": {str(k): round(v, 3) for k, v in sorted(self.world_hours.items())},
                "timeline": [[round(h, 4), w, round(usd, 2), s] for h, w, usd, s in self.timeline]}


class Replay:
    """One policy through one trace (module docstring). ``target_nodes``: the pool's
    target (and max); ``min_nodes``: the fewest the job trains on; ``pass_s``: seconds
    between two reconcile passes when nothing happens (the daemon's default is 1 s; a
    pass per simulated minute changes no decision that matters at these time scales and
    keeps 45 days at about 65,000 passes).

    **Placement domains.** ``domains`` maps each zone to its placement domain (default:
    one domain for every zone, the job may span them all); the job trains in one domain
    at a time, starting in the first zone's. ``migration`` (None: never move) drives a
    whole-job move with the daemon's own decisions: :func:`daemon.control.migration.starved_since`
    and the policy's :meth:`~daemon.control.policies.RecoveryPolicy.migrate` pick when and
    where, :func:`~daemon.control.migration.ready_for_commit` when to drain the source; the
    job then commits, the checkpoint is copied at ``copy_bytes_s`` (its egress billed at
    ``egress_usd_per_gb`` of the source, USD per 10^9 bytes), and the job restarts in the
    target. The source's nodes are billed until the job has restarted there, as the
    daemon holds them."""

    def __init__(self, trace: Trace, policy: RecoveryPolicy, *, job: JobModel = JobModel(),
                 market: Market = Market(), target_nodes: int | None = None, min_nodes: int = 1,
                 pass_s: float = 60.0, seed: int = 0, zones: list[str] | None = None,
                 deadline_s: float | None = None, domains: dict[str, str] | None = None,
                 migration: mig.Plan | None = mig.Plan(), egress_usd_per_gb: float = 0.02,
                 copy_bytes_s: float = 0.5e9, probe_s: float | None = None,
                 availability: Availability | None = None, grow_in_process: bool = False) -> None:
        self.trace, self.policy, self.job, self.market = trace, policy, job, market
        self.zones = zones or sorted(trace.zones)
        self.domain_of = {z: (domains or {}).get(z, "all" if domains is None else z) for z in self.zones}
        self.domain_names = list(dict.fromkeys(self.domain_of[z] for z in self.zones))
        self.domain = self.domain_names[0]
        self.migration = migration
        self.egress_usd_per_gb, self.copy_bytes_s = egress_usd_per_gb, copy_bytes_s
        self.move: _Move | None = None
        self.starved: float | None = None
        self.last_move_end: float | None = None  # the last completed move's end
        self.failed_moves: dict[str, float] = {}  # target domain -> when a move there failed
        self.migrations = self.migrations_failed = 0
        self.egress = 0.0
        self.losses: list[tuple[float, str]] = []  # (time, domain) of each node the market took
        # what the daemon has seen of each domain's spot capacity (``availability``: a record
        # from before the window); ``probe_s``: every domain is also looked at this often, as a
        # capacity probe would (None: only what the pool's own launches and losses show)
        self.availability = availability or Availability()
        self.probe_s, self._probed_at = probe_s, -math.inf
        self.domain_hours: dict[str, float] = {}
        cap = target_nodes or trace.max_nodes or 1
        self.target = cap
        self.min_nodes = min_nodes
        self.pass_s = pass_s
        self.rng = random.Random(seed)
        # a spot and an on-demand offer per zone; the planner is given those the market and
        # the policy allow (Market.on_demand: on-demand only; RecoveryPolicy.markets)
        k = len(self.zones)
        self.all_offers = [Offer(index=i, provider="aws", region=self.domain_of[z], zone=z, instance_type="sim",
                                 gpus_per_node=market.gpus_per_node, on_demand=False,
                                 price_usd_h=self.trace.zones[z].price_at(0) or market.spot_usd_h)
                           for i, z in enumerate(self.zones)]
        self.all_offers += [Offer(index=k + i, provider="aws", region=self.domain_of[z], zone=z, instance_type="sim",
                                  gpus_per_node=market.gpus_per_node, on_demand=True,
                                  price_usd_h=market.on_demand_usd_h) for i, z in enumerate(self.zones)]
        self.deadline_s = deadline_s
        self.rules = Rules(min_nodes=min_nodes, valid_world_sizes=frozenset(range(1, cap * market.gpus_per_node + 1)),
                           rejoin_timeout_s=90.0, prewarm_wait_s=60.0, grow_in_process=grow_in_process)
        self.nodes: dict[str, _Node] = {}  # live nodes
        self.ended: dict[str, _Node] = {}
        self.seq = 0
        self.now = 0.0
        self.job_state = JobState.PENDING
        self.first_ready_at: float | None = None
        self.rejoin: a.RejoinView | None = None
        self.progress = 0.0  # steps trained in the current lineage (may be lost)
        self.committed = 0
        self.busy_until = 0.0  # the job trains from then (a commit, a restart)
        self.holding = False  # held at a rejoin commit until the grow ends
        self._in_job: set[str] = set()
        self.allowed: frozenset[str] | None = None  # the markets the policy allowed last pass
        self.lost = 0
        self.restarts = 0
        self.resizes = 0
        self.cost = 0.0
        self.node_hours = 0.0
        self.od_node_hours = 0.0
        self.backoff: dict[int, float] = {}
        self.failures: dict[int, int] = {}
        self.events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, node id)
        self.world_hours: dict[int, float] = {}
        self.timeline: list[tuple[float, int, float, int]] = []
        self.completed_at: float | None = None
        self._ev = 0

    # -- the loop ------------------------------------------------------------------------------
    def run(self, until_s: float | None = None) -> Result:
        end = min(until_s or self.trace.duration_s, self.trace.duration_s)
        changes = sorted({t for z in self.zones for t in self.trace.zones[z].changes()})
        ci = 0
        while self.now < end and self.completed_at is None:
            self._market_check()
            self._reconcile()
            nxt = min(self.now + self.pass_s, end)
            while ci < len(changes) and changes[ci] <= self.now:
                ci += 1
            if ci < len(changes):
                nxt = min(nxt, changes[ci] - self.job.lead_s if changes[ci] - self.job.lead_s > self.now
                          else changes[ci])
            if self.events:
                nxt = min(nxt, max(self.events[0][0], self.now))
            if self.busy_until > self.now:
                nxt = min(nxt, self.busy_until)
            nxt = max(nxt, self.now + 1e-6)
            self._advance(nxt)
            self._fire_events()
        return Result(policy=self.policy.name, hours=self.now / 3600,
                      steps=self.committed if self.completed_at else int(self.progress), lost_steps=self.lost,
                      cost_usd=self.cost, node_hours=self.node_hours, restarts=self.restarts, resizes=self.resizes,
                      completed_at_h=None if self.completed_at is None else self.completed_at / 3600,
                      world_hours=self.world_hours, timeline=self.timeline,
                      deadline_h=None if self.deadline_s is None else self.deadline_s / 3600,
                      on_demand_node_hours=self.od_node_hours, migrations=self.migrations,
                      migrations_failed=self.migrations_failed, egress_usd=self.egress,
                      domain_hours=self.domain_hours)

    # -- the daemon's decisions -------------------------------------------------------------------
    def state(self) -> a.PoolState:
        rj = self.rejoin
        return a.PoolState(nodes=tuple(n.view() for n in self.nodes.values()), job=self.job_state,
                           desired_nodes=0 if self.job_state.is_terminal() else self.target,
                           target_nodes=self.target, rejoin=rj, first_ready_at=self.first_ready_at,
                           domain=self.domain if len(self.domain_names) > 1 else "")

    def _probe(self) -> None:
        """Every domain's spot capacity as a probe would see it (``probe_s``): up while any
        of its zones has any."""
        if self.probe_s is None or self.now - self._probed_at < self.probe_s:
            return
        self._probed_at = self.now
        for d in self.domain_names:
            caps = [self.trace.zones[z].capacity_at(self.now) for z in self.zones if self.domain_of[z] == d]
            self.availability = self.availability.observe(d, any(c is None or c > 0 for c in caps), self.now)

    def _reconcile(self) -> None:
        self._probe()
        # the nodes in the job at the end of the last pass (the daemon takes them before it
        # observes the cloud): those the market took since are this pass's losses
        members = self._in_job | {n.id for n in self.nodes.values() if n.state in ADMITTED}
        self._after_loss(members)
        history = History(backoff_until=dict(self.backoff))
        allowed = None if self.market.on_demand else self.policy.markets(self.progress_now(), now=self.now,
                                                                         previous=self.allowed)
        self._migration_step(history)
        self.allowed = allowed
        for act in self.policy.market_actions(self.state(), allowed, now=self.now):
            self._apply(act)
        s = self.state()
        build = self.move.target if self.move is not None else self.domain
        if self.move is not None:
            allowed = narrow(allowed, self.move.markets)
        for act in plan(Desired(s.desired_nodes, self.rules.valid_world_sizes), s.nodes, self._offers(allowed, build),
                        history, now=self.now, timeouts=Timeouts(heartbeat_timeout_s=1e9, launch_timeout_s=1e9),
                        domain=build if len(self.domain_names) > 1 else None):
            self._apply(act)
        self._after_loss(members)
        grew: list[str] = []
        for act in self.policy.admit(self.state(), self.rules, now=self.now):
            self._apply(act)
            if isinstance(act, a.Admit) and act.reason != "job_start":
                grew.append(act.reason)
        if grew and self.job_state is JobState.RUNNING and set(grew) == {"join_running"}:
            # in-process (job.grow: in_process): the running group takes the joiners in at a
            # step boundary and one survivor sends them the state; nobody restarts
            self.resizes += 1
            self.busy_until = max(self.busy_until, self.now) + self.job.grow_s()
        elif grew and self.job_state is JobState.RUNNING:  # torchrun restarts the group with the new nodes
            # a rejoin resumes from the commit it asked for; an elastic join, or nodes starting
            # a job nobody is in, from the newest commit (what was trained since is lost)
            self._restart(lose="rejoin" not in grew)
        self._in_job = {n.id for n in self.nodes.values() if n.state in ADMITTED}

    def _offers(self, allowed: frozenset[str] | None, domain: str | None = None) -> list[Offer]:
        """The offers the planner may buy from now in ``domain`` (None: every domain): the
        market's, then the policy's markets (:func:`daemon.control.deadline.in_markets`)."""
        offers = [o for o in self.all_offers if domain is None or o.region == domain]
        if self.market.on_demand:
            return [o for o in offers if o.on_demand]
        if allowed is None:
            return [o for o in offers if not o.on_demand]
        return in_markets(offers, allowed)

    # -- whole-job migration, as daemon/controlnode/migrator.py carries it out ------------------------
    def _migration_step(self, history: History) -> None:
        if self.migration is None or len(self.domain_names) < 2 or self.market.on_demand:
            return
        m, now = self.move, self.now
        if m is None:
            self._maybe_move(history)
            return
        s = self.state()
        if m.phase is mig.Phase.BOOTING:
            if mig.ready_for_commit(s, m.target, valid_world_sizes=self.rules.valid_world_sizes,
                                    min_nodes=self.rules.min_nodes):
                self._drain_source(m)
            elif now - m.started_at > self.migration.boot_timeout_s or mig.target_out(
                    s, next(v for v in self._views(history, m.markets) if v.name == m.target), history, now=now):
                self._move_failed(m)
        elif m.phase is mig.Phase.COPYING and m.switch_at is not None and now >= m.switch_at:
            m.phase, self.domain = mig.Phase.STARTING, m.target  # the job's domain is the target now
            self.availability = self.availability.observe(m.source, None, now)  # left: no longer watched
            if self.job_state is JobState.RUNNING:
                self.job_state = JobState.PENDING
            self.first_ready_at = None
        elif (m.phase is mig.Phase.STARTING and self.job_state is JobState.RUNNING and self.busy_until <= now) \
                or self.job_state is JobState.COMPLETED:
            for n in [n for n in self.nodes.values() if n.domain == m.source]:
                self._end(n, NodeState.TERMINATED)  # released once the job trains in the target
            self.migrations += 1
            self.move, self.last_move_end, self.starved = None, now, None

    def _views(self, history: History, markets: frozenset[str] | None = None) -> list[mig.DomainView]:
        self.losses = [(t, d) for t, d in self.losses if self.now - t < 3600.0]
        allowed = narrow(self.allowed, markets)
        return [mig.DomainView(d, tuple(self._offers(allowed, d)), egress_usd_per_gb=self.egress_usd_per_gb,
                               preemptions=sum(1 for _, x in self.losses if x == d)) for d in self.domain_names]

    def _maybe_move(self, history: History) -> None:
        assert self.migration is not None
        s, views = self.state(), self._views(history)
        here = next(v for v in views if v.name == self.domain)
        self.starved = mig.starved_since(self.starved, s, here, history, now=self.now)
        gpus = max(1, sum(n.gpus for n in self.nodes.values() if n.state in ADMITTED and n.domain == self.domain))
        move = self.policy.migrate(s, views, self.domain, history, now=self.now, plan=self.migration,
                                   starved_since=self.starved, checkpoint_bytes=int(self.job.checkpoint_bytes),
                                   last_move_ended_at=self.last_move_end, gpus=gpus,
                                   failed_moves=self.failed_moves, progress=self.progress_now(),
                                   availability=self.availability)
        if move is not None:
            self.move = _Move(move.source, move.target, move.reason, self.now, markets=move.markets)

    def _drain_source(self, m: _Move) -> None:
        """Every node of the job in the source commits at one step boundary and stops (held,
        billed, until the move is done); the copy starts once the commit is in."""
        members = [n for n in self.nodes.values() if n.domain == m.source and n.state in ADMITTED]
        if members and self.job_state is JobState.RUNNING:
            self._commit_now()
        for n in self.nodes.values():
            if n.domain == m.source:
                n.held = True
                if n.state in ADMITTED:
                    n.state, n.trainer = NodeState.DRAINING, TrainerState.EXITED
        self._in_job -= {n.id for n in members}
        copy_s = 0.0
        if self.committed > 0:
            copy_s = self.job.checkpoint_bytes / self.copy_bytes_s
            self.egress += self.job.checkpoint_bytes / 1e9 * self.egress_usd_per_gb
            self.cost += self.job.checkpoint_bytes / 1e9 * self.egress_usd_per_gb
        self.progress = float(self.committed)  # nothing after the commit is computed
        m.phase, m.switch_at = mig.Phase.COPYING, max(self.busy_until, self.now) + copy_s
        self._schedule(m.switch_at, "switch", "")

    def _move_failed(self, m: _Move) -> None:
        """The target brought up no nodes in time: its nodes are released; the job stays."""
        for n in [n for n in self.nodes.values() if n.domain == m.target]:
            self._end(n, NodeState.TERMINATED)
        self.migrations_failed += 1
        self.failed_moves[m.target] = self.now
        self.availability = self.availability.observe(m.target, None, self.now)  # given up: no longer watched
        self.move = None

    def progress_now(self) -> Progress | None:
        """Where the job stands against its deadline (None: no deadline)."""
        if self.deadline_s is None:
            return None
        world = self.target * self.market.gpus_per_node
        # seconds per step as the daemon measures it: the periodic commits' pauses included
        step_s = self.job.step_time(world) + self.job.save_s(self.target) / max(1, self.job.checkpoint_every_steps)
        return Progress(step=int(self.progress), target_steps=self.job.target_steps, started_at=0.0,
                        deadline=self.deadline_s, step_s=step_s,
                        restart_s=self.job.boot_s + self.job.restart_s + self.job.load_s(self.target),
                        grows_in_process=self.rules.grow_in_process and self.target > 1)

    def _after_loss(self, members: set[str]) -> None:
        lost = lost_from_job(members, {n.id: n.state for n in self.nodes.values()})
        lost = [i for i in lost if not self._node(i).left_cleanly]
        if lost:
            for act in self.policy.after_loss(self.state(), lost, now=self.now):
                self._apply(act)

    # -- actions, as the daemon's actuators carry them out ------------------------------------------
    def _apply(self, act: a.Action) -> None:  # noqa: C901 - one branch per action type
        if isinstance(act, a.Launch):
            self._launch(act.offer_index)
        elif isinstance(act, (a.Terminate, a.MarkLost)):
            n = self.nodes.get(act.node_id)
            if n is not None and not n.state.is_terminal():
                final = act.final_state if isinstance(act, a.Terminate) else NodeState.LOST
                self._end(n, final)
        elif isinstance(act, a.Admit):
            n = self.nodes.get(act.node_id)
            if n is not None:
                n.state, n.trainer = NodeState.RUNNING, TrainerState.RUNNING
        elif isinstance(act, a.StartJob):
            self.job_state = JobState.RUNNING
            self._restart(lose=False)
        elif isinstance(act, a.RestartJob):
            self.job_state = JobState.PENDING
            self.first_ready_at = None
            self.lost += max(0, int(self.progress) - self.committed)
            self.progress = float(self.committed)
        elif isinstance(act, a.NoteFirstReady):
            self.first_ready_at = act.at
        elif isinstance(act, a.RequestRejoin):
            for i in act.nodes:
                if i in self.nodes:
                    self.nodes[i].state = NodeState.ADMITTING
            self._commit_now()  # the running nodes commit at the next step boundary and hold
            self.holding = True
            self.rejoin = a.RejoinView(f"rejoin-{self.now:.0f}", frozenset(act.nodes), self.now, answered=True)
        elif isinstance(act, a.EndRejoin):
            for i in act.back_to_ready:
                n = self.nodes.get(i)
                if n is not None and n.state is NodeState.ADMITTING:
                    n.state = NodeState.READY
            self.rejoin = None
            self.holding = False
        elif isinstance(act, a.MarkReplacing):
            n = self.nodes.get(act.node_id)
            if n is not None:
                n.replacing = True
        elif isinstance(act, a.Drain):
            n = self.nodes.get(act.node_id)
            if n is not None:
                self._leave(n)  # it commits at the step boundary and leaves; nothing is lost
        elif isinstance(act, a.Leave):
            n = self.nodes.get(act.node_id)
            if n is not None:
                n.state = NodeState.DRAINING
        # AvoidZone, WatchFlush, RequestCheckpoint, MarkReplacing: no effect on this model

    def _launch(self, offer: int) -> None:
        o = self.all_offers[offer]
        self.seq += 1
        nid = f"n{self.seq}"
        held = sum(1 for n in self.nodes.values() if n.zone == o.zone and n.state in LIVE)
        cap = None if o.on_demand else self.trace.zones[o.zone].capacity_at(self.now)
        if cap is not None and held >= cap:
            self.failures[offer] = self.failures.get(offer, 0) + 1
            self.backoff[offer] = self.now + capacity_backoff_s(self.failures[offer], self.rng)
            self.availability = self.availability.observe(o.region, False, self.now)
            return
        self.failures.pop(offer, None)
        if not o.on_demand:
            self.availability = self.availability.observe(o.region, True, self.now)
        n = _Node(nid, o.zone, offer, self.seq, self.now, o.gpus_per_node, o.on_demand, domain=o.region)
        self.nodes[nid] = n
        self._schedule(self.now + self.job.boot_s, "ready", nid)

    def _end(self, n: _Node, final: NodeState) -> None:
        n.state, n.ended_at = final, self.now
        n.trainer = TrainerState.EXITED if n.trainer is TrainerState.RUNNING else n.trainer
        # out of the live table (every pass builds a view of each node there); lost_from_job
        # counts a node it no longer finds as ended
        self.ended[n.id] = self.nodes.pop(n.id)

    def _members(self) -> list[_Node]:
        return [n for n in self.nodes.values() if n.state in ADMITTED or (n.state is NodeState.DRAINING
                                                                            and n.trainer is TrainerState.RUNNING)]

    def _node(self, nid: str) -> _Node:
        return self.nodes.get(nid) or self.ended[nid]

    # -- the job -----------------------------------------------------------------------------------
    def _world(self) -> int:
        return sum(n.gpus for n in self.nodes.values() if training(n.view()))

    def _commit_now(self) -> None:
        """A commit at the step boundary: the job holds for the upload."""
        nodes = max(1, len([n for n in self.nodes.values() if training(n.view())]))
        self.committed = int(self.progress)
        self.busy_until = max(self.busy_until, self.now) + self.job.save_s(nodes)

    def _restart(self, *, lose: bool) -> None:
        """The worker group restarts: from the newest commit (what was trained since is lost
        when ``lose``), paying the restart and the load."""
        if lose:
            self.lost += max(0, int(self.progress) - self.committed)
        self.progress = float(self.committed)
        self.restarts += 1
        nodes = max(1, len(self._members()))
        self.busy_until = max(self.busy_until, self.now) + self.job.restart_s + self.job.load_s(nodes)

    def _advance(self, to: float) -> None:
        dt = to - self.now
        held = [n for n in self.nodes.values() if not n.state.is_terminal()]
        for n in held:
            price = self.market.on_demand_usd_h if n.on_demand else (
                self.trace.zones[n.zone].price_at(self.now) or self.market.spot_usd_h)
            self.cost += price * dt / 3600
        self.node_hours += len(held) * dt / 3600
        self.od_node_hours += sum(1 for n in held if n.on_demand) * dt / 3600
        world = self._world()
        self.world_hours[world] = self.world_hours.get(world, 0.0) + dt / 3600
        self.domain_hours[self.domain] = self.domain_hours.get(self.domain, 0.0) + dt / 3600
        if self.job_state is JobState.RUNNING and world > 0 and not self.holding:
            start = max(self.now, self.busy_until)
            if to > start:
                before = self.progress
                self.progress += (to - start) / self.job.step_time(world)
                every = self.job.checkpoint_every_steps
                if int(self.progress) // every > int(before) // every:  # a periodic commit
                    self.committed = int(self.progress) // every * every
                    nodes = len([n for n in self.nodes.values() if training(n.view())])
                    self.busy_until = to + self.job.save_s(nodes)
                if self.progress >= self.job.target_steps:
                    self.progress = float(self.job.target_steps)
                    self.committed = self.job.target_steps
                    self.job_state = JobState.COMPLETED
                    self.completed_at = to
        self.now = to
        if not self.timeline or self.now - self.timeline[-1][0] * 3600 >= max(60.0, self.trace.duration_s / 400):
            self.timeline.append((self.now / 3600, world, self.cost, int(self.progress)))

    # -- the market ----------------------------------------------------------------------------------
    def _market_check(self) -> None:
        """Notices for the nodes the trace takes within ``lead_s``; the take itself at its time."""
        for zone in self.zones:
            series = self.trace.zones[zone]
            soon = series.capacity_at(self.now + self.job.lead_s)
            if soon is None:
                continue
            held = sorted((n for n in self.nodes.values() if n.zone == zone and n.state in LIVE
                           and not n.on_demand and n.taken_at is None), key=lambda n: -n.ordinal)
            for n in held[: max(0, len(held) - soon)]:
                n.taken_at = self.now + self.job.lead_s
                n.deadline = n.taken_at
                self._schedule(n.taken_at, "taken", n.id)
                if n.state in (NodeState.READY, NodeState.ADMITTING, NodeState.RUNNING):
                    self._notice(n)

    def _notice(self, n: _Node) -> None:
        n.noticed = True
        if not self.policy.acts_on_notices:
            return
        was_training = n.trainer is TrainerState.RUNNING and n.state in ADMITTED
        for act in on_notice(n.view(), notice_id=f"{n.id}:notice", deadline=n.deadline, lead_s=self.job.lead_s,
                             now=self.now):
            self._apply(act)
        if was_training:
            self._leave(n)

    def _leave(self, n: _Node) -> None:
        """Every rank commits at the next step boundary and ``n`` leaves; the survivors go on
        in their processes; ``n`` is released at once (drained), as the daemon does."""
        if n.trainer is TrainerState.RUNNING:
            self._commit_now()
        n.trainer, n.left_cleanly = TrainerState.EXITED, True
        if self._world() > 0:
            self.resizes += 1
            self.busy_until += self.job.resize_s
        self._end(n, NodeState.TERMINATED)

    def _schedule(self, t: float, kind: str, node: str) -> None:
        self._ev += 1
        heapq.heappush(self.events, (t, self._ev, kind, node))

    def _fire_events(self) -> None:
        while self.events and self.events[0][0] <= self.now + 1e-9:
            _, _, kind, nid = heapq.heappop(self.events)
            n = self.nodes.get(nid)
            if n is None:
                continue
            if kind == "ready" and n.state is NodeState.LAUNCHING:
                n.state, n.ready_at = NodeState.READY, self.now
                if n.taken_at is not None:
                    self._notice(n)
            elif kind == "taken" and not n.state.is_terminal():
                self.losses.append((self.now, n.domain))
                if not n.on_demand:
                    self.availability = self.availability.observe(n.domain, False, self.now)
                in_job = n.state in ADMITTED or n.trainer is TrainerState.RUNNING
                self._end(n, NodeState.LOST if not n.noticed else NodeState.TERMINATED)
                if in_job and not self.policy.acts_on_notices and self.policy.name != "restart_on_preemption":
                    if self._world() > 0:
                        self._restart(lose=True)  # torchrun re-forms the group from the last commit
                    else:
                        self.lost += max(0, int(self.progress) - self.committed)
                        self.progress = float(self.committed)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
