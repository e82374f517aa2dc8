"""Placement domains and markets at the edge: which domain a node is in, which offers the
planner may buy from (the job's domain, the markets the recovery policy allows: a job
with ``job.deadline`` spends to it, :mod:`daemon.control.deadline`), and which nodes sit
outside the job's network.

One job, one network: a job attempt's nodes share one placement domain
(:meth:`daemon.config.Config.domains_resolved`). The planner buys only from the domain
it builds in (:attr:`Migrator.build_domain`: the job's, or a migration's target), and
with ``mix_zones`` / ``mix_gpu_types`` off only in the zone / of the GPU type of the
attempt's first node; admission admits only nodes of the job's domain
(:meth:`daemon.control.actions.PoolState.in_domain`).
"""

from __future__ import annotations

from typing import Any

from daemon.config import DEADLINE_START_S
from daemon.control.actions import Action, Terminate
from daemon.control.deadline import Progress, in_markets
from daemon.control.offers import Offer
from daemon.controlnode.core import Core
from daemon.model import EventKind, Node

__all__ = ["Placement"]


class Placement:
    """Domains of nodes and offers for one pool."""

    def __init__(self, core: Core, migrator: Any, fleet: Any) -> None:
        self.core, self.migrator, self.fleet = core, migrator, fleet
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
        (:meth:`~daemon.control.policies.RecoveryPolicy.markets`); with ``mix_zones`` /
        ``mix_gpu_types`` off, only those in the zone / of the GPU type of the domain's
        oldest live node (the attempt's)."""
        dom = self._domains[domain]
        allowed = self.migrator.build_markets() if domain == self.migrator.build_domain else self.allowed
        offers = in_markets((o for o in self.fleet.usable_offers() if o.index in dom.offers), allowed)
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
    def progress(self, now: float) -> Progress | None:
        """Where the job stands against ``job.deadline`` (None: no deadline). The job was
        submitted at its first launch request; ``restart_s`` is what the config allows for
        a start (:data:`daemon.config.DEADLINE_START_S`)."""
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
                        deadline=deadline, step_s=job.step_s, restart_s=DEADLINE_START_S)

    def check_markets(self, now: float) -> list[Action]:
        """The markets the policy allows now, kept for :meth:`offers_in`; ``market_changed``
        on a change; the policy's actions for them (back on spot: on-demand nodes replaced)."""
        p = self.progress(now)
        allowed = self.core.policy.markets(p, now=now, previous=self.allowed)
        if allowed != self.allowed:
            if p is not None and self._markets_known:  # (the first answer is no change)
                self.core.record(EventKind.MARKET_CHANGED, None, old=_names(self.allowed), new=_names(allowed),
                                 step=p.step, target_steps=p.target_steps,
                                 hours_to_deadline=round((p.deadline - now) / 3600, 2),
                                 hours_of_work_left=round(p.remaining_s() / 3600, 2))
            self.allowed = allowed
        self._markets_known = self._markets_known or p is not None
        return self.core.policy.market_actions(self.core.state(), allowed, now=now)

    def status(self, now: float) -> dict[str, Any] | None:
        """``spotctl status``'s deadline line: the deadline, the work left, the expected
        finish (unix s: the work left at the target size from now) and the slack it leaves
        before the deadline (hours, negative: late), the markets."""
        p = self.progress(now)
        if p is None:
            return None
        finish = now + p.remaining_s()  # at the target size from now on, at job.step_s
        return {"deadline": p.deadline, "hours_to_deadline": round((p.deadline - now) / 3600, 2),
                "hours_of_work_left": round(p.remaining_s() / 3600, 2), "expected_finish": finish,
                "slack_h": round((p.deadline - finish) / 3600, 2), "markets": _names(self.allowed)}

    def strays(self, but: set[str] = frozenset()) -> list[Terminate]:  # type: ignore[assignment]
        """Nodes of a domain that is neither the job's nor a migration's (other than ``but``,
        released already): released. They come from a daemon restarted during a move, or a
        config whose domains changed."""
        keep = {self.migrator.domain, self.migrator.build_domain}
        if self.migrator.move is not None:
            keep.add(self.migrator.move.source)
        return [Terminate(n.id, "outside_the_job_domain") for n in self.core.nodes.values()
                if not n.state.is_terminal() and self.domain_of(n) not in keep and n.id not in but]


def _names(markets: frozenset[str] | None) -> list[str] | None:
    return None if markets is None else sorted(markets)
