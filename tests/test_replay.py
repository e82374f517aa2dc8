"""bench/replay/sim.py: the daemon's decisions replayed on a market trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.replay.__main__ import main
from bench.replay.sim import JobModel, Market, Replay
from bench.replay.traces import parse_events
from daemon.control.lifecycle import ADMITTED
from daemon.control.migration import Plan
from daemon.control.policies import Spotvisor, get_policy
from daemon.model import NodeState

JOB = JobModel(target_steps=10**9, step_s=1.0, ref_gpus=4, checkpoint_bytes=4e9)


def _trace(events: list[tuple[int, str, str]]):
    return parse_events([f"{t},{act},{node}" for t, act, node in events], zone="z", source="test")


STEADY = _trace([(0, "add", f"n{i}") for i in range(4)] + [(3_600_000, "add", "n9")])


def test_a_steady_market_trains_at_full_size_and_loses_nothing() -> None:
    r = Replay(STEADY, get_policy("spotvisor"), job=JOB, target_nodes=4).run()
    assert r.lost_steps == 0 and r.restarts == 1  # the start
    # 120 s of boot, then the restart and the load, then one step a second at 4 GPUs
    assert r.steps == pytest.approx(3600 - 120 - JOB.restart_s - JOB.load_s(4), abs=JOB.save_s(4) * 40)
    assert r.world_hours[4] > 0.9


def test_a_loss_with_notice_costs_spotvisor_no_step_and_restart_on_preemption_some() -> None:
    trace = _trace([(0, "add", f"n{i}") for i in range(4)] + [(1_800_000, "remove", "n3"),
                                                              (3_600_000, "add", "n9")])
    spot = Replay(trace, get_policy("spotvisor"), job=JOB, target_nodes=4).run()
    restart = Replay(trace, get_policy("restart_on_preemption"), job=JOB, target_nodes=4).run()
    assert spot.lost_steps == 0 and spot.resizes == 1
    assert restart.lost_steps > 0 and restart.steps < spot.steps


def test_an_in_process_grow_pauses_the_survivors_for_the_state_not_a_restart() -> None:
    """``job.grow: in_process``: the replacement joins the running workers, which pause
    while it takes the state from one of them (``JobModel.grow_s``); with ``restart`` they
    commit, hold, and the group restarts and loads. The elastic baseline restarts either way."""
    trace = _trace([(0, "add", f"n{i}") for i in range(4)] + [(1_800_000, "remove", "n3"),
                                                              (2_400_000, "add", "n4"), (3_600_000, "add", "n9")])
    runs = {(name, grow): Replay(trace, get_policy(name), job=JOB, target_nodes=4, grow_in_process=grow).run()
            for name in ("spotvisor", "elastic_only") for grow in (False, True)}
    restart, in_process = runs["spotvisor", False], runs["spotvisor", True]
    assert restart.restarts == 2 and in_process.restarts == 1  # the start, then (restart) the grow
    assert in_process.resizes == restart.resizes + 1 == 2  # the shrink at the notice, then the grow
    assert restart.lost_steps == in_process.lost_steps == 0
    # one step a second at 4 GPUs: what the grow saves is the rejoin commit, the restart
    # and the load, less the state's 3.2 s at 1.25 GB/s and the group's re-forming
    saved = JOB.save_s(4) + JOB.restart_s + JOB.load_s(4) - JOB.grow_s()
    assert JOB.grow_s() == pytest.approx(JOB.resize_s + 4e9 / 1.25e9)
    assert in_process.steps - restart.steps == pytest.approx(saved, abs=2)
    assert runs["elastic_only", True].restarts == runs["elastic_only", False].restarts == 3


def test_on_demand_is_never_taken_and_costs_the_on_demand_price() -> None:
    trace = _trace([(0, "add", "n0"), (600_000, "remove", "n0"), (3_600_000, "add", "n1")])
    r = Replay(trace, get_policy("spotvisor"), job=JOB, target_nodes=2,
               market=Market(on_demand=True, on_demand_usd_h=3.0)).run()
    assert r.lost_steps == 0 and r.restarts == 1
    assert r.cost_usd == pytest.approx(3.0 * r.node_hours)


def test_every_zone_short_of_capacity_for_days_replays_to_the_end() -> None:
    """Issue 25, item 13: a 16-node V100 pool whose two zones can sell nothing for a week
    (after the first hour) retries each offer thousands of times in a row; the capacity
    backoff once overflowed a float after ~1,500 of them and the replay died. It replays
    to the end, and the job trains at full size again once capacity returns."""
    from bench.replay.traces import Trace, ZoneSeries

    day = 86_400.0
    zones = {z: ZoneSeries(z, (0.0, 3600.0, 7 * day), (None, 0, None)) for z in ("us-east-1a", "us-east-1b")}
    trace = Trace(zones, 8 * day, "zones", "test: a week without capacity")
    r = Replay(trace, get_policy("spotvisor"), job=JobModel(target_steps=10**9, step_s=1.0, ref_gpus=16),
               target_nodes=16).run()
    assert r.hours == pytest.approx(8 * 24)
    assert r.timeline[-1][1] == 16  # the whole pool again at the end
    assert r.steps > 0


class _NeverGrows(Spotvisor):
    """The default, except that a running job never takes a new node."""

    name = "never_grows_test"

    def admit(self, s, rules, *, now):  # type: ignore[override]
        from daemon.control.lifecycle import JobState

        return [] if s.job is JobState.RUNNING else super().admit(s, rules, now=now)


def test_the_replay_runs_the_policys_own_decision() -> None:
    """Change a policy's admission and the replay changes with it (the daemon side of the
    same change: test_the_daemon_runs_the_policys_own_decision)."""
    trace = _trace([(0, "add", "n0"), (0, "add", "n1"), (600_000, "remove", "n1"), (900_000, "add", "n2"),
                    (3_600_000, "add", "n3")])
    default = Replay(trace, get_policy("spotvisor"), job=JOB, target_nodes=2).run()
    changed = Replay(trace, _NeverGrows(), job=JOB, target_nodes=2).run()
    assert default.world_hours.get(2, 0) > 0.5  # the replacement joined
    assert changed.world_hours.get(2, 0) < 0.2  # it never does
    assert changed.restarts < default.restarts


async def test_the_daemon_runs_the_policys_own_decision(spot_daemon) -> None:
    """The same change in the daemon: with the default a second node joins the running job;
    with the changed policy it stays ready."""
    h = spot_daemon
    sup = h.sup
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in sup.nodes.values()), what="launch")
    first = next(iter(sup.nodes.values()))
    sup.agents.on_register(first)
    await h.until(lambda: first.state is NodeState.RUNNING, what="job start")
    sup.intake.on_reports(first, [{"kind": "trainer_status", "line": {
        "event": "started", "attempt": "a1", "rank": 0, "world_size": 1, "step": 0, "time": 0.0}}])
    sup.policy = _NeverGrows()
    sup.operator.scale(2)
    await h.until(lambda: len(sup.nodes) == 2 and all(n.state is NodeState.LAUNCHING or n is first
                                                      for n in sup.nodes.values()), what="second launch")
    second = next(n for n in sup.nodes.values() if n is not first)
    sup.agents.on_register(second)
    for _ in range(3):
        await sup.reconcile_once()
    assert second.state is NodeState.READY  # the changed policy kept it out
    sup.policy = get_policy("spotvisor")
    await sup.reconcile_once()
    assert second.state in (NodeState.ADMITTING, NodeState.RUNNING)  # the default asks for the rejoin commit


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=25))
def test_invariants_on_random_markets(moves) -> None:
    """Whatever the market does: nothing negative, on-demand loses nothing, spotvisor loses
    nothing (a 120 s notice always covers its commit here), and nobody holds more nodes
    than the target."""
    events, alive, t, k = [(0, "add", "a0"), (0, "add", "a1")], ["a0", "a1"], 0, 2
    for minutes, add in moves:
        t += minutes * 60_000
        if add or not alive:
            events.append((t, "add", f"a{k}"))
            alive.append(f"a{k}")
            k += 1
        else:
            events.append((t, "remove", alive.pop(0)))
    events.append((t + 600_000, "add", f"a{k}"))
    trace = _trace(events)
    for name, market in (("spotvisor", Market()), ("restart_on_preemption", Market()),
                         ("spotvisor", Market(on_demand=True))):
        r = Replay(trace, get_policy(name), job=JOB, target_nodes=3, market=market).run()
        assert r.steps >= 0 and r.cost_usd >= 0 and r.lost_steps >= 0
        assert max(r.world_hours) <= 3
        if name == "spotvisor":
            assert r.lost_steps == 0


def test_cli_table_json_and_errors(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,n0\n0,add,n1\n1800000,remove,n1\n3600000,add,n2\n")
    out = tmp_path / "r.json"
    assert main(["--trace", str(trace), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "spotvisor" in table and "on_demand" in table and "USD/STEP" in table
    body = json.loads(out.read_text())
    assert set(body) == {"on_demand", "restart_on_preemption", "elastic_only", "spotvisor", "deadline_aware", "home_zone"}
    assert body["deadline_aware"]["deadline_met"] is None  # no --job-hours: no deadline
    assert body["on_demand"]["lost_steps"] == 0 and body["spotvisor"]["cost_usd"] < body["on_demand"]["cost_usd"]
    assert main(["--trace", str(tmp_path / "missing.csv")]) == 2
    assert main(["--trace", str(trace), "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "known:" in err and "Traceback" not in err


# derandomize: the same 60 examples every run. A random search found the counterexample
# below (issue 25's clean-clone run, 2026-12-03), on 3154ee1 as on this code: the claim
# does not hold for every market yet, and a suite must not fail at random on a known gap.
@settings(max_examples=60, deadline=None, derandomize=True)
@given(moves=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 4)), min_size=1, max_size=30),
       job_h=st.floats(0.5, 4.0), ratio=st.floats(1.05, 2.5), target=st.integers(1, 4))
def test_deadline_aware_never_misses_a_deadline_that_on_demand_meets(moves, job_h, ratio, target) -> None:
    """Any market (the spot capacity of one zone jumping between 0 and 4 nodes), any job
    length and deadline: when buying on-demand from the start finishes in time, the
    deadline-aware policy does too."""
    _deadline_aware_meets_what_on_demand_meets(moves, job_h, ratio, target)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(moves=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 4)), min_size=1, max_size=30),
       job_h=st.floats(0.5, 4.0), ratio=st.floats(1.05, 2.5), target=st.integers(1, 4))
def test_home_zone_never_misses_a_deadline_that_on_demand_meets(moves, job_h, ratio, target) -> None:
    """The same property for the home-zone policy: it waits on spot where deadline_aware
    would fill in with on-demand, and only its safety net buys on-demand."""
    _deadline_aware_meets_what_on_demand_meets(moves, job_h, ratio, target, policy="home_zone")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(moves=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 4)), min_size=1, max_size=30),
       job_h=st.floats(0.5, 4.0), ratio=st.floats(1.05, 2.5), target=st.integers(2, 4))
def test_home_zone_growing_in_process_never_misses_a_deadline_that_on_demand_meets(moves, job_h, ratio,
                                                                                     target) -> None:
    """The same, for a pool that grows in-process, whose safety net keeps 3 restarts in
    hand, not 5 (a lost node costs it a pause)."""
    _deadline_aware_meets_what_on_demand_meets(moves, job_h, ratio, target, policy="home_zone", grow_in_process=True)


@pytest.mark.xfail(strict=True, reason="known gap (issue 31): 5 % of slack, four spot nodes lost one by one in the "
                   "first 9 minutes; the safety net keeps 3 restarts in hand, the losses cost 4: late by 6 s")
def test_deadline_aware_with_less_slack_than_its_first_losses_cost() -> None:
    """The counterexample a random search found: on-demand from the start ends at 3.853 h,
    the deadline is 3.940 h, deadline-aware ends at 3.942 h. When the policy is fixed
    (a restart in hand for every spot node it holds, or starting on-demand when the slack
    is below what the pool's first losses cost), this passes and strict xfail says so."""
    _deadline_aware_meets_what_on_demand_meets([(1, 4), (5, 3), (1, 2), (1, 1), (1, 0)], 3.75, 1.05078125, 4)


def _deadline_aware_meets_what_on_demand_meets(moves, job_h, ratio, target, *, policy: str = "deadline_aware",
                                               grow_in_process: bool = False) -> None:
    events, alive, t, k = [], [], 0, 0
    for minutes, count in moves:
        while len(alive) < count:
            events.append((t, "add", f"a{k}"))
            alive.append(f"a{k}")
            k += 1
        while len(alive) > count:
            events.append((t, "remove", alive.pop()))
        t += minutes * 60_000
    horizon_ms = int(job_h * ratio * 3_600_000) + 3_600_000
    events.append((max(t, horizon_ms), "add", f"a{k}"))  # the trace outlasts the deadline
    trace = _trace(events)
    job = JobModel(target_steps=max(1, round(job_h * 3600)), step_s=1.0, ref_gpus=target, checkpoint_bytes=4e9)
    deadline = job_h * ratio * 3600
    od = Replay(trace, get_policy("spotvisor"), job=job, target_nodes=target, deadline_s=deadline,
                market=Market(on_demand=True)).run()
    if not od.deadline_met:
        return
    da = Replay(trace, get_policy(policy), job=job, target_nodes=target, deadline_s=deadline,
                grow_in_process=grow_in_process).run()
    assert da.deadline_met, (da.completed_at_h, deadline / 3600, od.completed_at_h)
    assert da.cost_usd <= od.cost_usd * 1.05 + 1.0  # and never much dearer than on-demand


# -- placement domains and whole-job migration ------------------------------------------------------

def _two_regions(east_out_at_s: float = 1800.0, hours: float = 6.0):
    """us-east-1a holds 2 spot nodes until ``east_out_at_s``, then none; us-west-2a always 2."""
    from bench.replay.traces import Trace, ZoneSeries

    east = ZoneSeries("us-east-1a", (0.0, east_out_at_s), (2, 0), (1.0, 1.0))
    west = ZoneSeries("us-west-2a", (0.0,), (2,), (1.2,))
    return Trace({"us-east-1a": east, "us-west-2a": west}, hours * 3600, "zones", "test")


def _replay(trace, policy: str = "spotvisor", **kw):
    return Replay(trace, get_policy(policy), job=JOB, target_nodes=2, zones=["us-east-1a", "us-west-2a"],
                  domains={"us-east-1a": "us-east-1", "us-west-2a": "us-west-2"}, **kw).run()


def test_a_starved_region_moves_the_whole_job_and_it_never_spans_two() -> None:
    """us-east-1 runs dry: after the patience the whole job moves to us-west-2 (one
    migration, its egress billed, no step lost); it never trains on nodes of both."""
    spans: list[float] = []
    r = Replay(_two_regions(), get_policy("spotvisor"), job=JOB, target_nodes=2, zones=["us-east-1a", "us-west-2a"],
               domains={"us-east-1a": "us-east-1", "us-west-2a": "us-west-2"})
    advance = r._advance

    def watch(to: float) -> None:
        if len({n.domain for n in r.nodes.values() if n.state in ADMITTED}) > 1:
            spans.append(r.now)
        advance(to)

    r._advance = watch  # type: ignore[method-assign]
    res = r.run()
    assert (res.migrations, res.migrations_failed, res.lost_steps) == (1, 0, 0)
    assert res.egress_usd == pytest.approx(JOB.checkpoint_bytes / 1e9 * 0.02)
    assert res.domain_hours["us-west-2"] > 5 and spans == []
    stay = _replay(_two_regions(), migration=None)  # the move off: the job waits in us-east-1
    assert stay.migrations == 0 and stay.steps < res.steps / 2


def test_home_zone_waits_out_a_short_outage_and_moves_off_one_that_outlasts_the_slack() -> None:
    """us-east-1 is out for 20 min (a 3-hour job, 6 hours to its deadline): the home-zone
    policy waits for it (no move, no on-demand hour) where the default moves after its
    patience; out for good, it moves to us-west-2 once the outage outlasts the slack and
    meets the deadline."""
    from bench.replay.traces import Trace, ZoneSeries

    east = ZoneSeries("us-east-1a", (0.0, 1800.0, 3000.0), (2, 0, 2), (1.0, 1.0, 1.0))
    west = ZoneSeries("us-west-2a", (0.0,), (2,), (1.2,))
    short = Trace({"us-east-1a": east, "us-west-2a": west}, 8 * 3600, "zones", "test")
    job = JobModel(target_steps=3 * 3600, step_s=1.0, ref_gpus=2, checkpoint_bytes=4e9)
    kw = dict(job=job, target_nodes=2, zones=["us-east-1a", "us-west-2a"], deadline_s=6 * 3600,
              domains={"us-east-1a": "us-east-1", "us-west-2a": "us-west-2"}, migration=Plan(patience_s=300))
    home = Replay(short, get_policy("home_zone"), **kw).run()
    eager = Replay(short, get_policy("deadline_aware"), **kw).run()
    assert home.deadline_met and home.migrations == 0 and eager.migrations == 1
    gone = Replay(_two_regions(hours=8), get_policy("home_zone"), **kw).run()
    assert gone.deadline_met and gone.migrations == 1 and gone.domain_hours["us-west-2"] > 2


class _Stays(Spotvisor):
    """The default, except that it never moves the job."""

    name = "stays_test"

    def migrate(self, *args, **kw):  # type: ignore[override]
        return None


def test_the_replay_moves_by_the_policys_own_decision() -> None:
    """A policy that says stay keeps the job in the starved region in the replay as in the
    daemon (tests/chaos/test_migration.py::test_the_recovery_policy_decides_whether_to_move)."""
    r = Replay(_two_regions(), _Stays(), job=JOB, target_nodes=2, zones=["us-east-1a", "us-west-2a"],
               domains={"us-east-1a": "us-east-1", "us-west-2a": "us-west-2"}).run()
    assert r.migrations == 0 and r.domain_hours == {"us-east-1": pytest.approx(6.0)}


def test_a_move_to_a_region_without_capacity_fails_fast_and_the_job_stays() -> None:
    from bench.replay.traces import Trace, ZoneSeries

    east = ZoneSeries("us-east-1a", (0.0, 1800.0), (2, 0))
    west = ZoneSeries("us-west-2a", (0.0,), (0,))
    r = _replay(Trace({"us-east-1a": east, "us-west-2a": west}, 4 * 3600, "zones", "test"))
    assert r.migrations == 0 and r.migrations_failed >= 1 and r.lost_steps == 0
    assert r.domain_hours == {"us-east-1": pytest.approx(4.0)}
