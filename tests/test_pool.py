"""pool.plan(): table-driven, with an injected clock (``now``) and exact action lists."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import pytest

from daemon.model import NodeState as S, TrainerState
from daemon.control.pool import (
    Action,
    Desired,
    History,
    Launch,
    MarkLost,
    NodeView,
    Offer,
    Terminate,
    Timeouts,
    heartbeat_interval_s,
    plan,
    rank_offers,
)

NOW = 100_000.0
TIMEOUTS = Timeouts(heartbeat_timeout_s=20.0, launch_timeout_s=180.0, drain_grace_s=30.0)
_NO_HEARTBEAT_YET = {S.REQUESTED, S.LAUNCHING}


def offer(index: int, *, gpus: int = 1, price: float | None = 1.0, max_price: float | None = None) -> Offer:
    return Offer(
        index=index,
        provider="local",
        region="local",
        zone=f"local-{index}",
        instance_type=f"t{index}",
        gpus_per_node=gpus,
        price_usd_h=price,
        max_price_usd_h=max_price,
    )


def node(
    id: str,
    state: S,
    *,
    age_s: float = 1000.0,
    hb_age_s: float | None = 1.0,
    gpus: int = 1,
    deadline_in_s: float | None = None,
    told_s: float | None = None,
) -> NodeView:
    """A node created ``age_s`` ago whose last heartbeat was ``hb_age_s`` ago, told to
    heartbeat every ``told_s`` (None: not told).

    Nodes that cannot have heartbeated yet (requested, launching) get none.
    """
    hb = NOW - hb_age_s if (hb_age_s is not None and state not in _NO_HEARTBEAT_YET) else None
    return NodeView(
        id=id,
        state=state,
        gpus=gpus,
        # a node in the job runs its trainer unless a case says otherwise
        trainer=TrainerState.RUNNING if state in (S.RUNNING, S.DRAINING) else TrainerState.NOT_STARTED,
        created_at=NOW - age_s,
        last_heartbeat=hb,
        deadline=None if deadline_in_s is None else NOW + deadline_in_s,
        heartbeat_interval_s=told_s,
    )


def up(*, offer_index: int = 0) -> Launch:
    return Launch(offer_index, "below_target")


def scale_in(node_id: str) -> Terminate:
    return Terminate(node_id, "scale_in")


@dataclass(frozen=True)
class Case:
    id: str
    target: int
    observed: list[NodeView]
    expected: list[Action]
    offers: list[Offer] = field(default_factory=lambda: [offer(0)])
    backoff: dict[int, float] = field(default_factory=dict)
    valid: frozenset[int] | None = None


CASES = [
    # --- growing from nothing, offer choice -------------------------------------------
    Case(
        "empty_pool_launches_target_from_cheapest",
        target=3,
        observed=[],
        offers=[offer(0, price=3.0), offer(1, price=2.0), offer(2, price=2.5)],
        expected=[up(offer_index=1)] * 3,
    ),
    Case(
        "requested_node_counts_no_double_launch",
        target=2,
        observed=[node("a", S.RUNNING), node("b", S.REQUESTED, age_s=1)],
        expected=[],
    ),
    Case(
        "cheapest_per_gpu_hour_not_per_node",
        target=1,
        observed=[],
        # 1 GPU at $1.00 = 1.00/GPU-h; 4 GPUs at $2.00 = 0.50/GPU-h
        offers=[offer(0, gpus=1, price=1.0), offer(1, gpus=4, price=2.0)],
        expected=[up(offer_index=1)],
    ),
    Case(
        "tie_broken_by_config_order",
        target=1,
        observed=[],
        offers=[offer(1, price=1.0), offer(0, gpus=2, price=2.0)],
        expected=[up(offer_index=0)],
    ),
    Case(
        "unknown_price_ranks_last",
        target=1,
        observed=[],
        offers=[offer(0, price=None), offer(1, price=50.0)],
        expected=[up(offer_index=1)],
    ),
    Case(
        "offer_in_backoff_skipped",
        target=1,
        observed=[],
        offers=[offer(0, price=1.0), offer(1, price=2.0)],
        backoff={0: NOW + 10},
        expected=[up(offer_index=1)],
    ),
    Case(
        "offer_backoff_ended_usable_again",
        target=1,
        observed=[],
        offers=[offer(0, price=1.0), offer(1, price=2.0)],
        backoff={0: NOW},
        expected=[up(offer_index=0)],
    ),
    Case(
        "price_above_cap_skipped",
        target=1,
        observed=[],
        offers=[offer(0, price=1.6, max_price=1.5), offer(1, price=2.0, max_price=3.0)],
        expected=[up(offer_index=1)],
    ),
    Case(
        "price_equal_to_cap_usable",
        target=1,
        observed=[],
        offers=[offer(0, price=1.5, max_price=1.5), offer(1, price=2.0)],
        expected=[up(offer_index=0)],
    ),
    Case(
        "no_usable_offer_no_launch",
        target=2,
        observed=[],
        offers=[offer(0, price=1.0), offer(1, price=9.0, max_price=1.0)],
        backoff={0: NOW + 60},
        expected=[],
    ),
    # --- world-size validity (valid {1, 2, 3, 6}; 4-GPU offer is cheaper per GPU-h) ----
    Case(
        "world_valid_first_node_avoids_invalid_4",
        target=1,
        observed=[],
        offers=[offer(0, gpus=4, price=2.0), offer(1, gpus=1, price=1.0)],
        valid=frozenset({1, 2, 3, 6}),
        expected=[up(offer_index=1)],
    ),
    Case(
        "world_valid_counts_gpus_launched_in_same_plan",
        target=2,
        observed=[],
        offers=[offer(0, gpus=4, price=2.0), offer(1, gpus=1, price=1.0)],
        valid=frozenset({1, 2, 3, 6}),
        expected=[up(offer_index=1), up(offer_index=1)],
    ),
    Case(
        "world_valid_second_pick_sees_first_picks_gpus",
        target=2,
        observed=[],
        # 2-GPU offer is cheapest: 0+2=2 valid, then 2+2=4 invalid so 2+1=3
        offers=[offer(0, gpus=2, price=1.0), offer(1, gpus=1, price=1.0)],
        valid=frozenset({1, 2, 3, 6}),
        expected=[up(offer_index=0), up(offer_index=1)],
    ),
    Case(
        "world_valid_picks_cheap_4_when_2_plus_4_is_6",
        target=3,
        observed=[node("a", S.RUNNING), node("b", S.RUNNING)],
        offers=[offer(0, gpus=4, price=2.0), offer(1, gpus=1, price=1.0)],
        valid=frozenset({1, 2, 3, 6}),
        expected=[up(offer_index=0)],
    ),
    Case(
        "world_valid_impossible_falls_back_to_cheapest",
        target=4,
        observed=[node("a", S.RUNNING), node("b", S.RUNNING), node("c", S.RUNNING)],
        offers=[offer(0, gpus=4, price=2.0), offer(1, gpus=1, price=1.0)],
        valid=frozenset({1, 2, 3, 6}),
        expected=[up(offer_index=0)],  # 3+4=7 and 3+1=4 both invalid
    ),
    Case(
        "world_any_size_takes_cheapest",
        target=1,
        observed=[],
        offers=[offer(0, gpus=4, price=2.0), offer(1, gpus=1, price=1.0)],
        valid=None,
        expected=[up(offer_index=0)],
    ),
    # --- spot behaviour: draining does not count --------------------------------------
    Case(
        "draining_node_replaced_at_once",
        target=3,
        observed=[
            node("a", S.RUNNING),
            node("b", S.DRAINING, deadline_in_s=60),
            node("c", S.RUNNING),
        ],
        expected=[up()],
    ),
    Case(
        "draining_node_not_scaled_in",
        target=1,
        observed=[node("a", S.RUNNING), node("b", S.DRAINING, deadline_in_s=60)],
        expected=[],
    ),
    # --- heartbeats -------------------------------------------------------------------
    Case(
        "stale_heartbeat_marked_lost_and_replaced",
        target=2,
        observed=[node("a", S.RUNNING, hb_age_s=20.5), node("b", S.RUNNING)],
        expected=[MarkLost("a", "heartbeat_lost"), up()],
    ),
    Case(
        "heartbeat_exactly_at_timeout_not_lost",
        target=2,
        observed=[node("a", S.RUNNING, hb_age_s=20.0), node("b", S.RUNNING)],
        expected=[],
    ),
    Case(
        "stale_heartbeat_ready_node_lost",
        target=1,
        observed=[node("a", S.READY, hb_age_s=60)],
        expected=[MarkLost("a", "heartbeat_lost"), up()],
    ),
    Case(
        "stale_heartbeat_draining_node_lost_no_extra_launch",
        target=1,
        observed=[node("a", S.DRAINING, hb_age_s=60, deadline_in_s=10), node("b", S.RUNNING)],
        expected=[MarkLost("a", "heartbeat_lost")],
    ),
    # a big pool: the daemon told the node a longer interval, its timeout is 2 x it + 10 s grace
    Case(
        "told_20s_silent_15s_not_lost",
        target=1,
        observed=[node("a", S.RUNNING, hb_age_s=15, told_s=20.0)],
        expected=[],
    ),
    Case(
        "told_20s_silent_30s_not_lost_past_the_floor",
        target=1,
        observed=[node("a", S.RUNNING, hb_age_s=30, told_s=20.0)],
        expected=[],
    ),
    Case(
        "told_20s_silent_50s_not_lost_at_its_timeout",
        target=1,
        observed=[node("a", S.RUNNING, hb_age_s=50, told_s=20.0)],
        expected=[],
    ),
    Case(
        "told_20s_silent_51s_lost",
        target=1,
        observed=[node("a", S.RUNNING, hb_age_s=51, told_s=20.0)],
        expected=[MarkLost("a", "heartbeat_lost"), up()],
    ),
    Case(
        "told_1s_keeps_the_20s_floor",
        target=2,
        observed=[node("a", S.RUNNING, hb_age_s=20.5, told_s=1.0), node("b", S.RUNNING, hb_age_s=19, told_s=1.0)],
        expected=[MarkLost("a", "heartbeat_lost"), up()],
    ),
    # --- launch timeout ---------------------------------------------------------------
    Case(
        "launch_timeout_fails_node_and_replaces",
        target=1,
        observed=[node("a", S.LAUNCHING, age_s=181)],
        expected=[Terminate("a", "launch_timeout", S.FAILED), up()],
    ),
    Case(
        "launch_exactly_at_timeout_still_waits",
        target=1,
        observed=[node("a", S.LAUNCHING, age_s=180)],
        expected=[],
    ),
    # --- drain deadline ---------------------------------------------------------------
    Case(
        "draining_past_deadline_plus_grace_terminated",
        target=1,
        observed=[node("a", S.DRAINING, deadline_in_s=-31), node("b", S.RUNNING)],
        expected=[Terminate("a", "drain_deadline_passed")],
    ),
    Case(
        "draining_within_grace_left_alone",
        target=1,
        observed=[node("a", S.DRAINING, deadline_in_s=-30), node("b", S.RUNNING)],
        expected=[],
    ),
    # --- surplus ----------------------------------------------------------------------
    Case(
        "surplus_non_running_first_in_state_order",
        target=2,
        observed=[
            node("run1", S.RUNNING, age_s=900),
            node("run2", S.RUNNING, age_s=800),
            node("ready", S.READY, age_s=5),
            node("adm", S.ADMITTING, age_s=4),
            node("launch", S.LAUNCHING, age_s=50),
            node("req", S.REQUESTED, age_s=100),
        ],
        expected=[scale_in("req"), scale_in("launch"), scale_in("ready"), scale_in("adm")],
    ),
    Case(
        "surplus_same_state_youngest_first",
        target=1,
        observed=[
            node("old", S.RUNNING, age_s=900),
            node("young", S.RUNNING, age_s=100),
            node("mid", S.RUNNING, age_s=500),
        ],
        expected=[scale_in("young"), scale_in("mid")],
    ),
    Case(
        "surplus_ready_youngest_before_older_ready",
        target=1,
        observed=[
            node("run", S.RUNNING, age_s=900),
            node("ready_old", S.READY, age_s=300),
            node("ready_young", S.READY, age_s=100),
        ],
        expected=[scale_in("ready_young"), scale_in("ready_old")],
    ),
    Case(
        "scale_to_zero_terminates_all",
        target=0,
        observed=[node("a", S.RUNNING, age_s=900), node("b", S.LAUNCHING, age_s=10)],
        expected=[scale_in("b"), scale_in("a")],
    ),
    # --- ordering: removals before launches --------------------------------------------
    Case(
        "removals_before_launches",
        target=3,
        observed=[
            node("ok", S.RUNNING),
            node("lost", S.RUNNING, hb_age_s=60),
            node("stuck", S.LAUNCHING, age_s=600),
        ],
        expected=[
            MarkLost("lost", "heartbeat_lost"),
            Terminate("stuck", "launch_timeout", S.FAILED),
            up(),
            up(),
        ],
    ),
    Case(
        "lost_node_removed_not_double_counted_in_surplus",
        target=1,
        observed=[
            node("lost", S.RUNNING, hb_age_s=60, age_s=10),
            node("a", S.RUNNING, age_s=900),
            node("b", S.RUNNING, age_s=100),
        ],
        expected=[MarkLost("lost", "heartbeat_lost"), scale_in("b")],
    ),
    Case(
        "removals_kept_when_no_offer_usable",
        target=1,
        observed=[node("lost", S.RUNNING, hb_age_s=60)],
        backoff={0: NOW + 60},
        expected=[MarkLost("lost", "heartbeat_lost")],
    ),
    # --- terminal nodes, nothing to do -------------------------------------------------
    Case(
        "terminal_nodes_ignored",
        target=1,
        observed=[
            # stale, old, past-deadline: would trigger every rule if not terminal
            node("t", S.TERMINATED, age_s=10_000, hb_age_s=10_000, deadline_in_s=-1000),
            node("l", S.LOST, age_s=10_000, hb_age_s=10_000),
            node("f", S.FAILED, age_s=10_000, hb_age_s=10_000),
        ],
        expected=[up()],
    ),
    Case(
        "terminal_nodes_do_not_count_as_surplus",
        target=1,
        observed=[node("t", S.TERMINATED), node("l", S.LOST), node("f", S.FAILED), node("a", S.RUNNING)],
        expected=[],
    ),
    Case(
        "steady_state_nothing_to_do",
        target=3,
        observed=[node("a", S.RUNNING), node("b", S.ADMITTING), node("c", S.LAUNCHING, age_s=10)],
        expected=[],
    ),
]


# --- rebalance "replace" and drained nodes ----------------------------------------------
CASES += [
    Case(
        "replacing_node_is_not_capacity_so_its_replacement_launches_now",
        target=2,
        observed=[node("a", S.RUNNING), dataclasses.replace(node("b", S.RUNNING), replacing=True)],
        expected=[up()],
    ),
    Case(
        "replacing_node_with_its_replacement_up_launches_nothing_more",
        target=2,
        observed=[node("a", S.RUNNING), dataclasses.replace(node("b", S.RUNNING), replacing=True),
                  node("c", S.READY)],
        expected=[],
    ),
    Case(
        "draining_node_that_left_the_job_is_released_and_replaced",
        target=2,
        observed=[node("a", S.RUNNING),
                  dataclasses.replace(node("b", S.DRAINING, deadline_in_s=100), trainer=TrainerState.EXITED)],
        expected=[Terminate("b", "drained"), up()],
    ),
    Case(
        "draining_node_still_in_the_job_is_kept_until_it_leaves",
        target=2,
        observed=[node("a", S.RUNNING), node("b", S.DRAINING, deadline_in_s=100)],
        expected=[up()],
    ),
    Case(  # its notice's commit report is still in its agent's outbox: released, it dies with it
        "drained_node_whose_agent_owes_reports_is_kept_for_them",
        target=2,
        observed=[node("a", S.RUNNING),
                  dataclasses.replace(node("b", S.DRAINING, deadline_in_s=100), trainer=TrainerState.EXITED,
                                      reports_owed_since=NOW - TIMEOUTS.reports_wait_s + 1)],
        expected=[up()],
    ),
    Case(  # an agent that never delivers them does not keep its node for good
        "drained_node_owing_reports_past_the_wait_is_released",
        target=2,
        observed=[node("a", S.RUNNING),
                  dataclasses.replace(node("b", S.DRAINING, deadline_in_s=100), trainer=TrainerState.EXITED,
                                      reports_owed_since=NOW - TIMEOUTS.reports_wait_s)],
        expected=[Terminate("b", "drained"), up()],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan(case: Case) -> None:
    actions = plan(
        Desired(nodes=case.target, valid_world_sizes=case.valid),
        case.observed,
        case.offers,
        History(backoff_until=case.backoff),
        now=NOW,
        timeouts=TIMEOUTS,
    )
    assert actions == case.expected


def test_case_ids_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)


def test_plan_reads_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> float:
        raise AssertionError("plan() read the clock")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, boom)
    observed = [node("a", S.RUNNING, hb_age_s=60), node("b", S.DRAINING, deadline_in_s=-100)]
    actions = plan(Desired(nodes=2), observed, [offer(0)], History(), now=NOW, timeouts=TIMEOUTS)
    assert actions == [
        MarkLost("a", "heartbeat_lost"),
        Terminate("b", "drain_deadline_passed"),
        up(),
        up(),
    ]


def test_same_inputs_later_now_changes_decision() -> None:
    """Time enters only through ``now``: the same pool is fine now and lost 30 s later."""
    observed = [node("a", S.RUNNING, hb_age_s=1.0)]
    args = (Desired(nodes=1), observed, [offer(0)], History())
    assert plan(*args, now=NOW, timeouts=TIMEOUTS) == []
    assert plan(*args, now=NOW + 30, timeouts=TIMEOUTS) == [MarkLost("a", "heartbeat_lost"), up()]


def test_default_timeouts_used_when_not_given() -> None:
    observed = [node("a", S.RUNNING, hb_age_s=Timeouts().heartbeat_timeout_s + 1)]
    assert plan(Desired(nodes=1), observed, [offer(0)], History(), now=NOW) == [
        MarkLost("a", "heartbeat_lost"),
        up(),
    ]


def test_lost_after_scales_with_the_told_interval() -> None:
    t = Timeouts()  # floor 20 s, 2 misses, 10 s grace (Nomad's heartbeat_grace)
    assert t.lost_after_s(None) == 20.0
    assert t.lost_after_s(1.0) == 20.0
    assert t.lost_after_s(5.0) == 20.0
    assert t.lost_after_s(20.0) == 50.0
    assert Timeouts(heartbeat_timeout_s=60.0).lost_after_s(20.0) == 60.0


@pytest.mark.parametrize(("live", "expected"), [(0, 1.0), (3, 1.0), (50, 1.0), (100, 2.0), (1000, 20.0)])
def test_heartbeat_interval_keeps_the_pool_under_the_cap(live: int, expected: float) -> None:
    assert heartbeat_interval_s(live, min_interval_s=1.0, max_per_second=50.0) == expected
    assert live / heartbeat_interval_s(live, min_interval_s=1.0, max_per_second=50.0) <= 50.0


def test_actions_are_frozen() -> None:
    action = plan(Desired(nodes=1), [], [offer(0)], History(), now=NOW)[0]
    with pytest.raises(AttributeError):
        action.offer_index = 5  # type: ignore[misc]


def test_rank_offers_order_and_filters() -> None:
    offers = [
        offer(0, price=4.0, gpus=2),  # 2.00/GPU-h
        offer(1, price=1.0),  # 1.00, in backoff
        offer(2, price=3.0, max_price=2.0),  # over cap
        offer(3, price=None),  # unknown: last
        offer(4, price=2.0),  # 2.00/GPU-h, ties with 0: config order
        offer(5, price=1.5),  # 1.50/GPU-h
    ]
    ranked = rank_offers(offers, History(backoff_until={1: NOW + 1}), now=NOW)
    assert [o.index for o in ranked] == [5, 0, 4, 3]


def test_just_preempted_zone_is_ranked_last_not_excluded() -> None:
    a, b = offer(0, price=1.0), offer(1, price=2.0)  # zones local-0 (cheaper), local-1
    hist = History(avoid_zones=frozenset({a.zone_key}))
    assert [o.index for o in rank_offers([a, b], hist, now=NOW)] == [1, 0]
    # the only offer left is still used: a replacement in the same zone beats none
    assert plan(Desired(1), [], [a], hist, now=NOW, timeouts=TIMEOUTS) == [up(offer_index=0)]


def test_capacity_backoff_follows_the_skypilot_schedule() -> None:
    import random

    from daemon.control.offers import capacity_backoff_s

    class Mid(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return (a + b) / 2  # no jitter

    assert [round(capacity_backoff_s(n, Mid()), 1) for n in (1, 2, 3, 4, 5)] == [60.0, 96.0, 153.6, 245.8, 300.0]
    rng = random.Random(0)
    samples = [capacity_backoff_s(1, rng) for _ in range(200)]
    assert 36.0 <= min(samples) < 45.0 and 75.0 < max(samples) <= 84.0  # +-40 % jitter


def test_on_demand_offers_are_used_only_when_no_spot_offer_is() -> None:
    import dataclasses as dc

    spot, od = offer(0, price=3.0), dc.replace(offer(1, price=1.0), on_demand=True)  # on-demand cheaper here
    assert [o.index for o in rank_offers([spot, od], History(), now=NOW)] == [0]
    out = History(backoff_until={0: NOW + 60})
    assert [o.index for o in rank_offers([spot, od], out, now=NOW)] == [1]
