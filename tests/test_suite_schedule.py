"""How `make test` schedules the suite (tests/conftest.py): under pytest-xdist's
``--dist loadgroup`` every ``slow`` test is in the one group ``slow``, which one worker
runs one test at a time, and no other test is in it."""

from __future__ import annotations

import pytest


def test_the_slow_tests_and_only_they_share_one_xdist_group(request: pytest.FixtureRequest) -> None:
    loadgroup = request.config.getvalue("dist") == "loadgroup" if request.config.pluginmanager.has_plugin("xdist") \
        else False
    for item in request.session.items:
        slow = item.get_closest_marker("slow") is not None
        groups = {m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")}
        assert groups == ({"slow"} if slow else set()), item.nodeid
        if loadgroup:  # the worker has already given the group to the test's id: what the scheduler reads
            assert item.nodeid.endswith("@slow") == slow, item.nodeid
