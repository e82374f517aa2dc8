"""Whole-job migration between placement domains: when to move, where, and each next
step of a move in flight. Pure: no I/O, no clock (``now`` is passed in).

A job attempt's nodes share one placement domain (a provider and region, plus an
optional placement group) and its private network. Replacements come from that domain;
when it cannot hold the job, the whole job moves:

1. ``booting``: the pool is launched in the target domain (the planner builds there)
   while the job keeps training where it is;
2. ``committing``: once the target has nodes for a valid world size, every node of the
   job is drained: the job commits at one step boundary and its workers stop (no step
   computed after the commit, so none is lost);
3. ``copying``: the newest committed checkpoint is copied to the target's store, every
   shard verified against the manifest (:mod:`trainer.replicate`);
4. ``starting``: the job's domain is now the target; its nodes start the job, which
   resumes from the copy with the same global batch and data position;
5. done once the job has trained its first step there: the old domain's nodes, held
   until then, are released (``migration_completed``). A move that cannot finish
   (the target brings up no nodes within ``boot_timeout_s``, the copy fails) ends
   ``migration_failed`` and the job stays, or goes back, where it was.

When to move (:func:`decide`): the job's domain has been **starved** (short of the
target with every one of its offers out of capacity or over its price cap) for
``patience_s``; or, with ``min_saving_fraction`` set, another domain is that much
cheaper per GPU-hour and the saving over ``payback_h`` pays for the move. Where
(:func:`choose_target`): the usable domain with the lowest cost per GPU-hour, after a
penalty for its recent preemptions and capacity failures, plus the move's own cost
(checkpoint bytes × the source's egress price), spread over ``payback_h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Collection, Mapping, Sequence

from daemon.control.actions import PoolState
from daemon.control.lifecycle import ADMITTED, COUNTED, NodeState
from daemon.control.offers import History, Offer, rank_offers

__all__ = ["Phase", "DomainView", "Plan", "Move", "starved_since", "choose_target", "decide", "move_cost_usd",
           "ready_for_commit", "target_out", "RISK_PENALTY"]

# each recent preemption or capacity failure in a domain weighs like this fraction of its
# price per GPU-hour (a domain that just failed us is not where to go first)
RISK_PENALTY = 0.10
# a domain's recent losses past this many add no more penalty (a window of an hour holds far fewer)
MAX_RECENT_LOSSES = 10**6
_GB = 1e9


class Phase(str, Enum):
    """Where a move is (module docstring)."""

    BOOTING = "booting"
    COMMITTING = "committing"
    COPYING = "copying"
    STARTING = "starting"


@dataclass(frozen=True, slots=True)
class DomainView:
    """A decision's view of a placement domain.

    ``offers``: its offers with current prices (USD/hour); ``egress_usd_per_gb``: what
    copying a byte out of its store to another domain costs (USD per 10^9 bytes);
    ``preemptions`` / ``capacity_failures``: recent ones there (the daemon's window).
    """

    name: str
    offers: tuple[Offer, ...]
    egress_usd_per_gb: float = 0.0
    preemptions: int = 0
    capacity_failures: int = 0

    def usable(self, history: History, now: float) -> list[Offer]:
        return rank_offers(self.offers, history, now=now)

    def usd_per_gpu_h(self, history: History, now: float) -> float:
        """The cheapest usable offer's price per GPU-hour (inf: none usable or price unknown)."""
        usable = self.usable(history, now)
        return min((o.usd_per_gpu_h() for o in usable), default=float("inf"))


@dataclass(frozen=True, slots=True)
class Plan:
    """Migration settings (``config.migration``); seconds and hours."""

    patience_s: float = 300.0
    boot_timeout_s: float = 900.0
    min_saving_fraction: float | None = None
    payback_h: float = 24.0
    cooldown_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class Move:
    """The decision to move the job from ``source`` to ``target``; ``reason`` is
    ``capacity`` or ``price``; ``why``: the figures behind it, for the event."""

    source: str
    target: str
    reason: str
    why: Mapping[str, object] = field(default_factory=dict)
    # the markets the target is built from while the move is in flight (None: those the
    # recovery policy allows): a move made to find spot does not buy on-demand there
    markets: frozenset[str] | None = None


def move_cost_usd(checkpoint_bytes: int | None, source: DomainView) -> float:
    """What copying the checkpoint out of ``source`` costs (USD): bytes × egress price."""
    return (checkpoint_bytes or 0) / _GB * source.egress_usd_per_gb


_LAUNCHED = frozenset(COUNTED) - {NodeState.REQUESTED}


def starved_since(prev: float | None, s: PoolState, domain: DomainView, history: History, *,
                  now: float) -> float | None:
    """Since when (unix s) the job's domain has been **starved**, or None: short of the
    target (fewer of its nodes count as capacity than ``s.target_nodes``) with none of its
    offers usable (all in capacity backoff or over their price cap).

    Once starved, the domain stays starved until the shortage ends or a launch there
    succeeds after ``prev``: an offer whose backoff ran out and which failed again has not
    ended the shortage, so the patience is not restarted by each retry.
    """
    if s.job.is_terminal() or s.paused or s.target_nodes <= 0:
        return None
    mine = [n for n in s.nodes if n.domain == domain.name]
    counted = [n for n in mine if n.state in COUNTED and not n.replacing]
    if len(counted) >= s.target_nodes:
        return None
    if prev is not None:
        if any(n.created_at > prev and n.state in _LAUNCHED for n in mine):
            return None  # a launch there succeeded: capacity came back
        return prev
    return now if not domain.usable(history, now) else None


def _score(d: DomainView, history: History, now: float) -> float:
    """USD per GPU-hour after the risk penalty (inf: no usable priced offer). The recent
    losses counted are capped at :data:`MAX_RECENT_LOSSES` so that no count, however
    large, overflows the float (the ranking is the same past the cap)."""
    price = d.usd_per_gpu_h(history, now)
    if price == float("inf"):
        return price
    losses = min(max(0, d.preemptions + d.capacity_failures), MAX_RECENT_LOSSES)
    return price * (1.0 + RISK_PENALTY * losses)


def choose_target(domains: Sequence[DomainView], current: str, history: History, *, now: float,
                  checkpoint_bytes: int | None, payback_h: float, gpus: int,
                  avoid: Collection[str] = ()) -> tuple[DomainView, dict] | None:
    """The domain to move to, with the figures that chose it; None when no other domain
    (outside ``avoid``) has a usable offer. Cost per GPU-hour after the risk penalty (a
    domain whose price is unknown ranks after every priced one), plus the move's egress
    spread over ``payback_h`` hours and ``gpus`` GPUs; config order breaks ties."""
    source = next((d for d in domains if d.name == current), None)
    egress = move_cost_usd(checkpoint_bytes, source) if source is not None else 0.0
    scored = []
    for i, d in enumerate(domains):
        if d.name == current or d.name in avoid or not d.usable(history, now):
            continue
        # a usable domain whose price is unknown stays a candidate, after every priced one
        score = _score(d, history, now)
        scored.append((score + egress / max(payback_h, 1e-9) / max(gpus, 1), i, d))
    if not scored:
        return None
    score, _, best = min(scored, key=lambda t: (t[0], t[1]))
    price = best.usd_per_gpu_h(history, now)
    why = {
        "candidates": {d.name: _finite(sc) for sc, _, d in sorted(scored, key=lambda t: (t[0], t[1]))},
        "target_usd_per_gpu_h": _finite(price),
        "target_recent_failures": best.preemptions + best.capacity_failures,
        "egress_usd": round(egress, 2),
        "checkpoint_bytes": checkpoint_bytes,
    }
    return best, why


def _finite(x: float) -> float | None:
    """``x`` rounded for an event, None when unknown (inf)."""
    return None if x == float("inf") else round(x, 4)


def decide(s: PoolState, domains: Sequence[DomainView], current: str, history: History, *, now: float,
           plan: Plan, starved_since: float | None, checkpoint_bytes: int | None,
           last_move_ended_at: float | None, gpus: int, failed_moves: Mapping[str, float] | None = None) -> Move | None:
    """Whether to move the job now, and where (module docstring). None: stay.

    Never while paused or over, never within ``cooldown_s`` of the last completed move's
    end (``last_move_ended_at``), never to a domain a move to which failed within
    ``cooldown_s`` (``failed_moves``: domain → when, unix s; another domain may be tried
    at once: a starved job should not sit out the cooldown because one target could not
    boot), and never without a target domain that can launch now."""
    if s.job.is_terminal() or s.paused or len(domains) < 2:
        return None
    if last_move_ended_at is not None and now - last_move_ended_at < plan.cooldown_s:
        return None
    src = next((d for d in domains if d.name == current), None)
    if src is None:
        return None
    avoid = {d for d, t in (failed_moves or {}).items() if now - t < plan.cooldown_s}
    picked = choose_target(domains, current, history, now=now, checkpoint_bytes=checkpoint_bytes,
                           payback_h=plan.payback_h, gpus=gpus, avoid=avoid)
    if picked is None:
        return None
    target, why = picked
    if starved_since is not None and now - starved_since >= plan.patience_s:
        return Move(current, target.name, "capacity",
                    {**why, "starved_s": round(now - starved_since, 1), "patience_s": plan.patience_s})
    if plan.min_saving_fraction is None:
        return None
    here = src.usd_per_gpu_h(history, now)
    there = target.usd_per_gpu_h(history, now)
    if here == float("inf") or there >= here * (1.0 - plan.min_saving_fraction):
        return None
    saving = (here - there) * gpus * plan.payback_h
    if saving <= why["egress_usd"]:
        return None
    return Move(current, target.name, "price",
                {**why, "source_usd_per_gpu_h": round(here, 4), "saving_usd_over_payback": round(saving, 2)})


def target_out(s: PoolState, target: DomainView, history: History, *, now: float) -> bool:
    """A move in its ``booting`` phase cannot go on: its target has no node launching or up
    and none of its offers is usable (every launch there failed for capacity: the
    provider said so at once, e.g. EC2's ``InsufficientInstanceCapacity``). The move
    fails now rather than at ``boot_timeout_s``, and another domain may be tried."""
    if any(n.domain == target.name and n.state in COUNTED for n in s.nodes):
        return False
    return not target.usable(history, now)


def ready_for_commit(s: PoolState, target: str, *, valid_world_sizes: frozenset[int], min_nodes: int) -> bool:
    """The target domain can take the job: its ready nodes reach the pool's target, or make
    a valid world size of at least ``min_nodes`` nodes while nothing more is launching there."""
    ready = [n for n in s.nodes if n.domain == target and n.state is NodeState.READY]
    if len(ready) >= s.target_nodes:
        return True
    booting = [n for n in s.nodes if n.domain == target and n.state in (NodeState.REQUESTED, NodeState.LAUNCHING,
                                                                        NodeState.PREPARING)]
    world = sum(n.gpus for n in ready)
    return not booting and len(ready) >= min_nodes and world in valid_world_sizes


def job_left(s: PoolState, source: str) -> bool:
    """Every node of the job in ``source`` has stopped training (its commit is in, or it is gone)."""
    return not any(n.domain == source and (n.state in ADMITTED or not n.trainer_exited)
                   and not n.state.is_terminal() for n in s.nodes)
