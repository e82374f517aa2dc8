"""daemon/control/deadline.py: which markets a job with a deadline may buy from."""

from __future__ import annotations

from daemon.control.actions import MarkReplacing, NodeView, PoolState
from daemon.control.deadline import BOTH, ON_DEMAND_ONLY, SPOT_ONLY, Progress, back_to_spot, markets
from daemon.control.lifecycle import JobState, NodeState

# 100 h of work at 1 step/s (360,000 steps), deadline 150 h, a restart costs 0.2 h
P = dict(target_steps=360_000, started_at=0.0, deadline=150 * 3600.0, step_s=1.0, restart_s=720.0)
H = 3600.0


def test_ahead_of_the_uniform_line_buys_spot_only() -> None:
    assert markets(Progress(step=45 * 3600, **P), now=60 * H) == SPOT_ONLY  # 45 h done, the line is at 40 h


def test_behind_the_line_may_fall_back_to_on_demand() -> None:
    assert markets(Progress(step=35 * 3600, **P), now=60 * H) == BOTH


def test_behind_by_less_than_one_restart_waits_for_spot() -> None:
    """A job the length of one restart (720 steps here) behind its line is not behind yet:
    the start itself puts every job there, and the safety net keeps the deadline."""
    assert markets(Progress(step=40 * 3600 - 700, **P), now=60 * H) == SPOT_ONLY
    assert markets(Progress(step=40 * 3600 - 740, **P), now=60 * H) == BOTH


def test_just_ahead_is_not_ahead_enough_to_go_back() -> None:
    """After on-demand, within two restarts' worth of steps of the line the pool keeps its
    on-demand nodes; a job on spot just ahead stays on spot."""
    assert markets(Progress(step=40 * 3600 + 1000, **P), now=60 * H, previous=BOTH) == BOTH
    assert markets(Progress(step=40 * 3600 + 2000, **P), now=60 * H, previous=BOTH) == SPOT_ONLY
    assert markets(Progress(step=40 * 3600 + 1000, **P), now=60 * H, previous=SPOT_ONLY) == SPOT_ONLY
    assert markets(Progress(step=0, **P), now=0.0) == SPOT_ONLY  # the start is on the line, not behind it


def test_the_safety_net_buys_on_demand_only_once_the_rest_barely_fits() -> None:
    # 70 h left to train, 70.5 h to the deadline: less than 3 restarts of slack
    assert markets(Progress(step=30 * 3600, **P), now=79.5 * H) == ON_DEMAND_ONLY
    assert markets(Progress(step=30 * 3600, **P), now=70 * H) == BOTH
    assert markets(Progress(step=360_000, **P), now=149 * H) == SPOT_ONLY  # done


def _node(i: int, market: str, state: NodeState = NodeState.RUNNING, replacing: bool = False) -> NodeView:
    return NodeView(id=f"n{i}", state=state, gpus=1, created_at=0.0, ordinal=i, market=market, replacing=replacing)


def test_back_on_spot_the_on_demand_nodes_in_the_job_are_replaced_make_before_break() -> None:
    s = PoolState(nodes=(_node(1, "spot"), _node(2, "on_demand"), _node(3, "on_demand", replacing=True),
                         _node(4, "on_demand", NodeState.READY)), job=JobState.RUNNING, target_nodes=3)
    assert back_to_spot(s, SPOT_ONLY) == [MarkReplacing("n2", "deadline_slack")]
    assert back_to_spot(s, BOTH) == [] and back_to_spot(s, ON_DEMAND_ONLY) == []


def test_a_move_built_from_spot_narrows_the_markets_but_never_past_the_policy() -> None:
    from daemon.control.deadline import narrow

    assert narrow(BOTH, SPOT_ONLY) == SPOT_ONLY
    assert narrow(ON_DEMAND_ONLY, SPOT_ONLY) == ON_DEMAND_ONLY  # near the deadline the policy's word wins
    assert narrow(None, SPOT_ONLY) is None and narrow(BOTH, None) == BOTH


def test_a_move_in_flight_narrows_the_markets_of_the_domain_being_built_only() -> None:
    """A move made to find spot builds its target from spot alone; the job's own domain
    (and any other) keeps what the policy allows."""
    from daemon.control.deadline import markets_for

    assert markets_for("b", build_domain="b", allowed=BOTH, move_markets=SPOT_ONLY) == SPOT_ONLY
    assert markets_for("a", build_domain="b", allowed=BOTH, move_markets=SPOT_ONLY) == BOTH
    assert markets_for("b", build_domain="b", allowed=ON_DEMAND_ONLY, move_markets=SPOT_ONLY) == ON_DEMAND_ONLY
    assert markets_for("a", build_domain="a", allowed=None, move_markets=None) is None


def test_a_market_change_is_reported_with_the_figures_behind_it_but_not_the_first_answer() -> None:
    from daemon.control.deadline import market_change

    p = Progress(step=35 * 3600, **P)
    change = market_change(p, SPOT_ONLY, BOTH, now=60 * H, first=False)
    assert change == {"old": ["spot"], "new": ["on_demand", "spot"], "step": 35 * 3600, "target_steps": 360_000,
                      "hours_to_deadline": 90.0, "hours_of_work_left": 65.0}
    assert market_change(p, None, SPOT_ONLY, now=60 * H, first=True) is None  # the policy's first answer
    assert market_change(p, BOTH, BOTH, now=60 * H, first=False) is None  # no change
    assert market_change(None, SPOT_ONLY, BOTH, now=60 * H, first=False) is None  # no deadline


def test_the_status_line_says_when_the_job_would_finish_and_the_slack_left() -> None:
    from daemon.control.deadline import deadline_status

    line = deadline_status(Progress(step=35 * 3600, **P), BOTH, now=60 * H)
    # 65 h of work left at 60 h: finish at 125 h, 25 h before the 150 h deadline
    assert line == {"deadline": 150 * H, "hours_to_deadline": 90.0, "hours_of_work_left": 65.0,
                    "expected_finish": 125 * H, "slack_h": 25.0, "markets": ["on_demand", "spot"]}
    assert deadline_status(Progress(step=0, **P), None, now=60 * H)["slack_h"] == -10.0  # late: 100 h from 60 h
