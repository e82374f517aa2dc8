"""Every counter and every exponent of the decision layer (daemon/control/) over its whole
input range (issue 25, item 13), with hypothesis.

A capacity outage can last days (a public V100 trace has zones short for most of a week),
so the counters that feed a decision (capacity failures in a row, preemptions in a window,
live nodes, steps) are drawn up to far past what a week produces, and the decisions taken
in sequence are replayed over days of simulated time. Each function must return a finite
value in its documented range (or ``inf`` where the docstring says so), and never raise.

The arithmetic covered (``grep -n '\\*\\*\\|exp\\|pow\\|+= 1' daemon/control/*.py``):
``offers.capacity_backoff_s`` (1.6 ** failures), ``pool.heartbeat_interval_s`` (nodes /
rate), ``pool.Timeouts.lost_after_s``, ``deadline.Progress.remaining_s`` and
``deadline.markets`` (steps x seconds, the uniform line), ``migration`` scores (price x
(1 + penalty x recent failures)) and ``move_cost_usd`` (bytes x USD/GB).
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.deadline import BOTH, ON_DEMAND_ONLY, SPOT_ONLY, Progress, markets
from daemon.control.migration import DomainView, choose_target, move_cost_usd
from daemon.control.offers import History, Offer, capacity_backoff_s
from daemon.control.pool import Timeouts, heartbeat_interval_s
from daemon.control.reports import MAX_BYTES

DAY_S = 86_400.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 60.0 * 0.6, 300.0 * 1.4  # the schedule's floor and cap, with +-40 % jitter
# any int: small ones, and ones far past a float's range (10^400), which st.integers() alone seldom draws
any_int = st.one_of(st.integers(min_value=-100, max_value=10**4), st.integers(min_value=-10**400, max_value=10**400))
seeds = st.integers(min_value=0, max_value=2**32 - 1)


class _Fixed(random.Random):
    """An rng whose jitter draw is always ``share`` of the way through its range."""

    def __init__(self, share: float) -> None:
        super().__init__(0)
        self.share = share

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.share


# -- offers.capacity_backoff_s: 60 s x 1.6^(failures-1), capped, jittered ---------------------

@settings(max_examples=500, deadline=None)
@given(failures=any_int, seed=seeds)
def test_the_capacity_backoff_is_bounded_for_any_count_of_failures(failures: int, seed: int) -> None:
    wait = capacity_backoff_s(failures, random.Random(seed))
    assert math.isfinite(wait) and BACKOFF_MIN_S <= wait <= BACKOFF_MAX_S


@settings(max_examples=300, deadline=None)
@given(a=any_int, b=any_int, share=st.floats(0.0, 1.0))
def test_the_capacity_backoff_never_shrinks_as_failures_grow(a: int, b: int, share: float) -> None:
    lo, hi = sorted((a, b))
    assert capacity_backoff_s(lo, _Fixed(share)) <= capacity_backoff_s(hi, _Fixed(share))


@settings(max_examples=25, deadline=None)
@given(days=st.floats(min_value=0.5, max_value=30.0), seed=seeds)
def test_an_outage_of_days_backs_off_within_bounds_at_every_retry(days: float, seed: int) -> None:
    """What Fleet does during an outage: every refusal counts one more failure in a row and
    waits the backoff; over up to 30 days (~8,600 retries of one offer) every wait stays
    in bounds and the retries keep coming at the cap (no wait grows without end)."""
    rng = random.Random(seed)
    t, failures = 0.0, 0
    while t < days * DAY_S:
        failures += 1
        wait = capacity_backoff_s(failures, rng)
        assert BACKOFF_MIN_S <= wait <= BACKOFF_MAX_S, (failures, wait)
        t += wait
    assert failures >= days * DAY_S / BACKOFF_MAX_S


# -- pool: the heartbeat interval and the lost-node timeout -----------------------------------

@settings(max_examples=300, deadline=None)
@given(nodes=st.integers(min_value=0, max_value=10**12), more=st.integers(min_value=0, max_value=10**12),
       min_s=st.floats(min_value=0.01, max_value=600.0), rate=st.floats(min_value=0.01, max_value=1e6))
def test_the_heartbeat_interval_is_finite_and_grows_with_the_pool(nodes: int, more: int, min_s: float,
                                                                  rate: float) -> None:
    now = heartbeat_interval_s(nodes, min_interval_s=min_s, max_per_second=rate)
    later = heartbeat_interval_s(nodes + more, min_interval_s=min_s, max_per_second=rate)
    assert math.isfinite(now) and math.isfinite(later)
    assert min_s <= now <= later


@settings(max_examples=300, deadline=None)
@given(told=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e9)),
       floor=st.floats(min_value=0.1, max_value=DAY_S), misses=st.floats(min_value=1.0, max_value=100.0),
       grace=st.floats(min_value=0.0, max_value=DAY_S))
def test_the_lost_node_timeout_is_finite_and_never_below_its_floor(told: float | None, floor: float, misses: float,
                                                                   grace: float) -> None:
    t = Timeouts(heartbeat_timeout_s=floor, heartbeat_misses=misses, heartbeat_grace_s=grace)
    after = t.lost_after_s(told)
    assert math.isfinite(after) and after >= floor
    if told is not None:
        assert after >= misses * told


# -- deadline: steps x seconds and the uniform line -------------------------------------------

progress = st.builds(
    Progress,
    step=st.integers(min_value=0, max_value=2**63 - 1),  # as far as SQLite (the store) keeps an integer
    target_steps=st.integers(min_value=1, max_value=2**63 - 1),
    started_at=st.floats(min_value=0.0, max_value=2e9),
    deadline=st.floats(min_value=0.0, max_value=2e9 + 365 * DAY_S),
    step_s=st.floats(min_value=0.0, max_value=DAY_S),
    restart_s=st.floats(min_value=0.0, max_value=DAY_S),
)


@settings(max_examples=500, deadline=None)
@given(p=progress, offset=st.floats(min_value=-365 * DAY_S, max_value=365 * DAY_S),
       previous=st.sampled_from([None, SPOT_ONLY, BOTH, ON_DEMAND_ONLY]))
def test_the_deadline_policy_answers_a_market_set_for_any_progress(p: Progress, offset: float,
                                                                   previous: frozenset[str] | None) -> None:
    now = p.started_at + offset
    left = p.remaining_s()
    assert math.isfinite(left) and left >= 0
    allowed = markets(p, now, previous=previous)
    assert allowed in (SPOT_ONLY, BOTH, ON_DEMAND_ONLY)
    if p.step < p.target_steps and p.deadline - now <= left:
        assert allowed == ON_DEMAND_ONLY  # no time left for anything but the safety net


@settings(max_examples=20, deadline=None)
@given(p=progress, days=st.integers(min_value=1, max_value=14))
def test_the_deadline_policy_over_days_of_passes(p: Progress, days: int) -> None:
    """One decision per 5-minute pass over days, each fed the last answer (the hysteresis)."""
    allowed: frozenset[str] | None = None
    for k in range(days * 288):
        allowed = markets(p, p.started_at + k * 300.0, previous=allowed)
        assert allowed in (SPOT_ONLY, BOTH, ON_DEMAND_ONLY)


# -- migration: recent failures in the score, bytes in the egress -----------------------------

def _domain(name: str, price: float | None, preemptions: int, failures: int) -> DomainView:
    offer = Offer(index=0 if name == "a" else 1, provider="p", region=name, zone=None, instance_type="t",
                  gpus_per_node=8, price_usd_h=price)
    return DomainView(name, (offer,), egress_usd_per_gb=0.09, preemptions=preemptions, capacity_failures=failures)


# a window's preemptions / capacity failures: any count, up to far past a float's range
counts = st.one_of(st.integers(min_value=0, max_value=100), st.integers(min_value=0, max_value=10**400))


@settings(max_examples=300, deadline=None)
@given(price=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e4)), pre=counts, fail=counts,
       more=counts, nbytes=st.one_of(st.none(), st.integers(min_value=0, max_value=MAX_BYTES)),
       payback_h=st.floats(min_value=0.0, max_value=1e4), gpus=st.integers(min_value=0, max_value=10**6))
def test_a_domains_score_is_defined_for_any_count_of_recent_failures(price: float | None, pre: int, fail: int,
                                                                     more: int, nbytes: int | None, payback_h: float,
                                                                     gpus: int) -> None:
    here = _domain("a", 1.0, 0, 0)
    calm, rough = _domain("b", price, pre, fail), _domain("b", price, pre + more, fail)
    picked = choose_target([here, calm], "a", History(), now=0.0, checkpoint_bytes=nbytes, payback_h=payback_h,
                           gpus=gpus)
    assert picked is not None and picked[0].name == "b"
    scores = [choose_target([here, d], "a", History(), now=0.0, checkpoint_bytes=nbytes, payback_h=payback_h,
                            gpus=gpus)[1]["candidates"]["b"] for d in (calm, rough)]  # type: ignore[index]
    for s in scores:
        assert s is None or (math.isfinite(s) and s >= 0)  # None: the price is unknown (inf)
    if None not in scores:
        assert scores[0] <= scores[1]  # more recent failures never make a domain look better
    cost = move_cost_usd(nbytes, here)
    assert math.isfinite(cost) and cost >= 0
