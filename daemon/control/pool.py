"""The pool reconciler's decisions, as a pure function.

``plan(desired, observed, offers, history, now=..., timeouts=...)`` looks at the
pool as it is and returns the actions that bring it to what it should be. It
does no I/O and reads no clock, so every decision is a table-driven test; the
daemon's applier is the only code that calls providers.

Order of the returned actions: removals (lost, timed out, drained past their
deadline, surplus) before launches, so capacity accounting is never optimistic.

Example: target 3 nodes; node a is ``running``, b got an interruption notice
(``draining``), c is ``running``. Active capacity is 2 (a draining node does not
count), so plan returns ``[Launch(offer=cheapest not in backoff)]`` at once, before
b is gone: the replacement boots while b flushes its checkpoint.

A node is lost when it has not heartbeated for :meth:`Timeouts.lost_after_s` of the
interval it was last told (``NodeView.heartbeat_interval_s``): the daemon stretches
the interval as the pool grows (:func:`heartbeat_interval_s`), so the timeout
stretches with it, per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from daemon.control.actions import Action, Launch, MarkLost, NodeView, Terminate
from daemon.control.lifecycle import COUNTED, NOT_IN_JOB_YET, NodeState
from daemon.control.offers import History, Offer, rank_offers

__all__ = [
    "Desired",
    "NodeView",
    "Offer",
    "History",
    "Timeouts",
    "Launch",
    "Terminate",
    "MarkLost",
    "Action",
    "plan",
    "heartbeat_interval_s",
    "rank_offers",
]


@dataclass(frozen=True, slots=True)
class Desired:
    """What the pool should have. ``valid_world_sizes``: None = any."""

    nodes: int
    valid_world_sizes: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. ``drain_grace_s``: how long past its notice deadline a draining node may linger.
    ``launch_timeout_s``: a launching node's bound when its view names none of its own
    (``NodeView.launch_timeout_s``, from its offer).

    ``reports_wait_s``: how long a drained node is kept while its agent still owes reports.

    ``heartbeat_timeout_s`` is the floor of the lost-node timeout; a node told a long
    heartbeat interval gets ``heartbeat_misses`` of them plus ``heartbeat_grace_s``
    (:meth:`lost_after_s`).
    """

    heartbeat_timeout_s: float = 20.0
    launch_timeout_s: float = 180.0
    drain_grace_s: float = 30.0
    heartbeat_misses: float = 2.0
    heartbeat_grace_s: float = 10.0  # Nomad's heartbeat_grace default
    # how long a drained node is kept for the reports its agent still owes (reports_owed_since)
    reports_wait_s: float = 30.0

    def lost_after_s(self, told_interval_s: float | None) -> float:
        """Seconds without a heartbeat after which a node told ``told_interval_s`` is lost.

        Example (defaults): told 1 s → 20 s (the floor); told 20 s → 2 × 20 + 10 = 50 s.
        """
        if told_interval_s is None:
            return self.heartbeat_timeout_s
        return max(self.heartbeat_timeout_s, self.heartbeat_misses * told_interval_s + self.heartbeat_grace_s)


def heartbeat_interval_s(live_nodes: int, *, min_interval_s: float, max_per_second: float) -> float:
    """The heartbeat interval that keeps the whole pool at ``max_per_second`` heartbeats at
    most, never below ``min_interval_s``: ``max(min_interval_s, live_nodes / max_per_second)``.

    As HashiCorp Nomad scales its clients' heartbeat TTL (``min_heartbeat_ttl``,
    ``max_heartbeats_per_second``, ``heartbeat_grace``:
    https://developer.hashicorp.com/nomad/docs/configuration/server). Example (1 s, 25/s,
    the config's defaults): 3 nodes → 1 s; 100 nodes → 4 s; 1,000 nodes → 40 s.
    """
    return max(min_interval_s, live_nodes / max_per_second)


# Removed first when shrinking: nodes not yet part of the job, youngest first, then running ones.
_SURPLUS_ORDER = {s: i for i, s in enumerate((*NOT_IN_JOB_YET, NodeState.RUNNING))}


def plan(
    desired: Desired,
    observed: Sequence[NodeView],
    offers: Sequence[Offer],
    history: History,
    *,
    now: float,
    timeouts: Timeouts = Timeouts(),
    domain: str | None = None,
) -> list[Action]:
    """Actions that move ``observed`` towards ``desired``. Pure; see the module docstring.

    ``domain``: the placement domain the pool is built in (``offers`` are its own): only
    its nodes count towards ``desired``, so a node elsewhere (the domain a migration is
    leaving) is never counted, scaled in or replaced here. None: every node counts.
    A ``held`` node (a migration's old domain) is not released as drained or past its
    deadline: the migration releases it once the new domain has trained."""
    removals = [r for r in (_removal(n, now, timeouts) for n in observed) if r is not None]
    removed = {r.node_id for r in removals}
    active = [n for n in observed if n.state in COUNTED and n.id not in removed and not n.replacing
              and (domain is None or n.domain == domain)]
    surplus = len(active) - desired.nodes
    if surplus > 0:
        victims = sorted(active, key=lambda n: (_SURPLUS_ORDER[n.state], -n.created_at))[:surplus]
        return removals + [Terminate(v.id, "scale_in") for v in victims]
    return removals + _launches(-surplus, sum(n.gpus for n in active), offers, history, desired.valid_world_sizes,
                                now=now)


def _removal(n: NodeView, now: float, timeouts: Timeouts) -> Terminate | MarkLost | None:
    """What ends ``n`` now, if anything: a launch past its timeout, a heartbeat lost, a
    drained node (unless ``held``) whose trainer has left and whose reports are in, or whose
    deadline passed."""
    if n.state.is_terminal():
        return None
    launch_timeout_s = timeouts.launch_timeout_s if n.launch_timeout_s is None else n.launch_timeout_s
    if n.state is NodeState.LAUNCHING and now - n.created_at > launch_timeout_s:
        return Terminate(n.id, "launch_timeout", NodeState.FAILED)
    if (n.state in (NodeState.PREPARING, NodeState.READY, NodeState.ADMITTING, NodeState.RUNNING, NodeState.DRAINING)
            and n.last_heartbeat is not None
            and now - n.last_heartbeat > timeouts.lost_after_s(n.heartbeat_interval_s)):
        return MarkLost(n.id, "heartbeat_lost")
    if n.held:
        return None
    if n.state is NodeState.DRAINING and n.trainer_exited and not _owes_reports(n, now, timeouts):
        # it has left the job and its reports are in: release it now rather than pay until
        # the cloud takes it
        return Terminate(n.id, "drained")
    if n.state is NodeState.DRAINING and n.deadline is not None and now > n.deadline + timeouts.drain_grace_s:
        return Terminate(n.id, "drain_deadline_passed")
    return None


def _owes_reports(n: NodeView, now: float, timeouts: Timeouts) -> bool:
    """``n``'s agent still holds reports the daemon has not answered (its notice's commit,
    its trainer's exit), for at most ``timeouts.reports_wait_s``: a node released before
    they are in takes them with it."""
    since = n.reports_owed_since
    return since is not None and now - since < timeouts.reports_wait_s


def _launches(missing: int, world: int, offers: Sequence[Offer], history: History,
              valid: frozenset[int] | None, *, now: float) -> list[Action]:
    """Up to ``missing`` launches, best offer first, each keeping the world size
    (``world`` GPUs so far) valid where an offer can."""
    launches: list[Action] = []
    by_index = {o.index: o for o in offers}
    ranked = rank_offers(offers, history, now=now)
    for _ in range(missing):
        choice = _first_valid(ranked, world, valid)
        if choice is None:
            break
        launches.append(Launch(choice.index, "below_target"))
        world += by_index[choice.index].gpus_per_node
    return launches


def _first_valid(ranked: Sequence[Offer], world: int, valid: frozenset[int] | None) -> Offer | None:
    """The best offer whose GPUs keep the world size valid; else the best one at all.

    A node that makes the world size invalid still helps once its peer arrives
    (e.g. valid {2, 4}: 2 → 3 → 4), so it is launched; the daemon only *admits*
    nodes into the job in valid combinations.
    """
    if not ranked:
        return None
    if valid is not None:
        for o in ranked:
            if world + o.gpus_per_node in valid:
                return o
    return ranked[0]
