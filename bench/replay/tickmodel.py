"""SkyNomad's cost model: one instance at a time, whole ticks, charged as its simulator does.

The facts below are read from the SkyNomad artifact (andylizf/skynomad-artifact @ 4dc5ecb,
Apache-2.0): ``sky_spot/env.py`` (``MultiTraceEnv``: billing, progress, preemption, the
safety net), ``sky_spot/migration_model.py`` (transfer time and egress),
``sky_spot/simulate.py`` (the order of one tick) and
``scripts_multi/benchmark_components/configs/v100.py`` (the V100 setting). The code here
is ours; it models what those files document:

- time advances in ticks of the trace's row spacing (195 s in the V100 data); at most
  one instance is held, spot in a zone or on-demand in a zone;
- every tick an instance is held after the tick's decisions is billed whole, at that
  tick's spot price of its zone (USD/h, the trace's per-row price) or at the on-demand
  price ($3.06/h for a p3.2xlarge);
- a launch costs ``overhead_s`` (0.2 h) of restart, billed and without progress, plus,
  when the checkpoint is in another region, the extra transfer time (50 GB: about 8 s
  between US regions) and the egress (USD per GB: 0 within a region, 0.01 between
  us-east-1 and us-east-2, 0.02 between other US regions);
- a tick with the instance up credits ``gap - overhead left`` seconds of progress (the
  overhead is consumed first); a preemption (the zone unavailable at the next tick)
  loses no progress, only the next launch's overhead;
- the job is done when the credited progress reaches ``task_s``; it fails if it is not
  done after ``floor(deadline / gap)`` ticks;
- a non-oracle policy runs under the simulator's safety net: once the whole ticks left
  are no more than ``ceil((work left + overhead) / gap)`` ticks, it is latched to
  on-demand (in the zone held, else the cheapest) to the end.

Pure: no clock, no I/O; a market is numpy arrays. :func:`simulate` runs a
:class:`TickPolicy`; :class:`UniformProgress` is the artifact's UP(S) baseline;
:mod:`bench.replay.optimum` holds the offline optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from bench.replay.sim import region_of
from bench.replay.traces import Trace

__all__ = ["TickMarket", "TickJob", "Mode", "TickView", "TickPolicy", "TickResult", "simulate",
           "UniformProgress", "OnDemand", "PlanPolicy", "egress_usd_per_gb", "transfer_s"]

SPOT, OD = "spot", "od"


@dataclass(frozen=True)
class Mode:
    """What is held: ``kind`` ``"spot"`` or ``"od"`` in zone index ``zone``."""

    kind: str
    zone: int


def egress_usd_per_gb(src: str, dst: str) -> float:
    """USD per GB to copy a checkpoint from zone ``src`` to zone ``dst`` (AWS S3 to S3, as
    the artifact's ``sky_spot/migration_model.py`` prices it for US regions: 0 within a
    region, 0.01 between us-east-1 and us-east-2, 0.02 between other regions)."""
    a, b = region_of(src), region_of(dst)
    if a == b:
        return 0.0
    if {a, b} == {"us-east-1", "us-east-2"}:
        return 0.01
    return 0.02


def transfer_s(src: str, dst: str, gb: float) -> float:
    """Seconds a move adds to the restart overhead: 0 within a region; between regions the
    copy at 8.2 Gb/s less the same copy at 9.72 Gb/s (the in-region load the overhead
    already counts; ``migration_model.py``'s S3 measurements; 1 GB = 8 × 1024 Mb there).
    Between continents (the first dash-separated word differs) 3.59 Gb/s."""
    a, b = region_of(src), region_of(dst)
    if a == b:
        return 0.0
    mbits = gb * 8 * 1024
    speed = 8200.0 if a.split("-")[0] == b.split("-")[0] else 3590.0
    return max(0.0, mbits / speed - mbits / 9720.0)


@dataclass(frozen=True)
class TickMarket:
    """Zones' spot availability ``avail[z, t]`` (bool) and price ``price[z, t]`` (USD/h)
    per tick of ``gap_s`` seconds; on-demand at ``on_demand_usd_h`` in every zone."""

    zones: tuple[str, ...]
    avail: np.ndarray
    price: np.ndarray
    gap_s: float
    on_demand_usd_h: float = 3.06

    @property
    def ticks(self) -> int:
        return int(self.avail.shape[1])

    @classmethod
    def from_trace(cls, trace: Trace, zones: Sequence[str], start: int, ticks: int, *, gap_s: float,
                   on_demand_usd_h: float = 3.06, spot_usd_h: float = 0.918) -> TickMarket:
        """Rows ``start`` .. ``start + ticks`` of a ``zones`` trace (one row per tick): a row
        with capacity None (available) or > 0 is available; rows past the end are not."""
        avail = np.zeros((len(zones), ticks), dtype=bool)
        price = np.full((len(zones), ticks), spot_usd_h, dtype=float)
        for i, z in enumerate(zones):
            s = trace.zones[z]
            n = max(0, min(ticks, len(s.capacity) - start))
            avail[i, :n] = [c is None or c > 0 for c in s.capacity[start:start + n]]
            if s.price is not None:
                price[i, :n] = s.price[start:start + n]
        return cls(tuple(zones), avail, price, gap_s, on_demand_usd_h)

    def egress(self, job: TickJob) -> np.ndarray:
        """USD of moving the job's checkpoint from zone i to zone j, ``[i, j]``: the
        artifact's table, or ``job.egress_usd_per_gb`` between regions."""
        def per_gb(a: str, b: str) -> float:
            if job.egress_usd_per_gb is None or region_of(a) == region_of(b):
                return egress_usd_per_gb(a, b)
            return job.egress_usd_per_gb
        return np.array([[job.checkpoint_gb * per_gb(a, b) for b in self.zones] for a in self.zones])

    def transfer(self, job: TickJob) -> np.ndarray:
        """Seconds a move adds to the overhead, ``[i, j]``: the artifact's, or the copy at
        ``job.copy_gb_s`` between regions."""
        def extra(a: str, b: str) -> float:
            if job.copy_gb_s is None or region_of(a) == region_of(b):
                return transfer_s(a, b, job.checkpoint_gb)
            return job.checkpoint_gb / job.copy_gb_s
        return np.array([[extra(a, b) for b in self.zones] for a in self.zones])


@dataclass(frozen=True)
class TickJob:
    """The task (seconds of work), its deadline (seconds from the start), the restart
    overhead (seconds, billed without progress) and the checkpoint (GB, what a move copies).
    A move between regions adds the artifact's transfer time and egress, unless
    ``copy_gb_s`` (GB/s of the copy) and ``egress_usd_per_gb`` (USD/GB) say otherwise
    (our cost model: :mod:`bench.replay.sim`'s copy and egress)."""

    task_s: float
    deadline_s: float
    overhead_s: float = 720.0
    checkpoint_gb: float = 50.0
    copy_gb_s: float | None = None
    egress_usd_per_gb: float | None = None


@dataclass(frozen=True)
class TickView:
    """What a policy sees at the start of tick ``tick`` (after the last tick's progress and
    this tick's preemption). Seconds; prices USD/h."""

    tick: int
    gap_s: float
    done_s: float
    job: TickJob
    held: Mode | None
    overhead_left_s: float  # of the instance held (0: none held)
    avail: np.ndarray  # [zone] this tick
    price: np.ndarray  # [zone] this tick, spot
    leader: int | None  # the zone the checkpoint is in (the last that made progress)
    last_held: int | None  # the zone of the instance last seen held at a decision
    zones: tuple[str, ...]

    @property
    def elapsed_s(self) -> float:
        return self.tick * self.gap_s


class TickPolicy(Protocol):
    name: str
    oracle: bool  # bypasses the safety net (the offline optimum)

    def decide(self, v: TickView) -> Mode | None: ...


@dataclass
class TickResult:
    """One policy on one market: USD (compute and egress), whether done by the deadline."""

    policy: str
    cost_usd: float
    egress_usd: float
    done: bool
    done_tick: int | None
    migrations: int
    launches: int
    od_ticks: int
    spot_ticks: int
    modes: list[Mode | None] = field(default_factory=list, repr=False)  # held during each tick

    @property
    def deadline_met(self) -> bool:
        return self.done


def ticks_for(job: TickJob, gap_s: float) -> int:
    """The ticks a job may use: it fails if not done once ``tick × gap >= deadline``."""
    return int(math.ceil(job.deadline_s / gap_s - 1e-9))


def _latched(v: TickView, overhead_s: float) -> bool:
    left = math.floor((v.job.deadline_s - v.elapsed_s) / v.gap_s + 1e-9) * v.gap_s
    need = math.ceil((v.job.task_s - v.done_s + overhead_s) / v.gap_s - 1e-9) * v.gap_s
    return need >= left


def _extended(market: TickMarket, ticks: int) -> TickMarket:
    """``market`` to ``ticks`` ticks: no spot after its end (its last prices)."""
    n = ticks - market.ticks
    avail = np.concatenate([market.avail, np.zeros((len(market.zones), n), dtype=bool)], axis=1)
    last = market.price[:, -1:] if market.ticks else np.zeros((len(market.zones), 1))
    price = np.concatenate([market.price, np.repeat(last, n, axis=1)], axis=1)
    return TickMarket(market.zones, avail, price, market.gap_s, market.on_demand_usd_h)


def simulate(market: TickMarket, job: TickJob, policy: TickPolicy, *, safety_net: bool = True) -> TickResult:
    """``policy`` on ``market`` under the artifact's charging (module docstring)."""
    g, T = market.gap_s, ticks_for(job, market.gap_s)
    egress, transfer = market.egress(job), market.transfer(job)
    held: Mode | None = None
    oh = 0.0
    done = 0.0
    leader: int | None = None
    last_held: int | None = None
    cost = egress_total = 0.0
    migrations = launches = od_ticks = spot_ticks = 0
    latched = False
    modes: list[Mode | None] = []
    for t in range(T + 1):
        if t > 0 and held is not None:  # the last tick's progress
            p = min(max(g - oh, 0.0), job.task_s - done)
            oh = max(oh - g, 0.0)
            done += p
            leader = held.zone
        if job.task_s - done <= 1e-3:
            return TickResult(policy.name, cost, egress_total, True, t, migrations, launches, od_ticks, spot_ticks,
                              modes)
        if t == T:
            break
        if t >= market.ticks:  # past the market's end: no spot, on-demand only
            market = _extended(market, T)
        if held is not None and held.kind == SPOT and not market.avail[held.zone, t]:
            held, oh = None, 0.0  # preempted: nothing lost but the next launch's overhead
        if held is not None:
            last_held = held.zone
        v = TickView(t, g, done, job, held, oh, market.avail[:, t], market.price[:, t], leader, last_held,
                     market.zones)
        if safety_net and not policy.oracle and (latched or _latched(v, job.overhead_s)):
            latched = True
            if held is None or held.kind != OD:
                z = held.zone if held is not None else (leader if leader is not None else 0)
                want: Mode | None = Mode(OD, z)
            else:
                want = held
        else:
            want = policy.decide(v)
        if want != held:
            if want is not None:
                if want.kind == SPOT and not market.avail[want.zone, t]:
                    raise ValueError(f"{policy.name}: spot in {market.zones[want.zone]} is not available at tick {t}")
                launches += 1
                oh = job.overhead_s
                if leader is not None and leader != want.zone:
                    oh += transfer[leader, want.zone]
                    egress_total += egress[leader, want.zone]
                    cost += egress[leader, want.zone]
                    migrations += 1
            held = want
        if held is not None:
            usd_h = market.price[held.zone, t] if held.kind == SPOT else market.on_demand_usd_h
            cost += usd_h * g / 3600
            od_ticks += held.kind == OD
            spot_ticks += held.kind == SPOT
        modes.append(held)
    return TickResult(policy.name, cost, egress_total, False, None, migrations, launches, od_ticks, spot_ticks, modes)


class OnDemand:
    """On-demand in the first zone from the start (the reference a spot policy must beat)."""

    name, oracle = "on_demand", False

    def decide(self, v: TickView) -> Mode | None:
        return Mode(OD, 0)


@dataclass
class PlanPolicy:
    """A fixed schedule (a mode per tick, e.g. the offline optimum's); past its end, or
    where the plan holds nothing but work is left, it holds what it held last (on-demand
    when that is spot and unavailable). ``oracle``: no safety net."""

    plan: Sequence[Mode | None]
    name: str = "optimal"
    oracle: bool = True

    def decide(self, v: TickView) -> Mode | None:
        if v.tick < len(self.plan):
            m = self.plan[v.tick]
            if m is None or m.kind == OD or v.avail[m.zone]:
                return m
            return Mode(OD, m.zone)
        m = v.held or (self.plan[-1] if self.plan else None) or Mode(OD, v.leader or 0)
        return m if m.kind == OD or v.avail[m.zone] else Mode(OD, m.zone)


class UniformProgress:
    """The artifact's UP(S) baseline (``multi_region_rc_cr_threshold_eager_failover``,
    on ``multi_region_rc_cr_threshold``, Can't Be Late's Uniform Progress applied to
    zones), written here from what those files document:

    - behind the uniform line (work done < elapsed × task / deadline) it wants an
      instance, spot when any zone has one, else on-demand; ahead of it, spot or nothing;
    - once on-demand it stays there until it is ahead of the line by two overheads;
    - two overheads from the point of no return it will not leave on-demand (nor wait);
      one overhead from it, it keeps a spot instance that has finished its restart and
      takes on-demand otherwise;
    - spot is tried zone by zone, cheapest first (this tick's prices), the region it was
      last in moved to the end (eager failover); on-demand is bought where it was last.
    """

    name, oracle = "up_s", False

    def _want(self, v: TickView, cur: str | None, has_spot: bool) -> tuple[str | None, bool]:
        j, g, d = v.job, v.gap_s, v.job.overhead_s
        t, done = v.elapsed_s, v.done_s
        rate = j.task_s / j.deadline_s
        left_s = math.floor((j.deadline_s - t) / g + 1e-9) * g
        work = j.task_s - done
        want: str | None = SPOT if has_spot else None
        if done - t * rate < 0:
            want = SPOT if has_spot else OD
        ahead2 = (t + 2 * d) * rate - done  # < 0: ahead of the line by two overheads
        if cur == OD and (not has_spot or ahead2 >= 0):
            want = OD
        if math.ceil((work + 2 * d) / g - 1e-9) * g > left_s and cur in (None, OD):
            want = OD
        if math.ceil((work + d) / g - 1e-9) * g >= left_s:
            want = SPOT if cur == SPOT and v.overhead_left_s < 1e-3 else OD
        back = False
        if cur == OD and has_spot and want == OD and ahead2 < 0:
            want, back = SPOT, True
        return want, back

    def _order(self, v: TickView) -> list[int]:
        order = sorted(range(len(v.zones)), key=lambda z: float(v.price[z]))
        if v.last_held is None:
            return order
        r = region_of(v.zones[v.last_held])
        return [z for z in order if region_of(v.zones[z]) != r] + [z for z in order if region_of(v.zones[z]) == r]

    def decide(self, v: TickView) -> Mode | None:
        cur = v.held.kind if v.held else None
        want, back = self._want(v, cur, True)
        if v.held is not None and want == cur:
            return v.held
        if want is None:
            return None
        od_zone = v.held.zone if v.held else (v.leader if v.leader is not None else 0)
        if want == OD:
            return Mode(OD, od_zone)
        for z in self._order(v):
            if v.avail[z]:
                return Mode(SPOT, z)
        if back:
            return None
        again, _ = self._want(v, None, False)
        return Mode(OD, od_zone) if again == OD else None
