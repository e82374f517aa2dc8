"""bench/replay/optimum.py: the offline optimum (a DP over the whole future), and a pool's bound."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.replay.optimum import optimal, optimum, pool_bound
from bench.replay.tickmodel import (OD, SPOT, Mode, OnDemand, PlanPolicy, TickJob, TickMarket, TickView,
                                    UniformProgress, simulate)
from bench.replay.traces import Trace, ZoneSeries, load_trace

from tests.test_replay_tickmodel import V100, V100_JOB, WINDOWS, ZONES, PUBLISHED_UP_S

# research/data/v100.csv of andylizf/skynomad-artifact @ 4dc5ecb: its Optimal, USD per window
PUBLISHED_OPTIMAL = (37.741275, 37.542375, 36.995400, 37.194300, 37.393200)  # mean 37.373310
GAP = 100.0
TWO_REGIONS = ("us-east-1a", "us-west-2a")


@st.composite
def small_markets(draw, max_ticks: int = 5, aligned: bool = True):
    """1-2 zones in two regions, 2-``max_ticks`` ticks of 100 s; spot $0.5-2/h, on-demand $3/h.
    ``aligned``: overheads, copies and work in whole ticks (the DP is then exact)."""
    z = draw(st.integers(1, 2))
    t = draw(st.integers(2, max_ticks))
    avail = np.array(draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=z, max_size=z)))
    price = np.array(draw(st.lists(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=t, max_size=t),
                                   min_size=z, max_size=z)))
    m = TickMarket(TWO_REGIONS[:z], avail, price, GAP, on_demand_usd_h=3.0)
    if aligned:
        job = TickJob(task_s=GAP * draw(st.integers(1, 3)), deadline_s=GAP * t,
                      overhead_s=GAP * draw(st.integers(0, 2)), checkpoint_gb=50.0,
                      copy_gb_s=draw(st.sampled_from([0.5, 0.25])), egress_usd_per_gb=0.02)
    else:
        job = TickJob(task_s=draw(st.floats(30, 3 * GAP)), deadline_s=GAP * t - draw(st.floats(0, 50)),
                      overhead_s=draw(st.floats(0, 2.5 * GAP)), checkpoint_gb=draw(st.floats(0, 60)))
    return m, job


def every_plan(m: TickMarket):
    choices = [[None] + [Mode(OD, z) for z in range(len(m.zones))]
               + [Mode(SPOT, z) for z in range(len(m.zones)) if m.avail[z, t]] for t in range(m.ticks)]
    return itertools.product(*choices)


def brute_force(m: TickMarket, job: TickJob) -> float:
    best = math.inf
    for plan in every_plan(m):
        r = simulate(m, job, PlanPolicy(list(plan), name="plan"), safety_net=False)
        if r.done and r.done_tick <= m.ticks:
            best = min(best, r.cost_usd)
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_markets())
def test_the_dp_is_the_cheapest_of_every_schedule_when_overheads_are_whole_ticks(mj) -> None:
    m, job = mj
    expected = brute_force(m, job)
    for bound in (True, False):
        got = optimum(m, job, bound=bound)
        assert got.cost_usd == pytest.approx(expected) if math.isfinite(expected) else not got.feasible
    if math.isfinite(expected):  # and its schedule costs that
        r = simulate(m, job, PlanPolicy(optimum(m, job).plan), safety_net=False)
        assert r.done and r.cost_usd == pytest.approx(expected)


class RandomPolicy:
    """A seeded random walk over modes: what the bound must be below, whatever it does."""

    oracle = False

    def __init__(self, seed: int) -> None:
        self.rng, self.name = np.random.default_rng(seed), f"random{seed}"

    def decide(self, v: TickView) -> Mode | None:
        x = self.rng.integers(0, 4)
        if x == 0:
            return v.held
        if x == 1:
            return None
        z = int(self.rng.integers(0, len(v.zones)))
        return Mode(OD, z) if x == 2 or not v.avail[z] else Mode(SPOT, z)


@settings(max_examples=120, deadline=None)
@given(small_markets(max_ticks=12, aligned=False), st.integers(0, 10**6))
def test_the_bound_is_never_above_any_policy_and_the_optimal_row_meets_what_on_demand_meets(mj, seed) -> None:
    m, job = mj
    bound = optimum(m, job).cost_usd
    od = simulate(m, job, OnDemand(), safety_net=False)
    for policy in (OnDemand(), UniformProgress(), RandomPolicy(seed)):
        r = simulate(m, job, policy)
        if r.done:
            assert bound <= r.cost_usd + 1e-9, policy.name
    best = optimal(m, job)
    if best.done:
        assert bound <= best.cost_usd + 1e-9
        assert not od.done or best.cost_usd <= od.cost_usd + 1e-9
    assert best.done or not od.done  # a deadline on-demand meets is met


def test_a_market_with_spot_throughout_waits_for_nothing_and_buys_spot() -> None:
    m = TickMarket(("us-east-1a",), np.ones((1, 10), dtype=bool), np.full((1, 10), 1.0), GAP, 3.0)
    o = optimum(m, TickJob(task_s=300, deadline_s=1000, overhead_s=150, checkpoint_gb=0), bound=False)
    # 2 ticks of overhead (rounded up), then 3 of work, at $1/h
    assert o.cost_usd == pytest.approx(5 * GAP / 3600)
    assert o.plan == [Mode(SPOT, 0)] * 5


def test_no_schedule_when_even_on_demand_is_too_late() -> None:
    m = TickMarket(("us-east-1a",), np.zeros((1, 3), dtype=bool), np.full((1, 3), 1.0), GAP, 3.0)
    o = optimum(m, TickJob(task_s=300, deadline_s=300, overhead_s=100, checkpoint_gb=0))
    assert not o.feasible and o.plan == []


@pytest.fixture(scope="module")
def v100():
    return load_trace(V100)


def test_the_optimal_row_reproduces_the_published_v100_optimum_within_3_percent(v100) -> None:
    """Figure 9b's Optimal, window by window, and the bound below it and every policy."""
    rows = []
    for w, published, up_published in zip(WINDOWS, PUBLISHED_OPTIMAL, PUBLISHED_UP_S):
        m = TickMarket.from_trace(v100, ZONES, w * 1106, 1106, gap_s=195.0)
        bound, best = optimum(m, V100_JOB).cost_usd, optimal(m, V100_JOB)
        up = simulate(m, V100_JOB, UniformProgress())
        assert best.done and best.cost_usd == pytest.approx(published, rel=0.03)
        assert bound <= best.cost_usd and bound <= up.cost_usd and bound <= published + 1e-3
        assert bound == pytest.approx(published, rel=0.01)
        rows.append(best.cost_usd)
    assert sum(rows) / 5 == pytest.approx(37.37, rel=0.03)


def test_a_pools_bound_buys_the_cheapest_node_hours_first() -> None:
    # zone a: 2 nodes at $1/h for the first hour, then none; zone b: unlimited at $2/h
    a = ZoneSeries("a", (0.0, 3600.0), (2, 0), (1.0, 1.0))
    b = ZoneSeries("b", (0.0,), (None,), (2.0,))
    trace = Trace({"a": a, "b": b}, 7200.0, "zones", "test")
    # 3 nodes at most; 5 node-hours by 2 h: 2 h at $1 (a, hour 1), then 3 h at $2 (b)
    assert pool_bound(trace, ["a", "b"], target=3, node_s=5 * 3600, deadline_s=7200, on_demand_usd_h=3.0,
                      spot_usd_h=1.0) == pytest.approx(2 * 1.0 + 3 * 2.0)
    # without b: 2 h at $1, the rest on demand
    assert pool_bound(trace, ["a"], target=3, node_s=5 * 3600, deadline_s=7200, on_demand_usd_h=3.0,
                      spot_usd_h=1.0) == pytest.approx(2 * 1.0 + 3 * 3.0)
    assert pool_bound(trace, ["a"], target=2, node_s=5 * 3600, deadline_s=7200, on_demand_usd_h=3.0,
                      spot_usd_h=1.0) == math.inf


def test_every_row_of_a_pool_replay_costs_at_least_its_bound(tmp_path, capsys) -> None:
    """bench.replay on Bamboo's p3 group (32 nodes, a 2-hour job): each policy's cost is
    above the least any pool pays for the same work by the same time (COST/OPT >= 1)."""
    import json
    from pathlib import Path

    from bench.replay.__main__ import main

    out = tmp_path / "p3.json"
    trace = Path(__file__).parent / "data" / "traces" / "bamboo" / "p3-trace.csv"
    assert main(["--trace", str(trace), "--job-hours", "2", "--json", str(out)]) == 0
    assert "COST/OPT" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    for name, r in rows.items():
        assert 0 < r["optimum_usd"] <= r["cost_usd"], name
    # on-demand buys the same work at the on-demand price: about 3x what spot would cost
    assert rows["on_demand"]["cost_usd"] / rows["on_demand"]["optimum_usd"] > 2.5


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6))
def test_no_policy_in_our_simulator_costs_less_than_the_pool_bound(seed) -> None:
    import random

    from bench.replay.deadline_markets import random_market
    from bench.replay.sim import JobModel, Market, Replay
    from daemon.control.policies import get_policy

    rng = random.Random(seed)
    job_h, target = rng.uniform(0.5, 2.0), rng.randint(1, 4)
    trace = random_market(rng, job_h * 2 + 1)
    job = JobModel(target_steps=max(1, round(job_h * 3600)), step_s=1.0, ref_gpus=target, checkpoint_bytes=4e9)
    for name, market in (("spotvisor", Market()), ("deadline_aware", Market()), ("spotvisor", Market(on_demand=True))):
        r = Replay(trace, get_policy(name), job=job, target_nodes=target, deadline_s=job_h * 2 * 3600,
                   market=market).run()
        bound = pool_bound(trace, ["z"], target=target, node_s=r.steps * job.step_s * job.ref_gpus,
                           deadline_s=r.hours * 3600, on_demand_usd_h=market.on_demand_usd_h,
                           spot_usd_h=market.spot_usd_h)
        assert bound <= r.cost_usd + 1e-6, (name, market.on_demand)


def test_replanning_part_way_starts_from_the_instance_held_or_the_checkpoints_zone() -> None:
    zones = ("us-east-1a", "us-west-2a")
    m = TickMarket(zones, np.array([[True] * 6, [True] * 6]), np.array([[2.0] * 6, [1.0] * 6]), GAP, 3.0)
    job = TickJob(task_s=300, deadline_s=600, overhead_s=200, checkpoint_gb=50, copy_gb_s=0.5,
                  egress_usd_per_gb=0.02)
    # held in zone 0, its restart done: 3 ticks there at $2/h beat a move (egress, 3 ticks of overhead)
    kept = optimum(m, job, held=Mode(SPOT, 0))
    assert kept.plan == [Mode(SPOT, 0)] * 3 and kept.cost_usd == pytest.approx(3 * 2.0 * GAP / 3600)
    # held with 100 s of restart left: one more tick without progress
    assert optimum(m, job, held=Mode(SPOT, 0), overhead_left_s=100).cost_usd == pytest.approx(4 * 2 * GAP / 3600)
    # nothing held, the checkpoint in zone 0: a launch there (2 ticks of overhead) beats a move
    here = optimum(m, job, leader=0)
    assert here.plan == [Mode(SPOT, 0)] * 5 and here.cost_usd == pytest.approx(5 * 2.0 * GAP / 3600)
    # from nothing at all: zone 1, cheaper, with no egress
    assert optimum(m, job).plan == [Mode(SPOT, 1)] * 5


def test_a_market_shorter_than_the_deadline_has_no_spot_after_its_end() -> None:
    m = TickMarket(("us-east-1a",), np.ones((1, 2), dtype=bool), np.full((1, 2), 1.0), GAP, 3.0)
    job = TickJob(task_s=400, deadline_s=600, overhead_s=0, checkpoint_gb=0)
    # 2 ticks of spot, then on demand for the other 2 (or on demand throughout: dearer)
    want = 2 * 1.0 * GAP / 3600 + 2 * 3.0 * GAP / 3600
    assert optimum(m, job).cost_usd == pytest.approx(want)
    r = simulate(m, job, PlanPolicy(optimum(m, job).plan))
    assert r.done and r.cost_usd == pytest.approx(want)
