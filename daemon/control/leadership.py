"""Who leads the pool, and whether it may act now: decide-then-act over an etcd lease. Pure.

Two or three daemons (one per control node) run the same loop; the edge
(:mod:`daemon.ha.elector`) turns what etcd answered into an :class:`Observation`,
calls :func:`decide` with the daemon's monotonic clock, and carries out the
:class:`Action` values it returns. Nothing here does I/O or reads a clock.

The protocol (etcd's own election recipe, made explicit):

1. ``GrantLease``: a lease with ``ttl_s`` (default 5 s).
2. ``Campaign``: a txn ``create_revision(/spotvisor/<pool>/leader) == 0`` → put the
   key under the lease; otherwise read it. A candidate campaigns every
   ``campaign_every_s`` (the poll: the bound when nothing else says the key went) and at
   once on ``LeaderKeyGone`` (the edge's watch on the key saw it deleted). Won: the **fence token** is the key's
   ``create_revision`` (unique per creation, growing: etcd's revision counter). A
   campaign that failed but shows the key under *our* lease is a win whose answer
   was lost earlier (the txn applied, its reply did not arrive).
3. ``KeepAlive`` every ``renew_every_s``. What keeps the lease is the *time the
   request was sent*: etcd refreshed it after that moment, so in etcd's time the
   lease lives at least until ``sent_at + ttl``.
4. **May act** (:func:`may_act`) only while ``now < deadline`` where
   ``deadline = confirmed_at + ttl_s * (1 - max_drift) - act_margin_s``:
   ``confirmed_at`` is the send time of the last grant or keepalive that etcd
   answered with the TTL, ``max_drift`` bounds how much slower this clock may run
   than etcd's (0.05: 5 %), ``act_margin_s`` is the longest an action may take
   between the check and its fenced txn. A leader that reaches the deadline
   without a fresh answer (its keepalives lost, its process paused) stops acting
   and starts over with a new lease: it never acts on a lease that may have
   expired. Even so, every act is a txn fenced by the token
   (:mod:`daemon.ha.fence`): etcd itself refuses a deposed leader.

Example: ttl 5 s, renew every 1.5 s, drift 5 %, margin 0.5 s. The leader's keepalive
sent at t=10 is answered; deadline 10 + 4.75 - 0.5 = 14.25. Its process is stopped
at t=11 and resumed at t=20: the first Tick at t=20 is past 14.25 → it drops to
follower (``RevokeLease`` of the old lease, best effort; ``GrantLease`` anew).
Meanwhile etcd expired its lease at >= 15, the key went with it, and the standby
(campaigning every ``campaign_every_s``) won at ~15.x with a larger fence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

__all__ = [
    "Role", "LeaderConfig", "LeaderState", "Observation", "Tick", "LeaseGranted", "LeaseRenewed",
    "LeaseLost", "CampaignWon", "CampaignLost", "LeaderKeyGone", "FenceRejected", "Failed", "Stop",
    "Action", "GrantLease", "Campaign", "KeepAlive", "RevokeLease", "Decision", "decide", "may_act", "why_lost",
    "deadline", "INITIAL", "STALL_S",
]


class Role(enum.StrEnum):
    """Where a daemon stands. FOLLOWER → (lease granted) CANDIDATE → (campaign won)
    LEADER → (deadline passed, fence rejected, key gone, stop) FOLLOWER."""

    FOLLOWER = "follower"  # no usable lease: asks for one
    CANDIDATE = "candidate"  # holds a lease, campaigns for the key (a standby)
    LEADER = "leader"  # holds the key under its lease: may act until the deadline
    STOPPED = "stopped"  # shut down: nothing more


@dataclass(frozen=True, slots=True)
class LeaderConfig:
    """Timings, in seconds (``max_drift``: a fraction). Raises ``ValueError`` naming a bad one."""

    ttl_s: float = 5.0
    renew_every_s: float = 1.5
    campaign_every_s: float = 0.5
    max_drift: float = 0.05
    act_margin_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.ttl_s >= 2:
            raise ValueError(f"ttl_s must be >= 2 s (etcd's minimum lease TTL rounds up), got {self.ttl_s}")
        if not 0 < self.renew_every_s < self.ttl_s / 2:
            raise ValueError(f"renew_every_s must be in (0, ttl_s/2), got {self.renew_every_s}")
        if not 0 < self.campaign_every_s <= self.ttl_s:
            raise ValueError(f"campaign_every_s must be in (0, ttl_s], got {self.campaign_every_s}")
        if not 0 <= self.max_drift < 0.5:
            raise ValueError(f"max_drift must be in [0, 0.5), got {self.max_drift}")
        if not 0 <= self.act_margin_s < self.ttl_s * (1 - self.max_drift) - self.renew_every_s:
            raise ValueError(f"act_margin_s must leave room for a renewal inside the TTL, got {self.act_margin_s}")


@dataclass(frozen=True, slots=True)
class LeaderState:
    role: Role = Role.FOLLOWER
    lease_id: int | None = None
    ttl_s: float = 0.0  # the TTL etcd last reported for the lease
    confirmed_at: float | None = None  # send time of the last answered grant/keepalive (monotonic s)
    fence: int | None = None  # the leader key's create_revision while LEADER
    asked_at: float | None = None  # when the pending grant/campaign/keepalive was sent (one at a time)
    last_campaign_at: float | None = None


INITIAL = LeaderState()

#: seconds without a step of the edge's loop (idle tick ~0.1 s) that mean the daemon's own
#: process was blocked or starved, not etcd slow (:func:`why_lost`, the edge's warning)
STALL_S = 1.0


# -- what the edge observed -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed (the edge ticks every ~0.1 s and after each answer)."""


@dataclass(frozen=True, slots=True)
class LeaseGranted:
    lease_id: int
    ttl_s: float
    sent_at: float


@dataclass(frozen=True, slots=True)
class LeaseRenewed:
    """A keepalive's answer: ``ttl_s`` <= 0 means etcd no longer knows the lease."""

    lease_id: int
    ttl_s: float
    sent_at: float


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """The lease is gone (keepalive: not found), or a request about it failed."""

    lease_id: int


@dataclass(frozen=True, slots=True)
class CampaignWon:
    lease_id: int
    create_revision: int


@dataclass(frozen=True, slots=True)
class CampaignLost:
    """The key exists: ``holder_lease`` and its ``create_revision``."""

    lease_id: int
    holder_lease: int
    create_revision: int


@dataclass(frozen=True, slots=True)
class LeaderKeyGone:
    """The watch saw the leader key deleted (its lease expired or was revoked) at etcd
    revision ``revision`` (0: unknown). A deletion older than this daemon's own key (its
    ``revision`` below the fence: the key this daemon created came after it) is about an
    earlier leader, delivered late: it deposes nobody."""

    revision: int = 0


@dataclass(frozen=True, slots=True)
class FenceRejected:
    """A fenced txn failed its compare: the key is not ours with this fence any more."""

    fence: int


@dataclass(frozen=True, slots=True)
class Failed:
    """A request (grant, campaign, keepalive) failed or timed out: try again later."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Shut down: step down if leading."""


Observation = Tick | LeaseGranted | LeaseRenewed | LeaseLost | CampaignWon | CampaignLost | LeaderKeyGone | \
    FenceRejected | Failed | Stop


# -- what the edge does -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GrantLease:
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Campaign:
    lease_id: int


@dataclass(frozen=True, slots=True)
class KeepAlive:
    lease_id: int


@dataclass(frozen=True, slots=True)
class RevokeLease:
    """Best effort: deletes the leader key with it, so a standby need not wait the TTL."""

    lease_id: int


Action = GrantLease | Campaign | KeepAlive | RevokeLease


@dataclass(frozen=True, slots=True)
class Decision:
    state: LeaderState
    actions: tuple[Action, ...]
    may_act: bool


def deadline(state: LeaderState, cfg: LeaderConfig) -> float | None:
    """The last moment (this clock) a leader may start an act; None without a lease."""
    if state.confirmed_at is None or state.lease_id is None:
        return None
    return state.confirmed_at + state.ttl_s * (1 - cfg.max_drift) - cfg.act_margin_s


def may_act(state: LeaderState, now: float, cfg: LeaderConfig) -> bool:
    """LEADER, with a fence, before :func:`deadline`."""
    end = deadline(state, cfg)
    return state.role is Role.LEADER and state.fence is not None and end is not None and now < end


def _drop(state: LeaderState, now: float, cfg: LeaderConfig, *, revoke: bool) -> Decision:
    """Back to FOLLOWER, asking for a new lease (the old one revoked if it may live)."""
    acts: list[Action] = []
    if revoke and state.lease_id is not None:
        acts.append(RevokeLease(state.lease_id))
    acts.append(GrantLease(cfg.ttl_s))
    return Decision(LeaderState(role=Role.FOLLOWER, asked_at=now), tuple(acts), False)


def _pending(state: LeaderState, now: float, cfg: LeaderConfig) -> bool:
    """A request is in flight and not yet overdue (one renewal period)."""
    return state.asked_at is not None and now - state.asked_at < cfg.renew_every_s


def _tick(state: LeaderState, now: float, cfg: LeaderConfig) -> Decision:
    if state.role is Role.STOPPED:
        return Decision(state, (), False)
    end = deadline(state, cfg)
    if state.role is Role.FOLLOWER or end is None:
        if _pending(state, now, cfg):
            return Decision(state, (), False)
        return Decision(replace(state, role=Role.FOLLOWER, asked_at=now), (GrantLease(cfg.ttl_s),), False)
    if now >= end:  # the lease may be gone by now: never act on it
        return _drop(state, now, cfg, revoke=True)
    acts: list[Action] = []
    asked = state.asked_at
    if now - state.confirmed_at >= cfg.renew_every_s and not _pending(state, now, cfg):
        acts.append(KeepAlive(state.lease_id))
        asked = now
    last = state.last_campaign_at
    if state.role is Role.CANDIDATE and (last is None or now - last >= cfg.campaign_every_s):
        acts.append(Campaign(state.lease_id))
        last = now
    new = replace(state, asked_at=asked, last_campaign_at=last)
    return Decision(new, tuple(acts), may_act(new, now, cfg))


def why_lost(state: LeaderState, obs: Observation, now: float, *, stalled_s: float = 0.0) -> str:
    """Why a leader in ``state`` stops leading on ``obs`` at ``now``, in words for the
    operator's log (the deposition's reason; a loss on a ``Tick`` is otherwise silent:
    no request failed, its answers were just too late). ``stalled_s``: how long the
    edge's loop had not run before this step (seconds; its idle tick is ~0.1 s): at
    ``STALL_S`` or more the daemon's own process was blocked or starved, which no etcd
    tuning mends, and the words say so."""
    ago = f"{now - state.confirmed_at:.1f} s ago" if state.confirmed_at is not None else "never"
    if isinstance(obs, LeaseRenewed):
        return "etcd no longer knows the lease (it expired there)"
    if isinstance(obs, LeaseLost):
        return "the lease is gone"
    if isinstance(obs, CampaignLost):
        return "another daemon holds the leader key"
    if isinstance(obs, FenceRejected):
        return f"a fenced write was refused (fence {obs.fence}: the key is not this daemon's any more)"
    if isinstance(obs, LeaderKeyGone):
        return f"the leader key was deleted (revision {obs.revision}): the lease was revoked or expired"
    if isinstance(obs, Stop):
        return "stopped"
    # every other observation deposes only through the clock (_tick: the lease's deadline
    # passed): on a Tick no request failed, its answers were too late; on a Failed the
    # requests themselves failed (a partition: etcd out of reach)
    failed = "; the last request to etcd failed" if isinstance(obs, Failed) else ""
    if stalled_s >= STALL_S:
        return (f"no keepalive answered in time (lease {state.ttl_s:g} s, last confirmed {ago}{failed}; "
                f"this daemon's own loop had not run for {stalled_s:.1f} s): this host too slow, "
                "or this process paused or blocked")
    pending = (f"; none answered since, the last sent {now - state.asked_at:.1f} s ago"
               if state.asked_at is not None and not failed else "")
    return (f"no keepalive answered in time (lease {state.ttl_s:g} s, last confirmed {ago}{failed}{pending}): "
            "etcd or this host too slow, or etcd out of reach")


def decide(state: LeaderState, obs: Observation, now: float, cfg: LeaderConfig) -> Decision:
    """One step: the new state, the actions to carry out, and whether this daemon may act
    (start a purchase, termination or admission) at ``now`` (monotonic seconds)."""
    if isinstance(obs, Stop):
        acts = (RevokeLease(state.lease_id),) if state.lease_id is not None else ()
        return Decision(LeaderState(role=Role.STOPPED), acts, False)
    if state.role is Role.STOPPED:
        return Decision(state, (), False)
    if isinstance(obs, LeaseGranted):
        if state.lease_id is not None:  # a late answer: this one is not needed
            return Decision(state, (RevokeLease(obs.lease_id),), may_act(state, now, cfg))
        new = LeaderState(role=Role.CANDIDATE, lease_id=obs.lease_id, ttl_s=obs.ttl_s,
                          confirmed_at=obs.sent_at, last_campaign_at=now)
        return Decision(new, (Campaign(obs.lease_id),), False)
    if isinstance(obs, (LeaseRenewed, LeaseLost, CampaignWon, CampaignLost)) and obs.lease_id != state.lease_id:
        return _tick(state, now, cfg)  # about a lease we dropped
    if isinstance(obs, LeaseRenewed):
        if obs.ttl_s <= 0:
            return _drop(state, now, cfg, revoke=False)
        confirmed = obs.sent_at if state.confirmed_at is None else max(state.confirmed_at, obs.sent_at)
        return _tick(replace(state, ttl_s=obs.ttl_s, confirmed_at=confirmed, asked_at=None), now, cfg)
    if isinstance(obs, LeaseLost):
        return _drop(state, now, cfg, revoke=False)
    if isinstance(obs, CampaignWon):
        return _tick(replace(state, role=Role.LEADER, fence=obs.create_revision), now, cfg)
    if isinstance(obs, CampaignLost):
        if obs.holder_lease == state.lease_id:  # our earlier campaign applied; its answer was lost
            return _tick(replace(state, role=Role.LEADER, fence=obs.create_revision), now, cfg)
        if state.role is Role.LEADER:  # the key is someone else's: we were deposed
            return _drop(state, now, cfg, revoke=True)
        return _tick(state, now, cfg)
    if isinstance(obs, FenceRejected):
        if state.role is Role.LEADER and obs.fence == state.fence:
            return _drop(state, now, cfg, revoke=True)
        return _tick(state, now, cfg)
    if isinstance(obs, LeaderKeyGone):
        if state.role is Role.LEADER and state.fence is not None and 0 < obs.revision < state.fence:
            return _tick(state, now, cfg)  # an earlier leader's key, reported late (ours was created after)
        if state.role is Role.LEADER:  # our key went: the lease is gone or revoked
            return _drop(state, now, cfg, revoke=True)
        if state.role is Role.CANDIDATE and state.lease_id is not None:
            new = replace(state, last_campaign_at=now)
            return Decision(new, (Campaign(state.lease_id),), False)
        return _tick(state, now, cfg)
    if isinstance(obs, Failed):
        return _tick(replace(state, asked_at=None), now, cfg)
    return _tick(state, now, cfg)
