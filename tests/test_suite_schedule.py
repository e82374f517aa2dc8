"""How `make test` schedules the suite (tests/conftest.py): under pytest-xdist's
``--dist loadgroup`` every ``slow`` test carries one of two lane groups in its id (what
xdist's scheduler reads: one worker runs each lane, one test at a time), the lanes are
balanced, and no other test carries a group."""

from __future__ import annotations

import pytest
from conftest import SLOW_LANES, slow_weight


def test_the_slow_tests_and_only_they_are_in_two_balanced_xdist_lanes(request: pytest.FixtureRequest) -> None:
    loadgroup = getattr(request.config.option, "loadgroup", False)  # xdist's worker under --dist loadgroup
    load = dict.fromkeys(SLOW_LANES, 0)
    for item in request.session.items:
        slow = item.get_closest_marker("slow") is not None
        lane = item.nodeid.rsplit("@", 1)[1] if "@" in item.nodeid else None
        assert (lane in SLOW_LANES) == (slow and loadgroup), item.nodeid
        if lane is not None:
            load[lane] += slow_weight(item)
    if loadgroup:
        assert abs(load["slow-a"] - load["slow-b"]) <= 6, load  # at most one demo run apart
