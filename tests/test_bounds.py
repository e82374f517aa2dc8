"""daemon/control/bounds.py: what an outsider may make the daemon spend (pure; issue 25, items 4-5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.bounds import (FD_RESERVE_MIN, INTAKE_RATES, MIN_CONNECTIONS, SHEDDABLE_KINDS, Rate, ReportClass,
                                   TokenBucket, connection_caps, report_class, shed, triage)


# -- connection caps ----------------------------------------------------------------------------
@pytest.mark.parametrize(("nofile", "max_nodes", "total", "per_peer"), [
    (1024, 3, 768, 28),  # the default soft limit: 256 kept back
    (65536, 1000, 57344, 4016),  # systemd/spotvisord.service's LimitNOFILE, a 1,000-node pool
    (65536, 100_000, 57344, 57344),  # a peer never gets more than the whole port
])
def test_connection_caps_leave_room_for_everything_else(nofile: int, max_nodes: int, total: int,
                                                        per_peer: int) -> None:
    caps = connection_caps(nofile, max_nodes=max_nodes)
    assert (caps.total, caps.per_peer) == (total, per_peer)


@given(st.integers(min_value=0, max_value=2**22), st.integers(min_value=1, max_value=10**5))
def test_connection_caps_never_take_the_reserve(nofile: int, max_nodes: int) -> None:
    try:
        caps = connection_caps(nofile, max_nodes=max_nodes)
    except ValueError as exc:
        assert nofile - max(FD_RESERVE_MIN, nofile // 8) < MIN_CONNECTIONS
        assert "\n" not in str(exc) and "LimitNOFILE" in str(exc) and str(nofile) in str(exc)
        return
    assert caps.total + max(FD_RESERVE_MIN, nofile // 8) == nofile
    assert MIN_CONNECTIONS <= caps.total and 1 <= caps.per_peer <= caps.total


# -- token buckets ------------------------------------------------------------------------------
rates = st.builds(Rate, per_s=st.floats(min_value=0.0, max_value=100.0), burst=st.integers(min_value=0, max_value=200))
steps = st.lists(st.tuples(st.floats(min_value=-5.0, max_value=30.0), st.integers(min_value=0, max_value=300)),
                 max_size=40)


@given(rates, steps)
def test_a_bucket_never_grants_more_than_its_burst_plus_its_rate(rate: Rate, takes: list[tuple[float, int]]) -> None:
    """Over any run of takes, a clock that may also step back: granted <= burst + rate x
    (the latest reading - the first); the tokens stay within [0, burst]."""
    now = 1000.0
    bucket = TokenBucket.full(rate, now)
    granted = 0
    latest = now
    for dt, n in takes:
        now += dt
        latest = max(latest, now)
        got, bucket = bucket.take(n, now)
        assert 0 <= got <= n
        granted += got
        assert 0 <= bucket.tokens <= rate.burst
        assert granted <= rate.burst + rate.per_s * (latest - 1000.0) + 1e-6


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = TokenBucket.full(Rate(per_s=2.0, burst=10.0), 0.0)
    got, b = b.take(25, 0.0)
    assert got == 10
    got, b = b.take(25, 1.0)
    assert got == 2
    got, b = b.take(25, 1000.0)
    assert got == 10


# -- triage ---------------------------------------------------------------------------------------
classes = st.sampled_from(list(ReportClass))
batches = st.lists(st.tuples(classes, st.integers(min_value=0, max_value=30)), max_size=150)


def _full(now: float = 0.0) -> dict[ReportClass, TokenBucket]:
    return {c: TokenBucket.full(r, now) for c, r in INTAKE_RATES.items()}


@given(batches, st.integers(min_value=1, max_value=120))
def test_triage_accounts_for_every_report(batch: list[tuple[ReportClass, int]], max_reports: int) -> None:
    t = triage(batch, _full(), now=0.0, max_reports=max_reports)
    assert len(t.keep) + sum(t.dropped.values()) == len(batch)
    assert list(t.keep) == sorted(set(t.keep)) and all(i < max_reports for i in t.keep)  # in order, no repeats
    keys = [batch[i][1] for i in t.keep]
    assert len(keys) == len(set(keys))  # a duplicate is never applied twice
    for c in ReportClass:
        kept = sum(1 for i in t.keep if batch[i][0] is c)
        assert kept <= INTAKE_RATES[c].burst
        assert t.buckets[c].tokens == INTAKE_RATES[c].burst - kept


@given(st.lists(st.tuples(st.floats(min_value=0.0, max_value=5.0), batches), max_size=20))
@settings(max_examples=60)
def test_a_node_records_at_most_its_burst_plus_its_rate_whatever_it_sends(
        posts: list[tuple[float, list[tuple[ReportClass, int]]]]) -> None:
    now, buckets = 0.0, _full()
    kept = {c: 0 for c in ReportClass}
    for dt, batch in posts:
        now += dt
        t = triage(batch, buckets, now=now)
        buckets = dict(t.buckets)
        for i in t.keep:
            kept[batch[i][0]] += 1
    for c, r in INTAKE_RATES.items():
        assert kept[c] <= r.burst + r.per_s * now + 1e-6


@given(st.integers(min_value=0, max_value=10_000))
def test_a_flood_of_routine_reports_leaves_the_vital_ones_alone(flood: int) -> None:
    """A node's flood of started lines does not cost its notice or its commit a place."""
    batch = [(ReportClass.ROUTINE, i) for i in range(flood)][:98] + \
        [(ReportClass.VITAL, "notice"), (ReportClass.VITAL, "commit")]
    buckets = _full()
    buckets[ReportClass.ROUTINE] = TokenBucket(1.0, 30.0, 0.0, 0.0)  # empty already
    t = triage(batch, buckets, now=0.0)
    assert [batch[i][1] for i in t.keep] == ["notice", "commit"]
    assert t.dropped.get("rate", 0) == len(batch) - 2


def test_duplicates_in_a_batch_collapse_and_the_batch_is_cut() -> None:
    batch = [(ReportClass.VITAL, "same")] * 5 + [(ReportClass.ROUTINE, k) for k in range(200)]
    t = triage(batch, _full(), now=0.0, max_reports=100)
    assert t.dropped == {"too_many": 105, "duplicate": 4, "rate": 95 - 30}
    assert [batch[i][1] for i in t.keep] == ["same", *range(30)]


@pytest.mark.parametrize(("kind", "event", "cls"), [
    ("interruption_notice", None, ReportClass.VITAL), ("rebalance_recommendation", None, ReportClass.VITAL),
    ("trainer_exited", None, ReportClass.VITAL), ("trainer_status", "checkpoint_committed", ReportClass.VITAL),
    ("trainer_status", "completed", ReportClass.VITAL), ("trainer_status", "started", ReportClass.ROUTINE),
    ("metadata_unreachable", None, ReportClass.ROUTINE), ("a_newer_kind", None, ReportClass.ROUTINE),
    (None, None, ReportClass.ROUTINE), (["junk"], {"x": 1}, ReportClass.ROUTINE),
])
def test_report_class(kind: object, event: object, cls: ReportClass) -> None:
    assert report_class(kind, event) is cls


# -- feed shedding -----------------------------------------------------------------------------
kinds = st.sampled_from(["job_resumed", "metadata_unreachable", "interruption_notice", "checkpoint_committed",
                         "node_lost", "gpu_underutilized"])
windows = st.lists(st.tuples(kinds, st.sampled_from([None, "n1", "n2"])), max_size=60)


@given(windows, st.integers(min_value=0, max_value=3000))
def test_shedding_keeps_every_vital_event_and_the_newest_of_each_other(window: list[tuple[str, str | None]],
                                                                       backlog: int) -> None:
    keep = shed(window, backlog=backlog, bound=1000)
    assert len(keep) == len(window)
    if backlog <= 1000:
        assert all(keep)
        return
    for i, (kind, node) in enumerate(window):
        if kind not in SHEDDABLE_KINDS:
            assert keep[i]
        else:  # kept iff it is the last of its kind and node in the window
            assert keep[i] == all(window[j] != (kind, node) for j in range(i + 1, len(window)))
