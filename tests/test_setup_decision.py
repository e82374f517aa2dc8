"""The stop-buying rule over job.setup failures (daemon/control/setup.py): a table of
cases and a property over every sequence of preparation outcomes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.actions import NodeView, Terminate
from daemon.control.lifecycle import NodeState
from daemon.control.setup import SetupRecord, on_prepared


def node(i: int, state: NodeState = NodeState.PREPARING) -> NodeView:
    return NodeView(id=f"n{i}", state=state, gpus=1, created_at=0.0)


def test_the_docstring_walk_through() -> None:
    rec = SetupRecord()
    out = on_prepared(rec, node(1), ok=False, max_failures=3, stage="setup", exit_code=1, last_line="boom")
    assert out.actions == [Terminate("n1", "setup_failed", NodeState.FAILED)] and out.halted_now is None
    rec = on_prepared(out.record, node(2), ok=True, max_failures=3).record
    assert rec.failures_in_a_row == 0
    for i in (3, 4):
        rec = on_prepared(rec, node(i), ok=False, max_failures=3, stage="setup").record
    assert rec.failures_in_a_row == 2 and not rec.halted
    out = on_prepared(rec, node(5), ok=False, max_failures=3, stage="setup", exit_code=127,
                      last_line="bash: pipp: command not found")
    assert out.halted_now == out.record.halted == (
        "job.setup failed on 3 nodes in a row (last: n5, setup exit 127: bash: pipp: command not found); "
        "no more nodes are bought: fix job.setup / job.workdir, then restart spotvisord")
    assert out.actions == [Terminate("n5", "setup_failed", NodeState.FAILED)]
    after = on_prepared(out.record, node(6), ok=True, max_failures=3)
    assert after.record.halted == out.halted_now and after.halted_now is None  # stays stopped until a restart


def test_a_node_past_preparing_is_terminated_not_failed_and_a_gone_one_not_at_all() -> None:
    out = on_prepared(SetupRecord(), node(1, NodeState.RUNNING), ok=False, max_failures=5, stage="verify")
    assert out.actions == [Terminate("n1", "setup_failed", NodeState.TERMINATED)]
    out = on_prepared(SetupRecord(), node(1, NodeState.LOST), ok=False, max_failures=5, stage="fetch")
    assert out.actions == [] and out.record.failures_in_a_row == 1


@settings(max_examples=300, deadline=None)
@given(outcomes=st.lists(st.booleans(), max_size=40), max_failures=st.integers(1, 6))
def test_buying_stops_exactly_at_the_first_run_of_max_failures_and_stays_stopped(outcomes: list[bool],
                                                                                 max_failures: int) -> None:
    rec = SetupRecord()
    run = 0
    halted_at = None
    for i, ok in enumerate(outcomes):
        out = on_prepared(rec, node(i), ok=ok, max_failures=max_failures, stage="setup")
        run = 0 if ok else run + 1
        assert out.record.failures_in_a_row == run
        # every failed node is released (and counted), a ready one never
        assert out.actions == ([] if ok else [Terminate(f"n{i}", "setup_failed", NodeState.FAILED)])
        if halted_at is None and run >= max_failures:
            halted_at = i
            assert out.halted_now and f"failed on {max_failures} nodes in a row (last: n{i}" in out.halted_now
        else:
            assert out.halted_now is None  # the line is said once
        assert bool(out.record.halted) == (halted_at is not None)
        rec = out.record
