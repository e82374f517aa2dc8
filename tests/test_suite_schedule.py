"""How `make test` schedules the suite (tests/conftest.py): under pytest-xdist's
``--dist loadgroup`` every ``slow`` test carries the group ``@slow`` in its id (what
xdist's scheduler reads: one worker runs the group, one test at a time), and no other
test does."""

from __future__ import annotations

import pytest


def test_the_slow_tests_and_only_they_are_in_one_xdist_group(request: pytest.FixtureRequest) -> None:
    loadgroup = getattr(request.config.option, "loadgroup", False)  # xdist's worker under --dist loadgroup
    for item in request.session.items:
        slow = item.get_closest_marker("slow") is not None
        assert item.nodeid.endswith("@slow") == (slow and loadgroup), item.nodeid
