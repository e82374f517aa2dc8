"""What the launches' outcomes say about the offers: one record per pool. No I/O.

:class:`OfferBook` keeps, per offer of the config (by index), its spot price, how long
it sits out after a capacity or provider error (capacity backoff:
:func:`daemon.control.offers.capacity_backoff_s`), the offer families sitting out a
quota or auth error (:mod:`daemon.control.quota`), and the zones that just had a node
noticed. :class:`~daemon.controlnode.fleet.Fleet` tells it each outcome and reads the
planner's :class:`~daemon.control.offers.History` from it.

Example: offer 0 refuses for capacity twice → ``capacity_refused(0, now)`` backs it off
36-420 s and then longer (``capacity_failures[0] == 2``); a launch of it succeeds →
``launched(0)`` clears the count and its family's quota backoff.
"""

from __future__ import annotations

import random
from typing import Iterable

from daemon.config import Config
from daemon.control import quota
from daemon.control.offers import History, Offer, capacity_backoff_s
from daemon.control.quota import offer_family
from daemon.model import Node

__all__ = ["OfferBook", "AVOID_ZONE_S"]

# a noticed node's zone is avoided by replacements this long (seconds)
AVOID_ZONE_S = 300.0


class OfferBook:
    """The offers' prices and backoffs (see the module docstring). Times are unix seconds."""

    def __init__(self, config: Config, *, rng: random.Random) -> None:
        self._offers = config.offers
        self._rng = rng
        self.prices: dict[int, float | None] = {}  # offer index → spot price (USD/hour; None: unknown)
        self.capacity_failures: dict[int, int] = {}  # offer index → capacity refusals in a row
        self._backoff: dict[int, float] = {}  # offer index → until when it is not used
        self._families: dict[str, quota.FamilyBackoff] = {}  # offer family → its quota/auth backoff
        self._avoid_zone: dict[str, float] = {}  # "provider/region/zone" → until when
        # offer index → its placement domain's placement group, launched into (None: none)
        self._groups = {i: d.placement_group for d in config.domains_resolved() for i in d.offers}

    def offer(self, i: int) -> Offer:
        """Offer ``i`` of the config, with its current spot price (USD/hour, None: unknown)."""
        o = self._offers[i]
        return Offer(index=i, provider=o.provider, region=o.region, zone=o.zone, instance_type=o.instance_type,
                     gpus_per_node=o.gpus_per_node, price_usd_h=self.prices.get(i),
                     max_price_usd_h=o.max_price_usd_h, on_demand=o.market == "on_demand",
                     placement_group=self._groups.get(i))

    def history(self, now: float, *, held: Iterable[int] = ()) -> History:
        """What recent outcomes say about offers; the offers of ``held`` are out for good."""
        return History(backoff_until={**self._backoff, **{i: float("inf") for i in held}},
                       avoid_zones=frozenset(z for z, until in self._avoid_zone.items() if until > now))

    def avoid_zone_of(self, node: Node, now: float) -> None:
        """A notice in ``node``'s zone: replacements prefer another for :data:`AVOID_ZONE_S`
        (SkyPilot's EAGER_NEXT_REGION, first retry)."""
        self._avoid_zone[f"{node.provider}/{node.region}/{node.zone or '-'}"] = now + AVOID_ZONE_S

    def capacity_refused(self, i: int, now: float) -> tuple[float, int]:
        """Offer ``i`` had no capacity: it backs off longer for each refusal in a row.
        Returns ``(seconds it sits out, refusals in a row)``."""
        n = self.capacity_failures.get(i, 0) + 1
        self.capacity_failures[i] = n
        wait = capacity_backoff_s(n, self._rng)
        self._backoff[i] = now + wait
        return wait, n

    def failed(self, i: int, now: float, *, keep_longer: bool = False) -> None:
        """A launch of offer ``i`` failed otherwise (a provider error, no agent wheel, a
        crash): it sits out one capacity backoff; ``keep_longer``: or longer if it already does."""
        until = now + capacity_backoff_s(1, self._rng)
        self._backoff[i] = max(self._backoff.get(i, 0.0), until) if keep_longer else until

    def launched(self, i: int) -> None:
        """A launch of offer ``i`` succeeded: its refusals and its family's backoff are over."""
        self.capacity_failures.pop(i, None)
        o = self._offers[i]
        self._families = quota.after_success(self._families, offer_family(o.provider, o.region, o.instance_type),
                                             o.provider)

    def family_out(self, offer: Offer, *, auth: bool, now: float) -> tuple[str, quota.FamilyBackoff | None]:
        """A quota error (``auth``: an auth error) at a launch of ``offer``: its family (its
        provider's offers, for an auth error) sits out (:func:`daemon.control.quota.after_error`),
        and so does every offer of it. Returns the family and its backoff; None: it already
        sat out (a launch in flight meanwhile), so the operator was told already."""
        family = offer_family(offer.provider, offer.region, None if auth else offer.instance_type)
        before = self._families.get(family)
        self._families = quota.after_error(self._families, family, now=now)
        out = self._families[family]
        if out == before:
            return family, None
        for i, o in enumerate(self._offers):
            if family in (o.provider, offer_family(o.provider, o.region, o.instance_type)):
                self._backoff[i] = max(self._backoff.get(i, 0.0), out.until)
        return family, out
