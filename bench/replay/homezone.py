"""A policy that keeps the job in one zone and spends its slack on that zone's outages.

:class:`HomeZone` runs in the tick model (:mod:`bench.replay.tickmodel`). What it looks
ahead with is each zone's recent history (the trace's past before the window and the
window so far, the last ``memory_s`` seconds of it), summarised as three numbers a
decision needs:

- the **settle age** of a zone (:func:`settle_ticks`): how long an up-run must have
  lasted before a launch into it buys progress cheapest. A run shorter than the restart
  overhead (0.2 h, 3.7 ticks of 195 s) is billed and buys nothing; when the zone's runs
  are often that short, waiting a few ticks into a run skips them;
- the **progress rate** of a zone (:func:`progress_rate`): progress seconds per wall
  second for a job that launches at the settle age into every up-run and restarts after
  each preemption, so ``work left / rate`` is how long finishing there would take;
- the **rest of an outage** (:func:`rest_of_run`): the mean remaining length of the
  zone's down-runs at least as long as the current one.

Decisions, at each tick (the safety net of the simulator takes over once the deadline
needs on-demand):

1. a spot instance held is kept;
2. the home zone is where the checkpoint is (the last zone that made progress; at the
   start, the cheapest zone available, the one with the higher rate on a tie). While it
   is up, it is launched into once the run has lasted its settle age, or at once when
   the slack is short (below);
3. while it is down the job **waits** (nothing is billed) if the time left is at least
   ``margin`` × (the rest of the outage + a restart + work left / its rate); else it
   **moves** to a zone that is up, the cheapest in egress and spot price among those
   whose own estimate fits the same test, or, if none fits, the one that finishes
   soonest, and only when that is sooner than waiting for home.

Waiting costs no money; a move costs the copy's egress (up to $1 for 50 GB between US
regions) and another restart, and every launch bills 0.2 h of overhead: on the traces,
what separates a policy from the offline optimum is how many of those it pays, and a
home zone with a slack budget pays few. The optimum itself never moves on the V100
windows (bench/README.md). No DP and no sampling: deterministic, about 1 s a window.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import numpy as np

from bench.replay.lookahead import runs
from bench.replay.tickmodel import SPOT, Mode, TickMarket, TickView

__all__ = ["HomeZone", "progress_rate", "rest_of_run", "settle_ticks"]

#: the longest settle age tried (ticks)
MAX_SETTLE_TICKS = 8
#: the lowest progress rate assumed for a zone (a zone never up in its history)
MIN_RATE = 0.02


def settle_ticks(up: list[int], gap_s: float, overhead_s: float) -> int:
    """The up-run age (whole ticks, 0 .. :data:`MAX_SETTLE_TICKS`) at which launching into
    each of the runs ``up`` (their lengths, ticks of ``gap_s`` seconds) buys progress at the
    lowest billed time per progress second; a launch bills its run from then on and its
    first ``overhead_s`` seconds make no progress. 0 when no age buys any."""
    best, best_d = None, 0
    for d in range(MAX_SETTLE_TICKS + 1):
        billed = sum(n - d for n in up if n > d)
        got = sum(max(0.0, (n - d) * gap_s - overhead_s) for n in up if n > d)
        if got <= 0:
            continue
        per = billed * gap_s / got
        if best is None or per < best - 1e-12:
            best, best_d = per, d
    return best_d


def progress_rate(avail: np.ndarray, gap_s: float, overhead_s: float) -> float:
    """Progress seconds per wall second in a zone whose history is ``avail`` (bool per
    tick), launching at its settle age into every up-run (at least :data:`MIN_RATE`)."""
    if avail.size == 0:
        return MIN_RATE
    up, _ = runs(avail)
    d = settle_ticks(up, gap_s, overhead_s)
    got = sum(max(0.0, (n - d) * gap_s - overhead_s) for n in up if n > d)
    return max(got / (avail.size * gap_s), MIN_RATE)


def rest_of_run(avail: np.ndarray, gap_s: float) -> float:
    """Seconds the current run of ``avail`` (its last state) is expected to last still:
    the mean of the past runs of that state longer than its age, less the age; the age
    itself when none was longer."""
    if avail.size == 0:
        return 0.0
    state = bool(avail[-1])
    other = np.flatnonzero(avail != state)
    age = avail.size - (int(other[-1]) + 1 if other.size else 0)
    up, down = runs(avail[: avail.size - age])
    longer = [n for n in (up if state else down) if n > age]
    return (sum(longer) / len(longer) - age) * gap_s if longer else age * gap_s


class HomeZone:
    """The home-zone policy (module docstring). ``past``: the zones' availability before
    the window, ``[zone, tick]`` (may be None or empty); ``margin``: how much longer than
    the estimate the time left must be to wait for home; ``memory_s``: how much history
    the estimates read (seconds; None: all of it)."""

    oracle = False

    def __init__(self, past: np.ndarray | None = None, *, margin: float = 1.2, memory_s: float | None = 48 * 3600.0,
                 name: str = "home_zone") -> None:
        self.past = past if past is not None and past.size else None
        self.margin, self.memory_s, self.name = margin, memory_s, name
        self.seen: list[np.ndarray] = []
        self._costs: tuple[np.ndarray, np.ndarray] | None = None  # egress USD, transfer s: [from, to]

    def _history(self, gap_s: float) -> np.ndarray:
        seen = np.array(self.seen, dtype=bool).T
        hist = seen if self.past is None else np.concatenate([self.past, seen], axis=1)
        if self.memory_s is not None:
            hist = hist[:, -max(1, int(self.memory_s // gap_s)):]
        return hist

    def decide(self, v: TickView) -> Mode | None:
        self.seen.append(np.array(v.avail, dtype=bool))
        if v.held is not None and v.held.kind == SPOT:
            return v.held
        g, job = v.gap_s, v.job
        if self._costs is None:
            m = TickMarket(v.zones, np.zeros((len(v.zones), 1), dtype=bool), np.zeros((len(v.zones), 1)), g)
            self._costs = (m.egress(job), m.transfer(job))
        egress, transfer = self._costs
        hist = self._history(g)
        work = job.task_s - v.done_s
        left = job.deadline_s - v.elapsed_s
        rate = [progress_rate(hist[z], g, job.overhead_s) for z in range(len(v.zones))]
        up = [z for z in range(len(v.zones)) if v.avail[z]]
        home = v.leader
        if home is None:  # nothing made progress yet: the cheapest zone up, the faster one on a tie
            return Mode(SPOT, min(up, key=lambda z: (float(v.price[z]), -rate[z]))) if up else None
        if v.avail[home]:
            short = left < self.margin * (job.overhead_s + work / rate[home])
            h = hist[home]
            age = h.size - (int(np.flatnonzero(~h)[-1]) + 1 if (~h).any() else 0)
            settle = settle_ticks(runs(h)[0], g, job.overhead_s)
            return Mode(SPOT, home) if short or age > settle else None
        wait_s = rest_of_run(hist[home], g) + job.overhead_s + work / rate[home]
        if not up or left >= self.margin * wait_s:
            return None  # wait for home: it costs nothing while the slack lasts

        def move_s(z: int) -> float:
            return job.overhead_s + float(transfer[home, z]) + work / rate[z]

        fits = [z for z in up if left >= self.margin * move_s(z)]
        if fits:
            to = min(fits, key=lambda z: float(egress[home, z]) + float(v.price[z]) * work / 3600)
        else:
            to = min(up, key=move_s)
        return Mode(SPOT, to) if move_s(to) < wait_s else None
