"""Quota and permission errors at launch time: which offers sit out, and for how long.

An account limit (EC2 ``MaxSpotInstanceCountExceeded`` / ``VcpuLimitExceeded``, ECS
``QuotaExceed.*``) is per provider, region and instance family (the spot vCPU quotas
of EC2 are per family class: "All P Spot Instance Requests" and so on). A
:class:`~daemon.providers.base.QuotaError` therefore takes that **offer family** out
(``aws/us-east-1/p5``: every offer of the provider in that region whose instance type is
of that family), not the whole provider, and only for a backoff: 10 min, doubling on
each quota error in a row, at most 2 h; a successful launch in the family resets it.
An :class:`~daemon.providers.base.AuthError` (credentials refused, a permission missing)
takes the provider's offers out on the same schedule (family ``aws``). So a quota raised
or a permission granted is picked up without a restart, and the operator is told when
the family is tried again.

Example: p5 in us-east-1 hits its quota at t=0 → ``aws/us-east-1/p5`` sits out until
t=600; the retry at 600 hits it again → until 600+1200; a p5 launch succeeds later → the
next quota error starts again at 10 min. p4d offers in us-east-1 are bought meanwhile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

__all__ = ["FamilyBackoff", "instance_family", "offer_family", "quota_backoff_s", "after_error", "after_success",
           "QUOTA_BACKOFF_BASE_S", "QUOTA_BACKOFF_CAP_S"]

#: seconds: the first quota backoff, and the most any one is
QUOTA_BACKOFF_BASE_S, QUOTA_BACKOFF_CAP_S = 600.0, 7200.0
_MAX_EXPONENT = 4  # 600 x 2^4 = 9600 > 7200: capped from the fifth error on (no overflow however many)


@dataclass(frozen=True, slots=True)
class FamilyBackoff:
    """An offer family sitting out: ``failures`` quota/auth errors in a row, not used
    before ``until`` (unix s)."""

    failures: int
    until: float


def instance_family(instance_type: str) -> str:
    """The family of an instance type: EC2 ``p5.48xlarge`` → ``p5``, ``g6e.xlarge`` →
    ``g6e``; ECS ``ecs.gn7i-c32g1.8xlarge`` → ``gn7i``; anything else: the part before
    the first ``.``."""
    name = instance_type.removeprefix("ecs.")
    return re.split(r"[.-]", name, maxsplit=1)[0] or instance_type


def offer_family(provider: str, region: str, instance_type: str | None = None) -> str:
    """``provider/region/family`` (``aws/us-east-1/p5``); without an instance type, the
    provider alone (``aws``: what an auth error takes out)."""
    if instance_type is None:
        return provider
    return f"{provider}/{region}/{instance_family(instance_type)}"


def quota_backoff_s(failures: int) -> float:
    """Seconds a family sits out after ``failures`` errors in a row (1 for the first):
    600, 1200, 2400, 4800, then 7200 for good. Any int; below 1 counts as 1."""
    exponent = min(max(0, failures - 1), _MAX_EXPONENT)
    return min(QUOTA_BACKOFF_CAP_S, QUOTA_BACKOFF_BASE_S * 2 ** exponent)


def after_error(state: Mapping[str, FamilyBackoff], family: str, *, now: float) -> dict[str, FamilyBackoff]:
    """The backoffs after a quota (or auth) error in ``family`` at ``now`` (unix s): one
    more failure in a row, sitting out :func:`quota_backoff_s` from ``now``. An error while
    the family already sits out (a launch that was in flight when it went out) changes
    nothing: one quota episode is one step of the schedule. Pure."""
    prev = state.get(family)
    if prev is not None and prev.until > now:
        return dict(state)
    failures = (prev.failures if prev is not None else 0) + 1
    return {**state, family: FamilyBackoff(failures, now + quota_backoff_s(failures))}


def after_success(state: Mapping[str, FamilyBackoff], *families: str) -> dict[str, FamilyBackoff]:
    """The backoffs after a launch succeeded: ``families`` (the offer's family and its
    provider) start from nothing again. Pure."""
    return {k: v for k, v in state.items() if k not in families}
