"""What the daemon has seen of each domain's capacity (daemon/control/availability.py)
and the home-zone decision made of it (daemon/control/homezone.py, policies.HomeZone)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.actions import PoolState
from daemon.control.availability import MAX_CHANGES, MEMORY_S, Availability, progress_rate, rest_of_run, seeded
from daemon.control.deadline import ON_DEMAND_ONLY, SPOT_ONLY, Progress
from daemon.control.homezone import decide
from daemon.control.lifecycle import JobState
from daemon.control.migration import DomainView, Plan
from daemon.control.offers import History, Offer
from daemon.control.policies import DEFAULT_POLICY, deadline_policy, get_policy

H = 3600.0


def _record(*runs: tuple[bool, float], domain: str = "east", t0: float = 0.0) -> tuple[Availability, float]:
    """A record of consecutive runs ``(up, hours)``; returns it and the time at its end."""
    av, t = Availability(), t0
    for up, hours in runs:
        av = av.observe(domain, up, t)
        t += hours * H
    return av, t


def test_the_docstrings_example() -> None:
    av, now = _record((True, 10), (False, 2), (True, 4), (False, 1))
    assert progress_rate(av, "east", now, 720.0) == pytest.approx((9.8 + 3.8 + 6) / 23)
    assert rest_of_run(av, "east", now) == pytest.approx(1 * H)
    assert progress_rate(av, "west", now, 720.0) is None and rest_of_run(av, "west", now) is None


def test_an_outage_longer_than_any_before_is_expected_to_last_as_long_again() -> None:
    av, now = _record((True, 5), (False, 1), (True, 5), (False, 3))
    assert rest_of_run(av, "east", now) == pytest.approx(3 * H)
    up, now_up = _record((True, 5), (False, 1), (True, 2))
    assert rest_of_run(up, "east", now_up) == pytest.approx(3 * H)  # the past up-run of 5 h, 2 h in


def test_one_capacity_error_at_the_start_is_not_a_domain_that_never_trains() -> None:
    av = Availability().observe("east", False, 0.0)
    assert progress_rate(av, "east", 60.0, 720.0) == pytest.approx(6 * H / (6 * H + 60))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20 * H), st.sampled_from([True, False, None])), max_size=400))
def test_the_record_stays_bounded_and_alternates(steps) -> None:
    """Any observations (up, down, unwatched), any gaps: at most MAX_CHANGES per domain,
    none older than the memory (but the one that says the state at its cut), each change
    unlike the one before, in time order; the rate stays in [0, 1] and the rest of a run
    is non-negative, or unknown exactly while the domain is not watched."""
    av, t = Availability(), 0.0
    for gap, up in steps:
        t += gap
        av = av.observe("east", up, t)
        if not av.known("east"):
            assert up is None and progress_rate(av, "east", t, 720.0) is None
            continue
        seen = av.changes["east"]
        assert len(seen) <= MAX_CHANGES
        assert all(a[1] != b[1] and a[0] <= b[0] for a, b in zip(seen, seen[1:]))
        assert seen[0][0] >= t - MEMORY_S and seen[-1][1] == up
        assert 0.0 <= progress_rate(av, "east", t, 720.0) <= 1.0 + 1e-9
        rest = rest_of_run(av, "east", t)
        assert (rest is None) == (up is None) and (rest is None or rest >= 0.0)


def test_the_time_a_domain_is_not_watched_counts_neither_way() -> None:
    """The job was in east 10 h (up 8 h, down 2 h), then moved away for 30 h: east's rate
    is that of its 10 watched hours, and its current state is unknown."""
    av, t = _record((True, 8), (False, 2))
    av = av.observe("east", None, t)
    assert progress_rate(av, "east", t + 30 * H, 720.0) == pytest.approx((8 * H - 720 + 6 * H) / (10 * H + 6 * H))
    assert av.is_up("east") is None and rest_of_run(av, "east", t + 30 * H) is None


def test_an_observation_older_than_the_last_change_changes_nothing() -> None:
    av = Availability().observe("east", True, 100.0).observe("east", False, 200.0)
    assert av.observe("east", True, 150.0) is av and av.observe("east", False, 300.0) is av


# -- the past: what other pools saw (seeded) ------------------------------------------------


def test_a_new_pool_reads_the_newest_other_pools_past_before_its_own_first_word() -> None:
    """Pool A watched west until 10 h (up 6 h, down 4 h), pool B until 12 h (up 12 h): at
    13 h a new pool has west's past from B (the newest last change) and east's from A. It
    launched in east (up) at 12.5 h: east reads A's down then up, and from 12.5 h its own
    word only; what it sees next adds to that."""
    a = {"west": [(0.0, True), (6 * H, False), (10 * H, None)], "east": [(0.0, False), (1 * H, True), (12.8 * H, False)]}
    b = {"west": [(0.0, True), (12 * H, None)]}
    own = Availability().observe("east", True, 12.5 * H)
    out = seeded(own, [a, b], 13 * H)
    assert out.changes["west"] == ((0.0, True), (12 * H, None))
    assert out.changes["east"] == ((0.0, False), (1 * H, True))  # A's later "down" is not taken: its own "up" stands
    assert progress_rate(out, "west", 13 * H, 720.0) == pytest.approx((12 * H - 720 + 6 * H) / (12 * H + 6 * H))
    later = out.observe("west", False, 13.5 * H)
    assert later.changes["west"][-1] == (13.5 * H, False) and rest_of_run(later, "west", 14 * H) == 0.5 * H
    assert seeded(own, [], 13 * H) is own and seeded(own, [{"east": [(13 * H, False)]}], 13 * H) is own


def test_the_docstrings_seeding_example() -> None:
    own = Availability().observe("west", True, 9 * H)
    out = seeded(own, [{"west": [(0.0, True), (6 * H, False), (10 * H, True)]}], 11 * H)
    assert out.changes["west"] == ((0.0, True), (6 * H, False), (9 * H, True))


def test_a_seed_keeps_only_the_memory_and_nothing_after_now() -> None:
    other = {"west": [(0.0, True), (10 * H, False), (60 * H, True), (100 * H, False)]}
    out = seeded(Availability(), [other], 70 * H)
    assert out.changes["west"] == ((70 * H - MEMORY_S, False), (60 * H, True))


def _state_at(changes, t: float):
    states = [up for at, up in changes if at <= t]
    return states[-1] if states else "none"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["east", "west", "north"]),
                                st.lists(st.tuples(st.floats(0, 100 * H), st.sampled_from([True, False, None])),
                                         max_size=30), max_size=3), max_size=4),
       st.lists(st.tuples(st.sampled_from(["east", "west", "north"]), st.floats(0, 50 * H),
                          st.sampled_from([True, False, None])), max_size=20),
       st.floats(50 * H, 100 * H))
def test_a_seed_is_a_well_formed_record_that_never_overrides_the_pools_own_word(others, observed, now) -> None:
    """Any other pools' records, in any order, with changes after ``now`` or repeated, and
    any own record: every domain's record alternates, in time order, within the memory
    before ``now``; from the pool's own first observation of a domain on, its state at
    every own change and at ``now`` is the pool's own."""
    own = Availability()
    for domain, t, up in sorted(observed, key=lambda o: o[1]):
        own = own.observe(domain, up, t)
    out = seeded(own, others, now)
    for d, seen in out.changes.items():
        assert all(a[1] != b[1] and a[0] <= b[0] for a, b in zip(seen, seen[1:]))
        assert seen[-1][0] <= now and (seen == own.changes.get(d) or now - MEMORY_S <= seen[0][0])
        mine = own.changes.get(d, ())
        for t in [*(c[0] for c in mine), now]:
            if mine and t >= mine[0][0]:
                assert _state_at(seen, t) == _state_at(mine, t), (d, t)


# -- the decision -----------------------------------------------------------------------------


def _domains(west_price: float = 1.0) -> list[DomainView]:
    east = DomainView("east", (Offer(0, "aws", "us-east-1", "us-east-1a", "p3", 1, False, 1.0),),
                      egress_usd_per_gb=0.02)
    west = DomainView("west", (Offer(1, "aws", "us-west-2", "us-west-2a", "p3", 1, False, west_price),))
    return [east, west]


def _progress(work_h: float, left_h: float, now: float, *, step: int = 1) -> Progress:
    """``work_h`` hours of work left after ``step`` steps of 1 s (1: the job has trained)."""
    return Progress(step=step, target_steps=step + int(work_h * 3600), started_at=0.0, deadline=now + left_h * H,
                    step_s=1.0, restart_s=720.0)


def test_the_home_waits_while_the_slack_covers_its_outage_then_moves() -> None:
    """The module's example: 30 h of work, 50 h left; home out 10 min, its outages 3 h
    long, rate 0.8 or so: wait. With 40 h left it cannot: move west (it fits)."""
    av, now = _record((True, 12), (False, 3), (True, 12), (False, 3), (True, 12), (False, 1 / 6))
    rate = progress_rate(av, "east", now, 720.0)
    d = decide(_progress(30, 50, now), _domains(), "east", History(), av, now=now, starved=True,
               checkpoint_bytes=int(50e9), gpus=1)
    assert d.action == "wait" and d.wait_s == pytest.approx((3 - 1 / 6) * H + 720 + 30 * H / rate)
    d = decide(_progress(30, 40, now), _domains(), "east", History(), av, now=now, starved=True,
               checkpoint_bytes=int(50e9), gpus=1)
    assert (d.action, d.target) == ("move", "west") and d.move_s == pytest.approx(720 + 100 + 30 * H)
    assert decide(_progress(30, 40, now), _domains(), "east", History(), av, now=now, starved=False,
                  checkpoint_bytes=None, gpus=1).action == "stay"


def test_no_move_to_a_domain_that_would_finish_later_than_waiting() -> None:
    """West is known to be down for good and slow: nothing finishes sooner than waiting."""
    av, now = _record((True, 12), (False, 3), (True, 12), (False, 1))
    av = av.observe("west", True, 0.0).observe("west", False, 1 * H)
    d = decide(_progress(30, 33, now), _domains(), "east", History(), av, now=now, starved=True,
               checkpoint_bytes=int(50e9), gpus=1)
    assert d.action == "wait" and d.reason == "no domain finishes sooner than waiting"


def test_the_policy_moves_only_on_the_decision_and_buys_on_demand_only_at_the_safety_net() -> None:
    p = get_policy("home_zone")
    av, now = _record((True, 12), (False, 3), (True, 12), (False, 1 / 6))
    s = PoolState(nodes=(), job=JobState.RUNNING, desired_nodes=1, target_nodes=1)
    kw = dict(now=now, plan=Plan(), starved_since=now - 600, checkpoint_bytes=int(50e9), last_move_ended_at=None,
              gpus=1, availability=av)
    assert p.migrate(s, _domains(), "east", History(), progress=_progress(30, 50, now), **kw) is None  # waits
    move = p.migrate(s, _domains(), "east", History(), progress=_progress(30, 40, now), **kw)
    assert (move.target, move.reason, move.markets) == ("west", "home_out", SPOT_ONLY)
    assert move.why["decision"] == "east's outage outlasts the slack; west fits it" and move.why["left_s"] == 40 * H
    cooled = {**kw, "last_move_ended_at": now - 60}
    assert p.migrate(s, _domains(), "east", History(), progress=_progress(30, 40, now), **cooled) is None
    shown = p.placement(s, _domains(), "east", History(), progress=_progress(30, 40, now), **cooled)
    assert (shown.action, shown.reason) == ("wait", "a move ended within the cooldown")  # what status says
    assert p.markets(_progress(30, 50, now), now=now) == SPOT_ONLY
    assert p.markets(_progress(30, 30.1, now), now=now) == ON_DEMAND_ONLY
    assert p.markets(None, now=now) is None


def test_the_safety_net_keeps_fewer_restarts_where_a_lost_node_costs_a_pause() -> None:
    """30 h of work, 30.8 h left: 4 restarts' worth of slack (720 s each). A pool whose
    replacements restart it keeps 5 in hand: on-demand only now. One that grows in-process
    (``Progress.grows_in_process``: a lost node is a shrink and a grow, no restart) keeps 3:
    spot still."""
    p, now = get_policy("home_zone"), 100 * H
    tight = _progress(30, 30.8, now)
    assert p.markets(tight, now=now) == ON_DEMAND_ONLY
    assert p.markets(dataclasses.replace(tight, grows_in_process=True), now=now) == SPOT_ONLY
    assert p.markets(dataclasses.replace(_progress(30, 30.5, now), grows_in_process=True), now=now) == ON_DEMAND_ONLY


def test_the_daemon_counts_a_pool_of_several_in_process_growers_as_such() -> None:
    """``Progress.grows_in_process`` from the config: ``job.grow: in_process`` and a target
    of more than one node (one node lost is the whole job: a restart)."""
    from daemon.config import Config
    from daemon.controlnode.placement import Placement

    def progress(grow: str, target: int) -> Progress:
        config = Config.model_validate({
            "pool": {"name": "t", "min_nodes": 1, "target_nodes": target, "max_nodes": 4, "on_demand_fallback": True},
            "job": {"id": "j", "module": "standin_trainer", "target_steps": 3600, "deadline": 2.0, "step_s": 1.0,
                    "grow": grow},
            "offers": [{"provider": "local", "gpus_per_node": 1},
                       {"provider": "local", "gpus_per_node": 1, "market": "on_demand"}]})
        core = SimpleNamespace(config=config, job=SimpleNamespace(step=10), target_nodes=target,
                               store=SimpleNamespace(events=lambda **kw: [SimpleNamespace(time=100.0)]))
        got = Placement(core, usable_offers=lambda: [], building=lambda: ("local", None)).progress(200.0)  # type: ignore[arg-type]
        assert got is not None
        return got

    assert progress("in_process", 2).grows_in_process
    assert not progress("in_process", 1).grows_in_process
    assert not progress("restart", 2).grows_in_process


@pytest.mark.parametrize("requested, target, grow, runs", [
    ("auto", 2, "in_process", "home_zone"),  # never above deadline_aware in the replays' windows
    ("auto", 6, "in_process", "home_zone"),
    ("auto", 1, "in_process", "deadline_aware"),  # one node: no survivor to grow into
    ("auto", 3, "restart", "deadline_aware"),  # Parcae's HH window: each grow a restart cost it
    ("deadline_aware", 3, "in_process", "deadline_aware"),  # what the operator asked for
    ("home_zone", 1, "restart", "home_zone"),
])
def test_the_daemon_spends_a_deadline_with_the_policy_its_pool_is_measured_best_with(
        requested: str, target: int, grow: str, runs: str) -> None:
    """``job.deadline_policy`` (default ``auto``) resolved from the config, and run by the
    daemon's supervisor; no deadline: the default policy, whatever is asked."""
    from daemon.config import Config

    def config(deadline: float | None) -> Config:
        return Config.model_validate({
            "pool": {"name": "t", "min_nodes": 1, "target_nodes": target, "max_nodes": 8, "on_demand_fallback": True},
            "job": {"id": "j", "module": "standin_trainer", "target_steps": 3600, "deadline": deadline,
                    "step_s": 1.0, "grow": grow, "deadline_policy": requested},
            "offers": [{"provider": "local", "gpus_per_node": 1},
                       {"provider": "local", "gpus_per_node": 1, "market": "on_demand"}]})

    from daemon.interfaces.preflight_cli import spending_line

    assert config(2.0).spending_policy() == runs
    assert config(None).spending_policy() == DEFAULT_POLICY
    line = spending_line(config(2.0))  # check-config's line: which one, and why
    assert line.startswith(f"deadline: spent by {runs} (job.deadline_policy"), line
    assert (f"{target} nodes that grow in process" in line) == (requested == "auto" and runs == "home_zone"), line
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        deadline_policy("nope", target_nodes=target, grow=grow)


def test_before_the_job_trained_a_starved_home_is_left_for_a_region_with_spot() -> None:
    """Nothing trained yet: the home is only where the job started and a move copies
    nothing, so a starved home is left at once for a region with spot, though the slack
    would cover the wait; once the job has trained, the same outage is waited out."""
    av = Availability().observe("east", True, 0.0).observe("east", False, 60.0)
    d = decide(_progress(30, 50, 120.0, step=0), _domains(), "east", History(), av, now=120.0, starved=True,
               checkpoint_bytes=None, gpus=1)
    assert (d.action, d.target) == ("move", "west") and "before the job trained" in d.reason
    d = decide(_progress(30, 50, 120.0), _domains(), "east", History(), av, now=120.0, starved=True,
               checkpoint_bytes=int(50e9), gpus=1)
    assert d.action == "wait"
