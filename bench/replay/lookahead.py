"""A policy that looks ahead: model-predictive control with the offline optimum's DP.

:class:`LookAhead` runs in the tick model (:mod:`bench.replay.tickmodel`). At a
decision it samples futures of every zone's availability from what it has seen (the
trace's past before the window, and the window so far), solves the optimum's DP
(:func:`bench.replay.optimum.optimum`) from where the job stands on each future, and
takes the first step most of the futures agree on; it follows that plan until reality
departs from it (the instance is lost, the zone the plan wants is not available, or a
zone comes back while it waits) or ``every`` ticks pass, and then plans again. The
simulator's safety net keeps the deadline.

A future of a zone is its runs of availability: the run it is in continues for a
length drawn from the past runs of that state at least as long as the current one,
then runs alternate, each drawn from the past runs of its state; prices stay at this
tick's. The DP runs on ticks ``coarse`` times longer (available only where every fine
tick is; overheads rounded up), so that a plan costs tens of milliseconds.

Pure: no clock, no I/O; seeded (``seed``). Not yet a policy of the daemon.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from bench.replay.optimum import optimum
from bench.replay.tickmodel import OD, SPOT, Mode, TickJob, TickMarket, TickView

__all__ = ["LookAhead", "runs"]


def runs(avail: np.ndarray) -> tuple[list[int], list[int]]:
    """The lengths (ticks) of the runs of available and unavailable ticks in ``avail``."""
    up: list[int] = []
    down: list[int] = []
    if avail.size == 0:
        return up, down
    edges = np.flatnonzero(np.diff(avail.astype(np.int8))) + 1
    bounds = np.concatenate([[0], edges, [avail.size]])
    for a, b in zip(bounds[:-1], bounds[1:]):
        (up if avail[a] else down).append(int(b - a))
    return up, down


class LookAhead:
    """Model-predictive control over sampled futures (module docstring). ``past``: the
    zones' availability before the window, ``[zone, tick]`` (may be empty)."""

    oracle = False

    def __init__(self, past: np.ndarray | None = None, *, samples: int = 3, every: int = 20, coarse: int = 3,
                 margin_s: float = 0.0, on_demand_usd_h: float = 3.06, seed: int = 0,
                 name: str = "lookahead") -> None:
        self.past = past
        self.margin_s, self.on_demand_usd_h = margin_s, on_demand_usd_h
        self.samples, self.every, self.coarse = samples, every, coarse
        self.rng = np.random.default_rng(seed)
        self.name = name
        self.seen: list[np.ndarray] = []
        self.plan: list[Mode | None] = []  # fine ticks from plan_at
        self.plan_at = -1
        self.future: np.ndarray | None = None  # the availability the plan assumed

    # -- the future --------------------------------------------------------------------------------
    def _history(self) -> np.ndarray:
        seen = np.array(self.seen).T if self.seen else np.zeros((0, 0), dtype=bool)
        if self.past is None or self.past.size == 0:
            return seen
        return np.concatenate([self.past, seen], axis=1)

    def _sample(self, hist: np.ndarray, ticks: int) -> np.ndarray:
        """One future ``[zone, tick]`` of ``ticks`` ticks, the current tick first."""
        out = np.zeros((hist.shape[0], ticks), dtype=bool)
        for z in range(hist.shape[0]):
            h = hist[z]
            up, down = runs(h)
            state = bool(h[-1])
            age = len(h) - (np.flatnonzero(h != h[-1])[-1] + 1 if (h != h[-1]).any() else 0)
            pool = up if state else down
            longer = [x for x in pool if x > age]
            left = (int(self.rng.choice(longer)) - age + 1) if longer else max(1, age)
            t = 0
            while t < ticks:
                out[z, t:t + left] = state
                t += left
                state = not state
                pool = up if state else down
                left = int(self.rng.choice(pool)) if pool else ticks
        return out

    # -- the plan ------------------------------------------------------------------------------------
    def _replan(self, v: TickView) -> None:
        c, g = self.coarse, v.gap_s
        left = int(math.ceil(v.job.deadline_s / g - 1e-9)) - v.tick
        n = left // c
        # plan to finish ``margin_s`` early where the work still fits: a future worse than
        # the sampled ones then costs spot, not the safety net's on-demand
        fit = int(math.ceil((v.job.task_s - v.done_s + 2 * v.job.overhead_s) / (c * g)))
        n_plan = max(min(n, fit), n - int(self.margin_s // (c * g)))
        hist = self._history()
        job = TickJob(task_s=v.job.task_s - v.done_s, deadline_s=n_plan * c * g, overhead_s=v.job.overhead_s,
                      checkpoint_gb=v.job.checkpoint_gb, copy_gb_s=v.job.copy_gb_s,
                      egress_usd_per_gb=v.job.egress_usd_per_gb)
        price = np.repeat(v.price[:, None], n, axis=1)
        options: list[tuple[Mode | None, float, list[Mode | None], np.ndarray]] = []
        for _ in range(self.samples):
            fut = self._sample(hist, n * c)
            fut[:, 0] = v.avail
            coarse = fut[:, : n * c].reshape(len(v.zones), n, c).all(axis=2)
            held = v.held if v.held is None or v.held.kind == OD or coarse[v.held.zone, 0] else None
            m = TickMarket(v.zones, coarse, price, c * g, on_demand_usd_h=self.on_demand_usd_h)
            best = optimum(m, job, bound=False, held=held, overhead_left_s=v.overhead_left_s if held else 0.0,
                           leader=v.leader)
            if not best.feasible:
                continue
            fine = [x for x in best.plan for _ in range(c)]
            options.append((fine[0] if fine else None, best.cost_usd, fine, fut))
        if not options:
            self.plan, self.plan_at, self.future = [Mode(OD, v.leader or 0)], v.tick, None
            return
        votes = Counter(o[0] for o in options)
        top = max(votes.values())
        pick = min((o for o in options if votes[o[0]] == top), key=lambda o: o[1])
        self.plan, self.plan_at, self.future = pick[2], v.tick, pick[3]

    def _stale(self, v: TickView) -> bool:
        i = v.tick - self.plan_at
        if self.plan_at < 0 or i >= len(self.plan) or i >= self.every:
            return True
        want = self.plan[i]
        if want is not None and want.kind == SPOT and not v.avail[want.zone]:
            return True
        if i > 0 and self.plan[i - 1] is not None and self.plan[i - 1].kind == SPOT and v.held is None:
            return True  # lost
        if v.held is None and self.future is not None and (v.avail & ~self.future[:, i]).any():
            return True  # a zone came back while it waits
        return False

    def decide(self, v: TickView) -> Mode | None:
        self.seen.append(np.array(v.avail, dtype=bool))
        if self._stale(v):
            self._replan(v)
        want = self.plan[v.tick - self.plan_at] if v.tick - self.plan_at < len(self.plan) else None
        if want is not None and want.kind == SPOT and not v.avail[want.zone]:
            return None
        return want
