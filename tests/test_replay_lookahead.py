"""bench/replay/lookahead.py: model-predictive control with the optimum's DP, in the tick model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.replay.lookahead import LookAhead, runs
from bench.replay.optimum import optimal, optimum
from bench.replay.tickmodel import SPOT, Mode, OnDemand, TickJob, TickMarket, simulate


def test_runs_are_the_lengths_of_each_state() -> None:
    up, down = runs(np.array([1, 1, 0, 0, 0, 1, 0], dtype=bool))
    assert up == [2, 1] and down == [3, 1]
    assert runs(np.array([], dtype=bool)) == ([], [])


def test_a_zone_always_up_in_the_past_stays_up_and_one_never_up_stays_down() -> None:
    past = np.array([[True] * 50, [False] * 50])
    la = LookAhead(past, seed=3)
    la.seen.append(np.array([True, False]))
    fut = la._sample(la._history(), 40)
    assert fut[0].all() and not fut[1].any()


def test_with_spot_throughout_in_one_zone_it_buys_it_from_the_start_at_the_optimum() -> None:
    avail = np.array([[True] * 30, [False] * 30])
    m = TickMarket(("us-east-1a", "us-west-2a"), avail, np.array([[1.0] * 30, [0.5] * 30]), 100.0, 3.0)
    job = TickJob(task_s=1000, deadline_s=3000, overhead_s=150, checkpoint_gb=0)
    r = simulate(m, job, LookAhead(np.array([[True] * 30, [False] * 30]), coarse=1))
    assert r.done and r.modes[0] == Mode(SPOT, 0) and r.launches == 1
    assert r.cost_usd == pytest.approx(optimal(m, job).cost_usd)


@st.composite
def markets(draw):
    z = draw(st.integers(1, 3))
    t = draw(st.integers(6, 30))
    avail = np.array(draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=z, max_size=z)))
    price = np.array(draw(st.lists(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=t, max_size=t),
                                   min_size=z, max_size=z)))
    zones = ("us-east-1a", "us-east-2a", "us-west-2a")[:z]
    job = TickJob(task_s=draw(st.floats(50, 100.0 * t)), deadline_s=100.0 * t, overhead_s=draw(st.floats(0, 250)),
                  checkpoint_gb=draw(st.floats(0, 60)))
    past = np.array(draw(st.lists(st.lists(st.booleans(), min_size=8, max_size=8), min_size=z, max_size=z)))
    return TickMarket(zones, avail, price, 100.0, 3.0), job, past


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(markets(), st.integers(0, 1000), st.sampled_from([1, 2]))
def test_lookahead_meets_every_deadline_on_demand_meets_and_never_beats_the_optimum(mjp, seed, coarse) -> None:
    m, job, past = mjp
    od = simulate(m, job, OnDemand(), safety_net=False)
    r = simulate(m, job, LookAhead(past, samples=2, every=5, coarse=coarse, seed=seed))
    assert r.done or not od.done
    if r.done:
        assert optimum(m, job).cost_usd <= r.cost_usd + 1e-9
