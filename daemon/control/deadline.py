"""Spending to a deadline: which markets the pool may buy from now. Pure.

A job with a deadline should finish by it at the least cost: spot while the slack
allows, on-demand when it does not. The rule is Uniform Progress (Wu et al., "Can't Be
Late: Optimizing Spot Instance Savings under Deadlines", NSDI'24), for a pool:

- **safety net**: when what is left, trained on on-demand nodes at the pool's target
  size, plus ``margin`` restarts, no longer fits before the deadline, buy on-demand
  only (a spot node there could still be taken and cost a restart the deadline cannot
  pay);
- **behind**: when the job is behind the uniform line (``target × elapsed / (deadline −
  start)`` steps), spot first and on-demand where spot has no capacity (the planner's
  on-demand fallback), so the pool is back at its target size at once;
- **ahead** (after on-demand, by two restarts' worth of steps, so a job on the line does
  not flap): spot only; a shortage of spot capacity is waited out, and on-demand nodes
  still in the job are replaced by spot ones, make before break (:func:`back_to_spot`).

:func:`markets` returns the markets allowed now; the planner is given only the offers
of those markets (``daemon.control.offers.rank_offers`` still ranks spot before on-demand).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from daemon.control.actions import Action, MarkReplacing, PoolState
from daemon.control.lifecycle import ADMITTED
from daemon.control.offers import Offer

__all__ = ["Progress", "markets", "back_to_spot", "in_markets", "narrow", "markets_for", "market_change",
           "deadline_status", "names", "SPOT", "ON_DEMAND", "SPOT_ONLY", "BOTH", "ON_DEMAND_ONLY"]

SPOT, ON_DEMAND = "spot", "on_demand"
SPOT_ONLY = frozenset({SPOT})
BOTH = frozenset({SPOT, ON_DEMAND})
ON_DEMAND_ONLY = frozenset({ON_DEMAND})


@dataclass(frozen=True, slots=True)
class Progress:
    """Where the job stands against its deadline. Unix seconds, seconds, steps.

    ``step_s``: seconds per step at the pool's target size (measured, or the job model's);
    ``restart_s``: what one restart costs the job (a boot, torchrun's restart, the load);
    ``grows_in_process``: the pool has more than one node and a node that joins the
    running job does not restart it (``job.grow: in_process``), so a spot node lost and
    replaced costs the job a pause (an in-process shrink, then a grow), not a restart.
    """

    step: int
    target_steps: int
    started_at: float
    deadline: float
    step_s: float
    restart_s: float
    grows_in_process: bool = False

    def remaining_s(self) -> float:
        """Seconds of training left at the target size."""
        return max(0, self.target_steps - self.step) * self.step_s


def in_markets(offers: Iterable[Offer], allowed: frozenset[str] | None) -> list[Offer]:
    """The offers of ``offers`` in the markets ``allowed`` (None: all of them). What the
    planner may buy from, and what a migration decision counts as usable in a domain: a
    domain whose spot offers are out while the deadline allows spot only is starved,
    though it has an on-demand offer."""
    if allowed is None:
        return list(offers)
    return [o for o in offers if (ON_DEMAND if o.on_demand else SPOT) in allowed]


def narrow(allowed: frozenset[str] | None, markets: frozenset[str] | None) -> frozenset[str] | None:
    """The markets ``allowed`` by the policy, narrowed to ``markets`` (a move built from spot
    only, :attr:`daemon.control.migration.Move.markets`); the policy's alone when either is
    None or they share none (the policy's word wins: on-demand only near the deadline)."""
    if allowed is None or markets is None:
        return allowed
    return (allowed & markets) or allowed


def markets_for(domain: str, *, build_domain: str, allowed: frozenset[str] | None,
                move_markets: frozenset[str] | None) -> frozenset[str] | None:
    """The markets the planner may buy from in ``domain``: those the policy ``allowed``
    (None: every market), narrowed by a move in flight built from some markets only
    (``move_markets``, :attr:`daemon.control.migration.Move.markets`) when ``domain`` is
    the one the pool is built in (``build_domain``: the move's target, else the job's)."""
    return narrow(allowed, move_markets) if domain == build_domain else allowed


def names(markets: frozenset[str] | None) -> list[str] | None:
    """``markets`` as a sorted list for an event or a status (None: every market)."""
    return None if markets is None else sorted(markets)


def market_change(p: Progress | None, old: frozenset[str] | None, new: frozenset[str] | None, *, now: float,
                  first: bool) -> dict[str, object] | None:
    """The ``market_changed`` event's data when the markets allowed go from ``old`` to
    ``new`` at ``now`` (unix s); None when there is nothing to say: no change, no
    deadline (``p`` None), or the ``first`` answer the policy gives (no change from anything)."""
    if new == old or p is None or first:
        return None
    return {"old": names(old), "new": names(new), "step": p.step, "target_steps": p.target_steps,
            "hours_to_deadline": round((p.deadline - now) / 3600, 2),
            "hours_of_work_left": round(p.remaining_s() / 3600, 2)}


def deadline_status(p: Progress, allowed: frozenset[str] | None, *, now: float) -> dict[str, object]:
    """``spotctl status``'s deadline line at ``now`` (unix s): the deadline, the hours to it
    and of work left, the expected finish (unix s: the work left at the target size from
    now, at ``step_s``), the slack it leaves (hours; negative: late) and the markets."""
    finish = now + p.remaining_s()
    return {"deadline": p.deadline, "hours_to_deadline": round((p.deadline - now) / 3600, 2),
            "hours_of_work_left": round(p.remaining_s() / 3600, 2), "expected_finish": finish,
            "slack_h": round((p.deadline - finish) / 3600, 2), "markets": names(allowed)}


def back_to_spot(s: PoolState, allowed: frozenset[str]) -> list[Action]:
    """Once spot alone is allowed again (the job is ahead of its line), each on-demand node
    in the job is replaced by a spot one, make before break: it stops counting as capacity
    (the planner launches a spot node), and admission drains it once that node is up (the
    rebalance ``replace`` path). Nodes not in the job yet are simply surplus."""
    if allowed != SPOT_ONLY:
        return []
    return [MarkReplacing(n.id, "deadline_slack") for n in s.nodes
            if n.market == ON_DEMAND and n.state in ADMITTED and not n.replacing]


def markets(p: Progress, now: float, *, previous: frozenset[str] | None = None,
            margin: float = 3.0) -> frozenset[str]:
    """The markets the pool may buy from at ``now`` (module docstring), given those it was
    allowed until now (``previous``; None: none yet). ``margin``: the restarts the safety
    net keeps in hand.

    Hysteresis: spot only → spot and on-demand as soon as the job is behind the line;
    back to spot only once it is ahead by two restarts' worth of steps (going back costs
    one: make before break still restarts the group), so a job on the line does not flap."""
    if p.step >= p.target_steps:
        return SPOT_ONLY
    if p.deadline - now <= p.remaining_s() + margin * p.restart_s:
        return ON_DEMAND_ONLY
    span = p.deadline - p.started_at
    expected = p.target_steps * (now - p.started_at) / span if span > 0 else p.target_steps
    restart_steps = p.restart_s / p.step_s if p.step_s > 0 else 0.0
    if previous is not None and ON_DEMAND in previous:
        return BOTH if p.step < expected + 2 * restart_steps else SPOT_ONLY
    return BOTH if p.step < expected - restart_steps else SPOT_ONLY
