"""The offline optimum: the cheapest schedule with the whole future known.

**One instance** (:func:`optimum`): a dynamic program over (tick, mode, overhead ticks
left, progress ticks) on a :class:`~bench.replay.tickmodel.TickMarket`, as the SkyNomad
artifact's Optimal is (``sky_spot/strategies/multi_region_oracle_dp.py``, andylizf/
skynomad-artifact @ 4dc5ecb; the code here is ours). The modes: nothing held yet; nothing
held with the checkpoint in zone z; spot in z; on-demand in z. A tick held costs its
price (USD); a launch starts ``overhead`` ticks without progress; a move pays the
egress (USD) from the checkpoint's zone. Progress is counted in whole ticks.

Two roundings of the overhead, both exact in the charging of every tick:

- ``bound=True`` (the default): ``floor(overhead / gap)`` ticks without progress and
  the partial tick after them credited whole. Every schedule of
  :func:`~bench.replay.tickmodel.simulate` makes at most this progress each tick, so
  the value is a **lower bound** on what any policy pays there (the property tests
  check it): the ``optimum`` of ``cost / optimum``.
- ``bound=False``: ``ceil(overhead / gap)`` ticks without progress. Every schedule it
  returns finishes in :func:`~bench.replay.tickmodel.simulate` (which credits the
  partial tick): the plan the ``optimal`` row executes.

numpy over (overhead, progress) for each of the ``1 + 3 × zones`` modes: a 60-hour
window of three zones at 195 s ticks takes about a second.

**A pool** (:func:`pool_bound`): the linear relaxation of a pool's cost to a deadline,
without restarts: node-seconds of work bought cheapest first, spot up to each zone's
capacity (and the pool's size) at each moment, on-demand for the rest. A lower bound
on any policy's cost in :mod:`bench.replay.sim` for the same work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.replay.tickmodel import (OD, SPOT, Mode, OnDemand, PlanPolicy, TickJob, TickMarket, TickResult, simulate,
                                    ticks_for)
from bench.replay.traces import Trace

__all__ = ["Optimum", "optimum", "optimal", "pool_bound"]


@dataclass
class Optimum:
    """The DP's answer: ``cost_usd`` (inf when no schedule meets the deadline), and the
    schedule, the mode held during each tick until the work is done (None: nothing)."""

    cost_usd: float
    plan: list[Mode | None]

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.cost_usd)


def optimum(market: TickMarket, job: TickJob, *, bound: bool = True, held: Mode | None = None,
            overhead_left_s: float = 0.0, leader: int | None = None) -> Optimum:
    """The cheapest schedule of one instance on ``market`` for ``job`` (module docstring),
    from nothing held, or (re-planning part way) from ``held`` with ``overhead_left_s``
    seconds of its restart still to run, or from nothing held with the checkpoint in zone
    ``leader`` (a move from there pays the egress)."""
    g = market.gap_s
    Z, T = len(market.zones), ticks_for(job, g)
    K = max(1, int(math.ceil(job.task_s / g - 1e-9)))
    rnd = (lambda x: int(math.floor(x / g + 1e-9))) if bound else (lambda x: int(math.ceil(x / g - 1e-9)))
    transfer, egress = market.transfer(job), market.egress(job)
    # modes: 0 start; 1+z waiting with the checkpoint in z; 1+Z+z on-demand in z; 1+2Z+z spot in z
    M = 1 + 3 * Z
    zone = np.array([-1] + list(range(Z)) * 3)
    active = np.array([False] * (1 + Z) + [True] * (2 * Z))
    # launch overhead (ticks) and egress (USD) from mode i into active mode j
    H = np.zeros((M, M), dtype=int)
    E = np.zeros((M, M))
    for i in range(M):
        for j in range(M):
            if not active[j]:
                continue
            src = zone[i]
            extra = transfer[src, zone[j]] if src >= 0 and src != zone[j] else 0.0
            H[i, j] = rnd(job.overhead_s + extra)
            E[i, j] = egress[src, zone[j]] if src >= 0 else 0.0
    if held is not None:
        m0 = 1 + (Z if held.kind == OD else 2 * Z) + held.zone
        h0 = rnd(overhead_left_s)
    else:
        m0, h0 = (0, 0) if leader is None else (1 + leader, 0)
    Hn = max(int(H.max()), h0) + 1
    Tm = min(T, market.ticks)  # past the market's end, no spot
    price = np.zeros((M, max(T, 1)))
    price[1 + Z:1 + 2 * Z, :] = market.on_demand_usd_h * g / 3600
    price[1 + 2 * Z:, :Tm] = market.price[:, :Tm] * g / 3600
    ok = np.ones((M, max(T, 1)), dtype=bool)
    ok[1 + 2 * Z:, :] = False
    ok[1 + 2 * Z:, :Tm] = market.avail[:, :Tm]

    # the sources of each mode j, grouped by the overhead a switch from them starts
    groups: list[list[tuple[int, np.ndarray]]] = []
    for j in range(M):
        if active[j]:
            src = [i for i in range(M) if i != j]
        elif j == 0:
            src = []
        else:  # waiting in z: after dropping (or losing) the instance held in z
            src = [1 + Z + zone[j], 1 + 2 * Z + zone[j]]
        hs = sorted({int(H[i, j]) for i in src})
        groups.append([(hv, np.array([i for i in src if H[i, j] == hv], dtype=int)) for hv in hs])
    idle_code = (np.flatnonzero(~active) * Hn)
    stay_code = np.arange(M)[:, None] * Hn + np.arange(Hn)[None, :]

    inf = math.inf
    cur = np.full((M, Hn, K + 1), inf)
    cur[m0, h0, 0] = 0.0
    # parent code per tick: source mode × Hn + source overhead (uint8 when it fits)
    dtype = np.uint8 if M * Hn < 256 else np.uint16
    parents: list[np.ndarray] = []
    best, best_t, best_state = inf, -1, (0, 0)
    for t in range(T):
        new = np.full_like(cur, inf)
        par = np.zeros(cur.shape, dtype=dtype)

        def relax(j: int, h: int, vals: np.ndarray, code, lo: int = 0) -> None:
            # new[j, h, lo:] <- vals[: K + 1 - lo] where smaller
            tgt = new[j, h, lo:]
            v = vals[: K + 1 - lo]
            m = v < tgt
            if m.any():
                tgt[m] = v[m]
                pv = par[j, h, lo:]
                pv[m] = code[: K + 1 - lo][m] if isinstance(code, np.ndarray) else code

        # stay: waiting costs nothing; a held instance runs down its overhead, then progresses
        stay = active & ok[:, t]
        idle = ~active
        new[idle, 0] = cur[idle, 0]
        par[idle, 0] = idle_code[:, None]
        if Hn > 1:
            new[stay, :-1] = cur[stay, 1:] + price[stay, t][:, None, None]
            par[stay, :-1] = stay_code[stay, 1:, None]
        for m in np.flatnonzero(stay):
            relax(m, 0, cur[m, 0] + price[m, t], m * Hn, lo=1)  # progress: k -> k + 1
        # switch: from any overhead of mode i, cheapest source first for each overhead
        low = cur.min(axis=1)
        arg = cur.argmin(axis=1)
        live = np.isfinite(low).any(axis=1)
        for j in range(1, M):
            if active[j] and not ok[j, t]:
                continue
            cand = low + E[:, j, None] + price[j, t]
            for hv, rows in groups[j]:
                rows = rows[live[rows]]
                if rows.size == 0:
                    continue
                c = cand[rows]
                r = c.argmin(axis=0)
                cols = np.arange(K + 1)
                vals = c[r, cols]
                src = rows[r]
                code = (src * Hn + arg[src, cols]).astype(dtype)
                if not active[j]:
                    relax(j, 0, vals, code)
                elif hv == 0:
                    relax(j, 0, vals, code, lo=1)
                else:
                    relax(j, hv - 1, vals, code)
        parents.append(par)
        fin = new[:, :, K]
        i = int(fin.argmin())
        if fin.flat[i] < best:
            best, best_t, best_state = float(fin.flat[i]), t, divmod(i, Hn)
        new[:, :, K] = inf  # done: nothing more is bought
        cur = new
    if best_t < 0:
        return Optimum(inf, [])
    # walk back from the cheapest finished state
    plan: list[Mode | None] = []
    m, h = best_state
    k = K
    for t in range(best_t, -1, -1):
        plan.append(_mode(m, Z))
        code = int(parents[t][m, h, k])
        pm, ph = divmod(code, Hn)
        if active[m] and ((pm == m and ph == 0) or (pm != m and H[pm, m] == 0)):
            k -= 1
        m, h = pm, ph
    plan.reverse()
    return Optimum(best, plan)


def _mode(m: int, Z: int) -> Mode | None:
    if m <= Z:
        return None
    return Mode(OD, m - 1 - Z) if m <= 2 * Z else Mode(SPOT, m - 1 - 2 * Z)


def pool_bound(trace: Trace, zones: list[str], *, target: int, node_s: float, deadline_s: float,
               on_demand_usd_h: float, spot_usd_h: float) -> float:
    """USD: the least a pool of at most ``target`` nodes pays for ``node_s`` node-seconds of
    work by ``deadline_s`` (the linear relaxation, module docstring); inf if even
    ``target`` on-demand nodes from the start cannot do it."""
    if node_s > target * deadline_s + 1e-6:
        return math.inf
    cuts = sorted({0.0, deadline_s} | {t for z in zones for t in trace.zones[z].times if 0 < t < deadline_s})
    slots: list[tuple[float, float]] = []  # (USD/h, node-seconds)
    for a, b in zip(cuts, cuts[1:]):
        offers = []
        for z in zones:
            s = trace.zones[z]
            cap = s.capacity_at(a)
            n = target if cap is None else min(cap, target)
            if n > 0:
                offers.append((min(s.price_at(a) or spot_usd_h, on_demand_usd_h), n))
        room = target
        for p, n in sorted(offers):
            take = min(n, room)
            if take <= 0:
                break
            slots.append((p, take * (b - a)))
            room -= take
    cost, need = 0.0, node_s
    spot_s = 0.0
    for p, s in sorted(slots):
        take = min(s, need)
        cost += p * take / 3600
        need -= take
        spot_s += take
        if need <= 0:
            return cost
    return cost + on_demand_usd_h * need / 3600


def optimal(market: TickMarket, job: TickJob) -> TickResult:
    """The ``optimal`` row: the schedule of ``optimum(bound=False)`` carried out by
    :func:`~bench.replay.tickmodel.simulate` (which finishes it, the partial ticks being
    credited); on-demand from the start where that is cheaper or the DP finds no schedule
    (a deadline on-demand meets is then met)."""
    od = simulate(market, job, OnDemand(), safety_net=False)
    best = optimum(market, job, bound=False)
    if not best.feasible:
        od.policy = "optimal"
        return od
    r = simulate(market, job, PlanPolicy(best.plan, name="optimal"))
    if not r.done or (od.done and od.cost_usd < r.cost_usd):
        od.policy = "optimal"
        return od
    return r
