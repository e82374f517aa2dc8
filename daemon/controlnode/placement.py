"""Placement domains and markets at the edge: which domain a node is in, which offers the
planner may buy from (the job's domain, the markets the recovery policy allows: a job
with ``job.deadline`` spends to it, :mod:`daemon.control.deadline`).

One job, one network: a job attempt's nodes share one placement domain
(:meth:`daemon.config.Config.domains_resolved`). The planner buys only from the domain
it builds in (:attr:`Migrator.build_domain`: the job's, or a migration's target), and
with ``mix_zones`` / ``mix_gpu_types`` off only in the zone / of the GPU type of the
attempt's first node; admission admits only nodes of the job's domain
(:meth:`daemon.control.actions.PoolState.in_domain`).

The rules are pure (:func:`daemon.control.deadline.markets_for`,
:func:`~daemon.control.deadline.market_change`, :func:`~daemon.control.deadline.deadline_status`);
this part keeps the markets allowed now and reads what they need.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from daemon.config import DEADLINE_START_S, new_job_deadline_problem
from daemon.control.actions import Action
from daemon.control.deadline import Progress, deadline_status, in_markets, market_change, markets_for
from daemon.control.offers import Offer
from daemon.controlnode.core import Core
from daemon.model import EventKind, Node

__all__ = ["Placement", "DeadlineError"]


class DeadlineError(ValueError):
    """A new job whose absolute ``job.deadline`` cannot be met even on on-demand nodes
    (:func:`daemon.config.new_job_deadline_problem`): the daemon refuses to start
    it, before anything is bought. The message is one line naming the field and the fix."""


class Placement:
    """Domains of nodes and offers for one pool.

    ``usable_offers()``: the offers the pool may buy at all (the fleet's);
    ``building()``: the domain the pool is built in now and the markets a move in flight
    builds it from (None: the policy's), both from the migrator."""

    def __init__(self, core: Core, *, usable_offers: Callable[[], Iterable[Offer]],
                 building: Callable[[], tuple[str, frozenset[str] | None]]) -> None:
        self.core = core
        self._usable_offers, self._building = usable_offers, building
        config = core.config
        # each offer's domain by the offer's stable key (a node keeps its offer's key)
        self._by_key = {o.key: config.domain_of_offer(i) for i, o in enumerate(config.offers)}
        self._domains = {d.name: d for d in config.domains_resolved()}
        self.allowed: frozenset[str] | None = None  # the markets the policy allows (None: the config's offers)
        self._submitted_at: float | None = None
        self._markets_known = False

    def domain_of(self, node: Node) -> str:
        """``node``'s placement domain: its offer's; for an offer no longer in the config,
        the domain of its provider and region; else the first domain."""
        d = self._by_key.get(node.offer_key or "")
        if d is not None:
            return d
        for dom in self._domains.values():
            if (dom.provider, dom.region) == (node.provider, node.region):
                return dom.name
        return next(iter(self._domains))

    def offers_in(self, domain: str) -> list[Offer]:
        """The usable offers of ``domain`` in the markets the policy allows now
        (:meth:`~daemon.control.policies.RecoveryPolicy.markets`, narrowed by a move in
        flight: :func:`~daemon.control.deadline.markets_for`); with ``mix_zones`` /
        ``mix_gpu_types`` off, only those in the zone / of the GPU type of the domain's
        oldest live node (the attempt's)."""
        dom = self._domains[domain]
        build, move_markets = self._building()
        allowed = markets_for(domain, build_domain=build, allowed=self.allowed, move_markets=move_markets)
        offers = in_markets((o for o in self._usable_offers() if o.index in dom.offers), allowed)
        if dom.mix_zones and dom.mix_gpu_types:
            return offers
        live = sorted((n for n in self.core.nodes.values()
                       if not n.state.is_terminal() and self.domain_of(n) == domain), key=lambda n: n.ordinal)
        if not live:
            return offers
        first, specs = live[0], self.core.config.offers
        gpu = next((o.gpu_type for o in specs if o.key == first.offer_key), None)
        return [o for o in offers
                if (dom.mix_zones or o.zone == first.zone)
                and (dom.mix_gpu_types or gpu is None or specs[o.index].gpu_type == gpu)]

    # -- spending to a deadline -------------------------------------------------------------------
    def refuse_a_late_start(self, now: float) -> None:
        """Before the job's first launch request, refuse an absolute ``job.deadline`` it
        cannot meet from ``now`` (unix s). A job already submitted is supervised on, late
        (``spotctl status`` says by how much): stopping its daemon would leave it unwatched.

        Raises:
            DeadlineError: the deadline, how far off it is, what the job needs, the fix.
        """
        core = self.core
        if core.config.job.deadline is None or core.store.events(kinds=[EventKind.NODE_LAUNCH_REQUESTED.value],
                                                                 limit=1):
            return
        problem = new_job_deadline_problem(core.config, now)
        if problem is not None:
            raise DeadlineError(problem)

    def progress(self, now: float) -> Progress | None:
        """Where the job stands against ``job.deadline`` (None: no deadline). The job was
        submitted at its first launch request; ``restart_s`` is what the config allows for
        a start (:data:`daemon.config.DEADLINE_START_S`); a pool of several nodes whose job
        grows in-process (``job.grow: in_process``) loses a node without a restart."""
        job = self.core.config.job
        if job.deadline is None or job.step_s is None:
            return None
        if self._submitted_at is None:
            first = self.core.store.events(kinds=[EventKind.NODE_LAUNCH_REQUESTED.value], limit=1)
            if not first:
                return None
            self._submitted_at = first[0].time
        deadline = job.deadline_at(self._submitted_at)
        assert deadline is not None
        step = self.core.job.step or 0
        return Progress(step=step, target_steps=job.target_steps, started_at=self._submitted_at,
                        deadline=deadline, step_s=job.step_s, restart_s=DEADLINE_START_S,
                        grows_in_process=job.grow == "in_process" and self.core.target_nodes > 1)

    def check_markets(self, now: float) -> list[Action]:
        """The markets the policy allows now, kept for :meth:`offers_in`; ``market_changed``
        on a change; the policy's actions for them (back on spot: on-demand nodes replaced)."""
        p = self.progress(now)
        allowed = self.core.policy.markets(p, now=now, previous=self.allowed)
        change = market_change(p, self.allowed, allowed, now=now, first=not self._markets_known)
        if change is not None:
            self.core.record(EventKind.MARKET_CHANGED, None, **change)
        self.allowed = allowed
        self._markets_known = self._markets_known or p is not None
        return self.core.policy.market_actions(self.core.state(), allowed, now=now)

    def status(self, now: float) -> dict[str, Any] | None:
        """``spotctl status``'s deadline line (:func:`~daemon.control.deadline.deadline_status`;
        None: no deadline)."""
        p = self.progress(now)
        return None if p is None else {**deadline_status(p, self.allowed, now=now), "policy": self.core.policy.name}
