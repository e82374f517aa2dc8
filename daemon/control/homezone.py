"""The home-zone decision: wait out the job's domain's outage on the deadline's slack, or move.

What separates a deadline policy from the offline optimum on the public traces is what it
pays that the optimum does not: moves (egress, a copy, another restart) and launches
into short-lived capacity (a restart billed for nothing). The optimum almost never
moves (bench/README.md, SkyNomad's V100 setting). So the job keeps a **home**, the
domain its checkpoint is in, and spends the slack to its deadline on the home's outages:

1. the home has capacity (not starved): **stay**;
2. it is starved before the job has trained a step: the home is only where the job
   started and a move copies nothing, so **move** to the region with spot that would
   finish soonest (its rate, the cheaper on a tie) when that is sooner than waiting;
3. it is starved and the time left is at least ``margin`` × (the rest of its outage +
   a restart + the work left / its progress rate), all from what the daemon has seen of
   it (:mod:`daemon.control.availability`): **wait** (nothing is bought meanwhile);
4. else **move** to another domain with usable spot, the cheapest in egress and spot
   price for the work left among those whose own estimate (a restart + the copy + the
   work left / its rate) fits the same test; if none fits, the one that finishes soonest,
   and only when that is sooner than waiting for home;
5. nothing sooner: **wait**. The deadline's safety net (on-demand only once the rest of
   the job barely fits: :func:`daemon.control.deadline.markets`) keeps the deadline.

A domain the daemon has never seen gets the benefit of the doubt: rate 1, no outage.
The tick model's policy (``bench/replay/homezone.py``) also waits a settle age into an
up-run before launching; the daemon launches as soon as a launch succeeds.

Example: 30 h of work left, 50 h to the deadline, home starved 10 min; its record says
its outages longer than 10 min lasted 3 h on average and its rate is 0.8: waiting
finishes in 2.8 h + 0.2 h + 37.5 h = 40.5 h; 50 h ≥ 1.2 × 40.5 h = 48.6 h: wait.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from daemon.control.availability import Availability, progress_rate, rest_of_run
from daemon.control.deadline import Progress
from daemon.control.migration import DomainView, move_cost_usd
from daemon.control.offers import History

__all__ = ["COPY_BYTES_S", "MARGIN", "HomeDecision", "decide"]

#: the time left must be this many times the estimate to count on it
MARGIN = 1.2
#: the checkpoint copy's rate between domains' stores (bytes/second), for its time
COPY_BYTES_S = 0.5e9


@dataclass(frozen=True, slots=True)
class HomeDecision:
    """``action``: ``stay``, ``wait`` or ``move``; ``reason``: one line an operator reads;
    the figures behind it (seconds; None where they were not needed)."""

    action: str
    reason: str
    home: str
    target: str | None = None
    left_s: float | None = None
    wait_s: float | None = None
    move_s: float | None = None

    def to_dict(self) -> dict[str, object]:
        """The decision as ``spotctl status`` and ``placement_waiting`` carry it (seconds rounded)."""
        return {"action": self.action, "reason": self.reason, "home": self.home, "target": self.target,
                **self.figures()}

    def figures(self) -> dict[str, object]:
        """What a move's ``migration_started`` adds to its own fields: the decision's line
        (``decision``) and its figures (seconds rounded)."""
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 1)
        return {"decision": self.reason, "left_s": r(self.left_s), "wait_s": r(self.wait_s), "move_s": r(self.move_s)}


def decide(progress: Progress, domains: Sequence[DomainView], home: str, history: History, record: Availability, *,
           now: float, starved: bool, checkpoint_bytes: int | None, gpus: int, margin: float = MARGIN,
           avoid: frozenset[str] = frozenset()) -> HomeDecision:
    """The decision at ``now`` (unix s) for a job whose checkpoint is in ``home``
    (module docstring). ``starved``: the home has been short of capacity with no usable
    offer (:func:`daemon.control.migration.starved_since`); ``gpus``: the job's GPUs
    (the work left is bought for them); ``avoid``: domains not to move to (a move there
    failed recently)."""
    if not starved:
        return HomeDecision("stay", "home has capacity", home)
    left = progress.deadline - now
    work = progress.remaining_s()
    restart = progress.restart_s

    def finish_s(domain: str, extra_s: float) -> float:
        rate = progress_rate(record, domain, now, restart)
        rest = rest_of_run(record, domain, now) if record.is_up(domain) is False else None
        return (rest or 0.0) + restart + extra_s + work / max(rate if rate is not None else 1.0, 1e-3)

    wait_s = finish_s(home, 0.0)
    up = [d for d in domains if d.name != home and d.name not in avoid and d.usable(history, now)
          and any(not o.on_demand for o in d.usable(history, now))]
    if progress.step == 0 and up:  # nothing trained: the home is only where it started, and moving is free
        fresh = {d.name: finish_s(d.name, 0.0) for d in up}
        to = min(up, key=lambda d: (fresh[d.name], d.usd_per_gpu_h(history, now), d.name))
        if fresh[to.name] < wait_s:
            return HomeDecision("move", f"{home} is out before the job trained; {to.name} has spot", home, to.name,
                                left, wait_s, fresh[to.name])
    if left >= margin * wait_s:
        return HomeDecision("wait", f"the slack covers {home}'s outage", home, left_s=left, wait_s=wait_s)
    source = next((d for d in domains if d.name == home), None)
    egress = move_cost_usd(checkpoint_bytes, source) if source is not None else 0.0
    copy_s = (checkpoint_bytes or 0) / COPY_BYTES_S
    if not up:
        return HomeDecision("wait", "no other domain has spot", home, left_s=left, wait_s=wait_s)
    move_s = {d.name: finish_s(d.name, copy_s) for d in up}
    fits = [d for d in up if left >= margin * move_s[d.name]]
    if fits:
        to = min(fits, key=lambda d: (egress + d.usd_per_gpu_h(history, now) * gpus * work / 3600, d.name))
        why = f"{home}'s outage outlasts the slack; {to.name} fits it"
    else:
        to = min(up, key=lambda d: (move_s[d.name], d.name))
        if move_s[to.name] >= wait_s:
            return HomeDecision("wait", "no domain finishes sooner than waiting", home, left_s=left, wait_s=wait_s,
                                move_s=move_s[to.name])
        why = f"{home}'s outage outlasts the slack; {to.name} finishes soonest"
    return HomeDecision("move", why, home, to.name, left, wait_s, move_s[to.name])
