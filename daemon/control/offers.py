"""Offers: the ways to buy a node, and how they are ranked.

An offer (from the config's ``offers:``) names a provider, a place (region, zone),
an instance type, its GPUs and a price cap. :func:`rank_offers` orders the usable
ones for the planner:

1. offers in capacity backoff are out (:func:`capacity_backoff_s`), as are offers
   whose current spot price is above their cap;
2. on-demand offers are a fallback, used only when no spot offer is usable;
3. offers in a zone that just preempted a node come last (SkyPilot's
   EAGER_NEXT_REGION: the first retry goes elsewhere when it can);
4. then cheapest per GPU-hour, config order breaking ties.

World-size validity (ElasticBatch) is the planner's part: it picks the best-ranked
offer whose GPUs keep the world size valid.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = ["Offer", "History", "offer_key", "rank_offers", "capacity_backoff_s"]


def offer_key(provider: str, region: str, zone: str | None, instance_type: str, market: str) -> str:
    """An offer's stable name, ``provider/region/zone/instance_type/market`` (``-`` for no zone),
    e.g. ``aws/us-east-1/us-east-1a/p4d.24xlarge/spot``. Each node keeps the key of the
    offer it was bought from, so reordering ``offers:`` in the config never remaps a node."""
    return f"{provider}/{region}/{zone or '-'}/{instance_type}/{market}"


@dataclass(frozen=True, slots=True)
class Offer:
    """A way to buy a node. ``price_usd_h``: current spot price (None = unknown).

    ``index``: its position in this daemon's ``config.offers`` (the planner's handle,
    never stored); :attr:`key` is the stable name nodes keep."""

    index: int
    provider: str
    region: str
    zone: str | None
    instance_type: str
    gpus_per_node: int
    price_usd_h: float | None = None
    max_price_usd_h: float | None = None
    on_demand: bool = False  # an on-demand fallback offer (used only when no spot offer is usable)
    # its placement domain's placement group (AWS cluster placement group, Alibaba deployment set)
    placement_group: str | None = None

    @property
    def key(self) -> str:
        return offer_key(self.provider, self.region, self.zone, self.instance_type,
                         "on_demand" if self.on_demand else "spot")

    @property
    def zone_key(self) -> str:
        return f"{self.provider}/{self.region}/{self.zone or '-'}"

    def usd_per_gpu_h(self) -> float:
        if self.price_usd_h is None:
            return float("inf")
        return self.price_usd_h / self.gpus_per_node


@dataclass(frozen=True, slots=True)
class History:
    """What recent outcomes say about offers.

    ``backoff_until[offer_index]``: unix s until which the offer is not used (capacity
    errors, an offer family's quota backoff: :mod:`daemon.control.quota`, a failed cloud check's retry).
    ``avoid_zones``: zone keys (``Offer.zone_key``) just preempted: offers there are
    ranked last, not excluded, so the first replacement goes elsewhere when it can.
    """

    backoff_until: Mapping[int, float] = field(default_factory=dict)
    avoid_zones: frozenset[str] = frozenset()


def rank_offers(offers: Sequence[Offer], history: History, *, now: float) -> list[Offer]:
    """Offers usable now, cheapest per GPU-hour first (config order breaks ties);
    offers in a just-preempted zone come after all others.

    An offer is unusable while in backoff, or when its spot price is above its cap.
    Example: a notice in aws/us-east-1/us-east-1a → the replacement is the cheapest
    offer outside us-east-1a, or us-east-1a itself if nothing else is usable.
    """
    usable = [
        o
        for o in offers
        if history.backoff_until.get(o.index, 0.0) <= now
        and not (o.max_price_usd_h is not None and o.price_usd_h is not None and o.price_usd_h > o.max_price_usd_h)
    ]
    # on-demand offers are a fallback: only when no spot offer can be used now
    spot = [o for o in usable if not o.on_demand]
    return sorted(spot or usable, key=lambda o: (o.zone_key in history.avoid_zones, o.usd_per_gpu_h(), o.index))


# the capacity backoff (SkyPilot's managed-jobs schedule): seconds, growth per failure, cap
_BACKOFF_BASE_S, _BACKOFF_GROWTH, _BACKOFF_CAP_S = 60.0, 1.6, 300.0
# the exponent at which the schedule reaches its cap (60 x 1.6^4 = 393 s > 300 s): the
# exponent never goes past it, so no count of failures overflows the power
_BACKOFF_MAX_EXPONENT = math.ceil(math.log(_BACKOFF_CAP_S / _BACKOFF_BASE_S, _BACKOFF_GROWTH))


def capacity_backoff_s(failures: int, rng: random.Random) -> float:
    """How long an offer that ran out of capacity sits out, in seconds: in
    [36, 420] for any ``failures`` (the count of capacity errors in a row, 1 for the
    first; any int, however long the outage has lasted).

    SkyPilot's managed-jobs schedule: 60 s x 1.6^(failures-1), capped at 300 s, with
    +-40 % jitter so many pools do not retry in step. Example: failures 1, 2, 3, 4, 5,
    1,600 (five days at the cap) → 60, 96, 153.6, 245.8, 300, 300 s before jitter.
    """
    exponent = min(max(0, failures - 1), _BACKOFF_MAX_EXPONENT)
    base = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * _BACKOFF_GROWTH ** exponent)
    return base * (1.0 + rng.uniform(-0.4, 0.4))
