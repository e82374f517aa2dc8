"""daemon/control/reports.py: what an agent reports, parsed and bounded at the edge (pure)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.reports import (
    Limits, MetadataAlarm, NoticeReport, ReportError, StatusLine, TrainerExited, WorkersFailed, parse_report,
    parse_reports_pending, parse_step,
)

LIMITS = Limits(max_step=3000, max_world_size=16)

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_ish = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
FIELDS = ("event", "attempt", "rank", "world_size", "step", "time", "resumed_from", "resized", "notice_ids", "kinds",
          "reason", "seconds", "bytes", "save_s", "upload_s")
lines = st.fixed_dictionaries({}, optional={
    "event": st.sampled_from(["started", "checkpoint_committed", "completed", "step", "holding"]) | json_ish,
    **{k: json_ish for k in FIELDS if k != "event"},
    "step": st.integers(min_value=-5, max_value=4000) | json_ish,
    "world_size": st.integers(min_value=-1, max_value=20) | json_ish,
    "rank": st.integers(min_value=-1, max_value=20) | json_ish,
})
reports = st.one_of(
    st.fixed_dictionaries({"kind": st.just("trainer_status"), "line": lines | json_ish}),
    st.fixed_dictionaries({"kind": st.sampled_from(["interruption_notice", "rebalance_recommendation"])},
                          optional={"notice": json_ish, "deadline": json_ish, "seen_at": json_ish}),
    st.fixed_dictionaries({"kind": st.sampled_from(["metadata_unreachable", "metadata_recovered", "trainer_exited"])},
                          optional={"failures": json_ish, "error": json_ish, "url": json_ish, "exit_code": json_ish}),
    st.fixed_dictionaries({"kind": st.just("workers_failed")},
                          optional={"restarts_left": st.integers(-5, 2**33) | json_ish,
                                    "last_line": st.text(max_size=700) | json_ish}),
    json_ish,
)


def _finite_fields(msg) -> list:
    return [getattr(msg, f) for f in msg.__slots__ if isinstance(getattr(msg, f), float)]


@settings(max_examples=300, deadline=None)
@given(reports)
def test_a_report_parses_into_bounded_fields_or_one_line_error(report) -> None:
    """Whatever a node sends: a typed message whose numbers are finite and in bounds, None
    (a kind this daemon does not know), or a ReportError of one line; nothing else."""
    try:
        msg = parse_report(report, LIMITS)
    except ReportError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    if msg is None:
        return
    assert all(math.isfinite(v) for v in _finite_fields(msg))
    json.dumps([getattr(msg, f) for f in msg.__slots__], allow_nan=False)  # storable as strict JSON
    if isinstance(msg, StatusLine):
        assert 0 <= msg.step <= LIMITS.max_step
        assert msg.world_size is None or 1 <= msg.world_size <= LIMITS.max_world_size
        assert msg.resumed_from is None or 0 <= msg.resumed_from <= msg.step
        assert msg.bytes is None or msg.bytes >= 0
        assert all(v >= 0 for v in (msg.seconds, msg.save_s, msg.upload_s) if v is not None)
    elif isinstance(msg, MetadataAlarm):
        assert msg.failures is None or msg.failures >= 0
    elif isinstance(msg, TrainerExited):
        assert msg.exit_code is None or -255 <= msg.exit_code <= 255
    elif isinstance(msg, WorkersFailed):  # a node's own line, cut: never grows without bound
        assert msg.restarts_left is None or 0 <= msg.restarts_left <= 2**31
        assert len(msg.last_line) <= 513
    else:
        assert isinstance(msg, NoticeReport)


@pytest.mark.parametrize("line, problem", [
    ({"event": "completed", "attempt": "a", "step": 99999}, "step 99999 is outside [0, 3000]"),
    ({"event": "started", "attempt": "a", "step": 5, "world_size": "pwned"}, "world_size is not an integer"),
    ({"event": "started", "attempt": "a", "step": 5, "world_size": True}, "world_size is not an integer"),
    ({"event": "checkpoint_committed", "attempt": "a", "step": 5, "bytes": -1}, "bytes -1 is outside"),
    ({"event": "checkpoint_committed", "attempt": "a", "step": 5, "seconds": float("inf")}, "seconds inf"),
    ({"event": "started", "attempt": "a", "step": 5, "world_size": 1, "resumed_from": 6}, "resumed_from 6"),
])
def test_the_issues_hostile_lines_name_their_field(line: dict, problem: str) -> None:
    with pytest.raises(ReportError, match=problem.replace("[", r"\[")):
        parse_report({"kind": "trainer_status", "line": line}, LIMITS)


def test_a_heartbeat_step_is_bounded_by_the_jobs_target() -> None:
    assert parse_step(None, LIMITS) is None and parse_step(3000, LIMITS) == 3000
    for bad in (10**12, -1, 2.5, float("nan"), "7", True):
        with pytest.raises(ReportError):
            parse_step(bad, LIMITS)


def test_the_reports_an_agent_owes_are_a_bounded_count_and_absent_is_none() -> None:
    assert parse_reports_pending(None) == 0 and parse_reports_pending(7) == 7
    for bad in (2**31 + 1, -1, 1.5, "3", True, [1]):
        with pytest.raises(ReportError, match="reports_pending"):
            parse_reports_pending(bad)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=12), st.lists(st.booleans(), max_size=12),
       st.booleans())
def test_numbered_reports_sent_again_at_any_point_are_applied_once_in_order(
        sizes: list[int], resend: list[bool], restart: bool) -> None:
    """A stream of numbered reports cut into batches, any batch sent again (its answer
    lost): each report is applied once, in order. An agent restarted halfway numbers
    from 1 again under a new id and loses nothing."""
    from daemon.control.reports import fresh

    stream = [{"kind": "k", "i": i} for i in range(1, sum(sizes) + 1)]
    applied, seen_from, upto, at, numbered = [], "", 0, 0, {"a": 0, "b": 0}
    for i, size in enumerate(sizes):
        agent = "b" if restart and i >= len(sizes) // 2 else "a"  # the restarted one numbers from 1 again
        batch = []
        for r in stream[at:at + size]:
            numbered[agent] += 1
            batch.append({**r, "seq": numbered[agent]})
        at += size
        for _ in range(2 if i < len(resend) and resend[i] else 1):
            out, upto = fresh(batch, agent, seen_from, upto)
            seen_from = agent
            applied += [r["i"] for r in out]
    assert applied == list(range(1, sum(sizes) + 1))
    assert fresh(stream, None, "a", 10**6)[0] == stream  # an agent without numbers: as it comes
