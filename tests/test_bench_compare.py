"""``make bench`` (bench/compare.py, bench/compare_metrics.py) without running a job: the trace, the figures
computed from synthetic trainer logs and daemon events, the table, and the baseline
policies of daemon/control/policies.py on a daemon with a recording provider (no processes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.compare import TraceEvent, parse_trace
from bench.compare_metrics import (
    acceptance,
    apply_goodput,
    add_relative_goodput,
    format_table,
    full_world_step_times,
    lineage,
    preemption_profile,
    run_metrics,
    step_durations,
    useful_step_time,
)
from conftest import ManualClock, RecordingProvider
from daemon.config import Config
from daemon.control.policies import (
    DEFAULT_POLICY,
    ElasticOnly,
    NoticeNoRejoin,
    RecoveryPolicy,
    RestartOnPreemption,
    Spotvisor,
    get_policy,
    lost_from_job,
    policy_names,
    register,
)
from daemon.model import Event, JobState, NodeState, TrainerState
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor

# -- the trace ------------------------------------------------------------------------------


def test_trace_entries_by_time_or_step() -> None:
    assert parse_trace("15s:2:30, step100:3:30,40.5s:1:0") == (
        TraceEvent(node=2, lead_s=30, at_s=15.0),
        TraceEvent(node=3, lead_s=30, at_step=100),
        TraceEvent(node=1, lead_s=0, at_s=40.5),
    )
    assert [e.label for e in parse_trace("15s:2:30,step100:3:30")] == ["15s:2:30", "step100:3:30"]
    ev = parse_trace("step100:3:30")[0].chaos_event()
    assert (ev.action, ev.at_step, ev.lead_s, ev.wait_full_pool) == ("notice", 100, 30, True)
    assert parse_trace("5s:1:0")[0].chaos_event().action == "kill"  # no lead: taken without notice


def test_trace_from_a_json_file(tmp_path: Path) -> None:
    f = tmp_path / "trace.json"
    f.write_text(json.dumps([{"at_s": 10, "node": 2, "lead_s": 30}, {"at_step": 50, "node": 1, "lead_s": 120}]))
    assert parse_trace(str(f)) == (TraceEvent(2, 30.0, at_s=10), TraceEvent(1, 120.0, at_step=50))


@pytest.mark.parametrize("text, message", [
    ("15s:2", "expected WHEN:NODE:LEAD_S"),
    ("15m:2:30", "WHEN is 20s"),
    ("15s:0:30", "node must be >= 1"),
    ("15s:1:-3", "negative time"),
    ("15s:x:30", "15s:x:30"),
])
def test_bad_trace_entries_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_trace(text)


# -- figures from the trainer's logs --------------------------------------------------------


def _step(attempt: str, step: int, t: float, rank: int = 0, world: int = 2) -> dict:
    return {"attempt": attempt, "rank": rank, "world_size": world, "step": step, "positions": [], "loss": 1.0,
            "time": t}


def _status(event: str, attempt: str, t: float, step: int, **kw: object) -> dict:
    return {"event": event, "attempt": attempt, "time": t, "step": step, "world_size": 2, **kw}


# attempt a: started at 100, steps 1..4 at 101..104, commit at step 2 ending 102.5
# (step 3 runs 102.5..103); a node dies at 104.5. Attempt b starts at 120 from step 2,
# trains 3..4 at 121, 122 (steps 3, 4 of a are lost).
STEPS = [_step("a", s, 100.0 + s) for s in range(1, 5)] + [_step("a", 1, 101.0, rank=1)] + [
    _step("b", 3, 121.0), _step("b", 4, 122.0)]
STATUS = [
    _status("started", "a", 100.0, 0),
    _status("checkpoint_committed", "a", 102.5, 2, notice_ids=[]),
    _status("started", "b", 120.0, 2),
    _status("completed", "b", 122.1, 4),
]


def test_a_step_runs_from_its_boundary_commits_and_restarts_excluded() -> None:
    d = step_durations(STEPS, STATUS)
    assert d[("a", 1)] == pytest.approx(1.0)  # from the attempt's start
    assert d[("a", 3)] == pytest.approx(0.5)  # from the end of the commit at step 2
    assert d[("b", 3)] == pytest.approx(1.0)  # from b's start, not from a's last step
    assert lineage(STEPS, STATUS) == {1: "a", 2: "a", 3: "b", 4: "b"}
    assert useful_step_time(STEPS, STATUS) == pytest.approx(1.0 + 1.0 + 1.0 + 1.0)


def test_a_step_after_a_hold_that_timed_out_takes_the_median() -> None:
    steps = [_step("a", s, t) for s, t in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 99.0))]
    status = [_status("started", "a", 0.0, 0), _status("holding", "a", 3.1, 3)]
    assert step_durations(steps, status)[("a", 4)] == pytest.approx(1.0)


def test_goodput_counts_every_useful_step_at_one_reference_step_time() -> None:
    steps = [_step("a", 1, 1.0, world=3), _step("a", 2, 2.0, world=3), _step("a", 3, 2.5, world=3),
             _step("b", 4, 12.0, world=2)]
    status = [_status("started", "a", 0.0, 0), _status("started", "b", 10.0, 3)]
    assert full_world_step_times(steps, status) == [0.5, 1.0, 1.0]  # world size 3 only
    r = {"useful_steps": 200, "wall_s": 400.0}
    apply_goodput(r, 0.5)
    assert (r["goodput"], r["useful_step_s"], r["reference_step_s"]) == (0.25, 100.0, 0.5)


def _ev(seq: int, t: float, kind: str, node: str | None = None, **data: object) -> Event:
    return Event(seq, t, kind, node, dict(data))


def test_preemption_profile_counts_from_the_notice() -> None:
    events = [
        _ev(1, 90.0, "node_launch_requested", "n1"),
        _ev(2, 103.2, "chaos_injected", "n2", index=0, trace="3s:2:30", action="notice", lead_s=30,
            published=True, published_at=103.0, step=3),
        _ev(3, 103.6, "interruption_notice", "n2", notice_id="x", notice_seen_at=103.5),
        _ev(4, 104.5, "node_terminated", "n2", reason="drained"),
        _ev(5, 110.0, "node_ready", "n4"),
    ]
    status = STATUS[:2] + [_status("checkpoint_committed", "a", 104.0, 4, notice_ids=["x"])] + STATUS[2:]
    p = preemption_profile(events[1], STEPS, status, events)
    assert (p["notice_seen_s"], p["commit_s"], p["node_gone_s"], p["replacement_ready_s"]) == (0.5, 1.0, 1.5, 7.0)
    assert p["restarts"] == [[17.0, 2]] and p["resumed_from_step"] == 2 and p["resume_s"] == 18.0
    assert p["taken"] and p["full_again_s"] == 18.0  # b restarted at a's world size
    late = preemption_profile(events[1], STEPS, status, events, completed_at=104.0)
    assert not late["taken"]  # the job completed before the node was gone: it never hit


def test_full_again_is_the_first_step_at_the_world_size_of_before_the_notice() -> None:
    """The shrunk world resumes at once; the world is whole again only once the
    replacement has joined (the grow)."""
    fired = _ev(1, 103.0, "chaos_injected", "n2", index=0, action="notice", published=True, published_at=103.0)
    steps = [_step("a", 1, 101.0, world=3), _step("b", 2, 104.5, world=2), _step("b", 3, 105.0, world=2),
             _step("c", 4, 116.0, world=3)]
    status = [dict(_status("started", "a", 100.0, 0), world_size=3), _status("started", "b", 104.0, 1),
              _status("checkpoint_committed", "b", 106.0, 3, notice_ids=["rejoin-1"]),
              dict(_status("started", "c", 115.0, 3), world_size=3)]
    p = preemption_profile(fired, steps, status, [fired])
    assert (p["resume_s"], p["full_again_s"], p["grow_hold_s"]) == (1.5, 13.0, 10.0)


def test_an_in_process_grow_holds_from_the_last_step_to_the_grown_start() -> None:
    """No rejoin commit: the survivors pause at one boundary, from rank 0's last step
    (110.0) to the grown attempt's started line (110.4); the step after is training."""
    fired = _ev(1, 103.0, "chaos_injected", "n2", index=0, action="notice", published=True, published_at=103.0)
    steps = [_step("a", 1, 101.0, world=3), _step("b", 2, 104.5, world=2), _step("b", 3, 110.0, world=2),
             _step("c", 4, 111.0, world=3)]
    status = [dict(_status("started", "a", 100.0, 0), world_size=3, rank=0),
              dict(_status("started", "b", 104.0, 1), rank=0, resized="in_process"),
              dict(_status("started", "c", 110.4, 3), world_size=3, rank=0, resized="in_process", joined=1)]
    p = preemption_profile(fired, steps, status, [fired])
    assert (p["full_again_s"], p["grow_hold_s"]) == (8.0, 0.4)


def test_run_metrics_for_a_baseline_without_a_notice_commit() -> None:
    events = [_ev(1, 90.0, "node_launch_requested", "n1"),
              _ev(2, 103.0, "chaos_injected", "n2", index=0, action="notice", lead_s=1, published=False,
                  published_at=103.0, step=3),
              _ev(3, 104.2, "node_lost", "n2")]
    summary = {"steps_completed": 4, "lost_steps_total": 2, "lost_steps_on_notice": 0, "restarts": 1}
    m = run_metrics(STEPS, STATUS, events, summary)
    assert m["completed"] and m["wall_s"] == pytest.approx(32.1)  # first launch request → completed
    assert m["step_s"] == pytest.approx(1.0) and m["measured_useful_step_s"] == pytest.approx(4.0)
    assert m["goodput"] == pytest.approx(4 * 1.0 / 32.1, abs=1e-3)  # useful steps x median step / wall
    assert m["notice_to_commit_s"] == [] and m["notice_to_resume_s"] == [18.0]
    assert (m["useful_steps"], m["lost_steps"], m["restarts"], m["preemptions"]) == (4, 2, 1, 1)


def test_table_and_acceptance_lines() -> None:
    row = {"completed": True, "wall_s": 100.0, "useful_steps": 200, "lost_steps": 0, "lost_steps_on_notice": 0,
           "goodput": 0.5, "notice_to_commit_s": [1.0, 2.0], "notice_to_resume_s": [10.0, 12.0], "restarts": 6,
           "preemptions": 2}
    base = {**row, "lost_steps": 30, "goodput": 0.4, "notice_to_commit_s": [], "notice_to_resume_s": [50.0],
            "restarts": 3, "completed": False, "preemptions": 1}
    table = format_table({"spotvisor": row, "restart_on_preemption": base})
    assert "1.5 / 2.0" in table and "11.0 / 12.0" in table and "(did not complete)" in table
    lines = acceptance({"spotvisor": row, "restart_on_preemption": base}, trace_len=2)
    assert lines[0].startswith("WARNING: restart_on_preemption met 1 of the trace's 2")
    assert lines[1].endswith("met") and "+25.0 %" in lines[2]
    assert "4.5x (goal >= 5x): MISSED by 1.1x" in lines[3]


def test_goodput_is_also_given_against_the_run_without_preemptions() -> None:
    """no_preemption: the same job with no trace; every system's goodput against it, and
    spotvisor's goal of 0.9 of it (issue 17). It meets no preemption and is not warned about."""
    row = {"completed": True, "wall_s": 100.0, "useful_steps": 200, "lost_steps": 0, "lost_steps_on_notice": 0,
           "goodput": 0.45, "notice_to_commit_s": [1.0], "notice_to_resume_s": [10.0], "restarts": 2,
           "preemptions": 1}
    none = {**row, "goodput": 0.6, "notice_to_commit_s": [], "notice_to_resume_s": [], "preemptions": 0}
    results = {"spotvisor": row, "no_preemption": none}
    add_relative_goodput(results)
    assert row["goodput_vs_no_preemption"] == 0.75 and none["goodput_vs_no_preemption"] == 1.0
    assert " 0.750 " in format_table(results)
    lines = acceptance(results, trace_len=1)
    assert not any(line.startswith("WARNING") for line in lines)
    assert "goodput: spotvisor 0.750 of no_preemption's (goal >= 0.9): MISSED" in lines
    assert not any("vs no_preemption" in line for line in lines)  # not a baseline to beat


# -- the baseline policies ----------------------------------------------------------------------


def test_policies_are_registered_with_spotvisor_first() -> None:
    assert policy_names() == [DEFAULT_POLICY, "deadline_aware", "elastic_only", "home_zone", "notice_no_rejoin",
                              "restart_on_preemption"]
    assert type(get_policy(DEFAULT_POLICY)) is Spotvisor and get_policy(DEFAULT_POLICY).acts_on_notices
    assert not get_policy("elastic_only").acts_on_notices and not get_policy("restart_on_preemption").acts_on_notices
    assert get_policy("notice_no_rejoin").acts_on_notices
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        get_policy("nope")

    class Clash(RecoveryPolicy):
        name = "elastic_only"

    with pytest.raises(ValueError, match="already registered by ElasticOnly"):
        register(Clash)
    assert type(get_policy("elastic_only")) is ElasticOnly


def test_lost_from_job() -> None:
    states = {"a": NodeState.RUNNING, "b": NodeState.LOST, "c": NodeState.TERMINATED, "d": NodeState.DRAINING}
    assert lost_from_job({"a", "b", "c", "d", "gone"}, states) == ["b", "c", "gone"]
    assert lost_from_job({"a", "d"}, states) == []


async def _daemon(tmp_path: Path, policy: str) -> tuple[Supervisor, RecordingProvider]:
    """A 3-node pool running its job (all nodes admitted), driven by hand: no tasks, no API."""
    config = Config.model_validate({
        "pool": {"name": "b", "min_nodes": 1, "target_nodes": 3, "max_nodes": 3},
        "job": {"id": "j", "module": "standin_trainer", "global_batch_size": 6, "micro_batch_size": 1},
        "daemon": {"state_dir": str(tmp_path / "state")},
    })
    provider = RecordingProvider()
    sup = Supervisor(config, provider=provider, store=Store(tmp_path / "db.sqlite").open(), clock=ManualClock(1000.0),
                     policy=get_policy(policy))
    sup.agent_url = "http://127.0.0.1:1"
    await sup.fleet.checks.check_once()  # what the daemon's start does: the cloud check (here the store probe)
    await _pass(sup)
    for n in list(sup.nodes.values()):
        sup.agents.on_register(n)
    await _pass(sup)
    assert sup.job.state is JobState.RUNNING and all(n.state is NodeState.RUNNING for n in sup.nodes.values())
    return sup, provider


async def _pass(sup: Supervisor) -> None:
    """One reconcile pass, and every launch call it started landed."""
    await sup.reconcile_once()
    async with asyncio.timeout(10):
        while sup.fleet.launching:  # the calls are tasks of their own; this one yields to them
            await asyncio.sleep(0)


async def test_restart_on_preemption_terminates_every_node_and_relaunches_the_pool(tmp_path: Path) -> None:
    sup, provider = await _daemon(tmp_path, RestartOnPreemption.name)
    try:
        provider.terminated.add(sup.nodes["b-2"].instance_id)  # the cloud takes node 2
        await _pass(sup)
        states = {n.id: n.state for n in sup.nodes.values()}
        assert states["b-2"] is NodeState.LOST
        assert states["b-1"] is NodeState.TERMINATED and states["b-3"] is NodeState.TERMINATED
        assert provider.terminated >= {sup.nodes[i].instance_id for i in ("b-1", "b-3")}
        assert sup.job.state is JobState.PENDING
        fresh = [n for n in sup.nodes.values() if n.ordinal > 3]
        assert len(fresh) == 3  # the whole pool, launched at once
        for n in fresh[:2]:
            sup.agents.on_register(n)
        await _pass(sup)
        assert all(n.state is NodeState.READY for n in fresh[:2]), "starts only with the whole pool"
        sup.agents.on_register(fresh[2])
        await _pass(sup)
        assert all(n.state is NodeState.RUNNING for n in fresh) and sup.job.state is JobState.RUNNING
        assert sup.store.events(kinds=["checkpoint_requested"]) == []
    finally:
        await sup.aclose()


async def test_elastic_only_admits_a_replacement_without_a_rejoin_commit(tmp_path: Path) -> None:
    sup, provider = await _daemon(tmp_path, ElasticOnly.name)
    try:
        provider.terminated.add(sup.nodes["b-2"].instance_id)
        await _pass(sup)
        assert sup.nodes["b-2"].state is NodeState.LOST
        assert sup.nodes["b-1"].state is NodeState.RUNNING and sup.nodes["b-3"].state is NodeState.RUNNING
        assert sup.job.state is JobState.RUNNING
        (new,) = [n for n in sup.nodes.values() if n.ordinal > 3]
        sup.agents.on_register(new)
        await _pass(sup)
        assert new.state is NodeState.RUNNING
        assert sup.store.events(kinds=["checkpoint_requested"]) == []
        assert [e.data["reason"] for e in sup.store.events(kinds=["node_admitted"])][-1] == "elastic_join"
    finally:
        await sup.aclose()


async def test_notice_no_rejoin_waits_for_the_noticed_node_then_admits_without_a_rejoin_commit(tmp_path: Path) -> None:
    sup, provider = await _daemon(tmp_path, NoticeNoRejoin.name)
    try:
        for n in sup.nodes.values():
            n.trainer = TrainerState.RUNNING
        sup.intake.on_reports(sup.nodes["b-2"], [{"kind": "interruption_notice", "notice": {"id": "b-2:n", "action": "terminate"},
                                           "seen_at": sup.clock(), "deadline": sup.clock() + 120}])
        assert sup.nodes["b-2"].state is NodeState.DRAINING
        await _pass(sup)
        (new,) = [n for n in sup.nodes.values() if n.ordinal > 3]  # launched at the notice
        sup.agents.on_register(new)
        await _pass(sup)
        assert new.state is NodeState.READY, "not while the noticed node is still in the job"
        # it committed and left, and its agent's reports are in
        sup.agents.on_heartbeat(sup.nodes["b-2"], {"trainer": {"state": "exited"}, "reports_pending": 0})
        await _pass(sup)
        assert new.state is NodeState.RUNNING and sup.nodes["b-2"].state is NodeState.TERMINATED
        assert sup.store.events(kinds=["checkpoint_requested"]) == []
        assert [e.data["reason"] for e in sup.store.events(kinds=["node_admitted"])][-1] == "elastic_join"
    finally:
        await sup.aclose()
