"""How `make test` schedules the suite (tests/conftest.py): under pytest-xdist's
``--dist loadgroup`` every ``slow`` test carries one of two lane groups in its id (what
xdist's scheduler reads: one worker runs each lane, one test at a time), the lanes are
balanced by the tests' measured seconds (tests/slow_costs.json), and no other test
carries a group."""

from __future__ import annotations

import pytest
from conftest import SLOW_LANES, slow_weight


def test_the_slow_tests_and_only_they_are_in_two_balanced_xdist_lanes(request: pytest.FixtureRequest) -> None:
    loadgroup = getattr(request.config.option, "loadgroup", False)  # xdist's worker under --dist loadgroup
    load = dict.fromkeys(SLOW_LANES, 0.0)
    heaviest = 0.0
    for item in request.session.items:
        slow = item.get_closest_marker("slow") is not None
        lane = item.nodeid.rsplit("@", 1)[1] if "@" in item.nodeid else None
        assert (lane in SLOW_LANES) == (slow and loadgroup), item.nodeid
        if lane is not None:
            load[lane] += slow_weight(item)
            heaviest = max(heaviest, slow_weight(item))
    if loadgroup:  # longest first, each to the lighter lane: at most the heaviest test apart
        assert abs(load["slow-a"] - load["slow-b"]) <= heaviest, load


def test_every_slow_test_has_a_measured_cost_and_every_cost_a_test(request: pytest.FixtureRequest) -> None:
    """The lanes balance on measured seconds: a slow test without one is balanced on a
    guess (a new test: measure it), a cost without a test is stale."""
    from conftest import SLOW_COSTS

    slow = {item.nodeid.rsplit("@", 1)[0] for item in request.session.items if item.get_closest_marker("slow")}
    if len(slow) < 40:
        pytest.skip("run with the whole suite (it compares against every slow test)")
    assert sorted(slow - set(SLOW_COSTS)) == [] and sorted(set(SLOW_COSTS) - slow) == []
    assert all(isinstance(v, (int, float)) and 0 < v < 600 for v in SLOW_COSTS.values())
