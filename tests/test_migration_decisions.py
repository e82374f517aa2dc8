"""The migration decisions (daemon/control/migration.py): pure, table and property tests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.actions import NodeView, PoolState
from daemon.control.lifecycle import JobState, NodeState, TrainerState
from daemon.control.migration import (DomainView, Plan, choose_target, decide, job_left, ready_for_commit,
                                      starved_since, target_out)
from daemon.control.policies import get_policy
from daemon.control.offers import History, Offer

T = 1_000_000.0


def offer(i: int, region: str, price: float | None = 1.0, gpus: int = 1) -> Offer:
    return Offer(index=i, provider="aws", region=region, zone=f"{region}a", instance_type="g5",
                 gpus_per_node=gpus, price_usd_h=price)


def node(i: int, domain: str, state: NodeState = NodeState.RUNNING, created_at: float = T - 100,
         trainer: TrainerState = TrainerState.RUNNING) -> NodeView:
    return NodeView(id=f"n{i}", state=state, gpus=1, created_at=created_at, domain=domain, ordinal=i,
                    trainer=trainer)


def pool(*nodes: NodeView, target: int = 2, job: JobState = JobState.RUNNING, paused: bool = False) -> PoolState:
    return PoolState(nodes=tuple(nodes), job=job, paused=paused, desired_nodes=target, target_nodes=target,
                     domain="a")


A = DomainView("a", (offer(0, "us-east-1", 1.0),), egress_usd_per_gb=0.09)
B = DomainView("b", (offer(1, "us-west-2", 1.2),))
C = DomainView("c", (offer(2, "eu-west-1", 0.9),))
OUT_A = History(backoff_until={0: T + 60})  # us-east-1 in capacity backoff


# -- starved_since ------------------------------------------------------------------------------

def test_a_domain_short_of_its_target_with_no_usable_offer_is_starved_from_now() -> None:
    assert starved_since(None, pool(node(1, "a")), A, OUT_A, now=T) == T


def test_a_domain_at_its_target_or_able_to_launch_is_not_starved() -> None:
    assert starved_since(None, pool(node(1, "a"), node(2, "a")), A, OUT_A, now=T) is None
    assert starved_since(None, pool(node(1, "a")), A, History(), now=T) is None  # it can launch: not starved


def test_starvation_outlasts_a_backoff_that_ran_out_and_failed_again() -> None:
    """The offer's backoff ends (usable again) and the retry fails: still starved since the
    first time, so the patience is not restarted by every retry."""
    s = pool(node(1, "a"), node(3, "a", NodeState.FAILED, created_at=T + 70))
    assert starved_since(T, s, A, History(), now=T + 70) == T


def test_a_launch_that_succeeds_ends_starvation() -> None:
    s = pool(node(1, "a"), node(3, "a", NodeState.LAUNCHING, created_at=T + 70))
    assert starved_since(T, s, A, History(), now=T + 70) is None


def test_a_paused_or_finished_job_is_never_starved() -> None:
    assert starved_since(T, pool(node(1, "a"), paused=True), A, OUT_A, now=T + 1) is None
    assert starved_since(T, pool(job=JobState.COMPLETED), A, OUT_A, now=T + 1) is None


def test_other_domains_nodes_do_not_count_for_the_jobs_domain() -> None:
    assert starved_since(None, pool(node(1, "a"), node(2, "b")), A, OUT_A, now=T) == T


# -- decide -------------------------------------------------------------------------------------

PLAN = Plan(patience_s=300, cooldown_s=600)


def _decide(s: PoolState, since: float | None, *, now: float, history: History = OUT_A, plan: Plan = PLAN,
            domains=(A, B, C), last_end: float | None = None, ckpt: int | None = 10**10):
    return decide(s, domains, "a", history, now=now, plan=plan, starved_since=since, checkpoint_bytes=ckpt,
                  last_move_ended_at=last_end, gpus=2)


def test_a_starved_domain_moves_after_the_patience_to_the_cheapest_usable_domain() -> None:
    s = pool(node(1, "a"))
    assert _decide(s, T, now=T + 299) is None
    move = _decide(s, T, now=T + 300)
    assert move is not None and (move.source, move.target, move.reason) == ("a", "c", "capacity")
    assert move.why["egress_usd"] == 0.9  # 10 GB out of a at 0.09 USD/GB
    assert move.why["starved_s"] == 300


def test_recent_losses_in_a_domain_make_the_move_go_elsewhere() -> None:
    risky_c = DomainView("c", C.offers, preemptions=3)  # 0.9 x 1.3 = 1.17 > b's 1.2? no: 1.17 < 1.2
    riskier_c = DomainView("c", C.offers, preemptions=4)  # 0.9 x 1.4 = 1.26 > 1.2
    s = pool(node(1, "a"))
    assert _decide(s, T, now=T + 300, domains=(A, B, risky_c)).target == "c"
    assert _decide(s, T, now=T + 300, domains=(A, B, riskier_c)).target == "b"


def test_no_move_without_a_target_that_can_launch_or_within_the_cooldown() -> None:
    s = pool(node(1, "a"))
    all_out = History(backoff_until={0: T + 900, 1: T + 900, 2: T + 900})
    assert _decide(s, T, now=T + 300, history=all_out) is None
    assert _decide(s, T, now=T + 300, last_end=T) is None
    assert _decide(s, T, now=T + 300, domains=(A,)) is None
    assert _decide(pool(node(1, "a"), paused=True), T, now=T + 300) is None


def test_price_moves_only_when_the_saving_pays_for_the_egress() -> None:
    s = pool(node(1, "a"), node(2, "a"))  # not starved
    plan = Plan(patience_s=300, min_saving_fraction=0.05, payback_h=1.0, cooldown_s=0)
    cheap = DomainView("c", (offer(2, "eu-west-1", 0.5),))
    # saving (1.0 - 0.5) x 2 GPUs x 1 h = 1.0 USD; egress 10 GB x 0.09 = 0.9 USD: it pays
    move = _decide(s, None, now=T, history=History(), plan=plan, domains=(A, cheap))
    assert move is not None and move.reason == "price" and move.target == "c"
    # 100 GB: 9 USD of egress, not paid back within the hour
    assert _decide(s, None, now=T, history=History(), plan=plan, domains=(A, cheap), ckpt=10**11) is None
    # not cheaper by the fraction
    near = DomainView("c", (offer(2, "eu-west-1", 0.97),))
    assert _decide(s, None, now=T, history=History(), plan=plan, domains=(A, near)) is None
    # without min_saving_fraction, price alone never moves the job
    assert _decide(s, None, now=T, history=History(), domains=(A, cheap)) is None


@settings(max_examples=300, deadline=None)
@given(prices=st.lists(st.one_of(st.none(), st.floats(0.01, 50)), min_size=2, max_size=5),
       out=st.sets(st.integers(0, 4)), since=st.one_of(st.none(), st.floats(0, 2000)),
       fraction=st.one_of(st.none(), st.floats(0.01, 0.9)), losses=st.lists(st.integers(0, 5), min_size=5,
                                                                              max_size=5))
def test_a_move_always_goes_to_another_domain_that_can_launch_now(prices, out, since, fraction, losses) -> None:
    domains = tuple(DomainView(f"d{i}", (offer(i, f"r{i}", p),), preemptions=losses[i]) for i, p in enumerate(prices))
    history = History(backoff_until={i: T + 1e6 for i in out})
    plan = Plan(patience_s=300, min_saving_fraction=fraction, cooldown_s=0)
    s = PoolState(nodes=(node(1, "d0"),), job=JobState.RUNNING, target_nodes=2, desired_nodes=2, domain="d0")
    move = decide(s, domains, "d0", history, now=T + 2000, plan=plan, starved_since=since and T + since,
                  checkpoint_bytes=10**9, last_move_ended_at=None, gpus=1)
    if move is None:
        return
    assert move.source == "d0" and move.target != "d0"
    target = next(d for d in domains if d.name == move.target)
    assert target.usable(history, T + 2000), "never to a domain that cannot launch"
    if move.reason == "price":
        here, there = domains[0].usd_per_gpu_h(history, T + 2000), target.usd_per_gpu_h(history, T + 2000)
        assert fraction is not None and there < here * (1 - fraction)
    else:
        assert since is not None and 2000 - since >= 300


# -- the steps of a move --------------------------------------------------------------------------

def test_the_target_is_ready_at_the_pool_target_or_at_a_valid_world_with_nothing_booting() -> None:
    valid = frozenset({1, 2, 3, 6})
    s = pool(node(1, "a"), node(4, "b", NodeState.READY), node(5, "b", NodeState.LAUNCHING), target=2)
    assert not ready_for_commit(s, "b", valid_world_sizes=valid, min_nodes=1)  # one more is booting
    s = pool(node(1, "a"), node(4, "b", NodeState.READY), node(5, "b", NodeState.READY), target=2)
    assert ready_for_commit(s, "b", valid_world_sizes=valid, min_nodes=1)
    s = pool(node(1, "a"), node(4, "b", NodeState.READY), node(5, "b", NodeState.FAILED), target=2)
    assert ready_for_commit(s, "b", valid_world_sizes=valid, min_nodes=1)  # 1 is valid, nothing else coming
    assert not ready_for_commit(s, "b", valid_world_sizes=frozenset({2, 4}), min_nodes=1)


def test_the_job_has_left_the_source_once_no_node_there_trains() -> None:
    draining = node(1, "a", NodeState.DRAINING)
    assert not job_left(pool(draining, node(4, "b", NodeState.READY)), "a")
    gone = node(1, "a", NodeState.DRAINING, trainer=TrainerState.EXITED)
    assert job_left(pool(gone, node(2, "a", NodeState.LOST), node(4, "b", NodeState.READY)), "a")


def test_choose_target_reports_the_figures_it_chose_by() -> None:
    best, why = choose_target((A, B, C), "a", OUT_A, now=T, checkpoint_bytes=2 * 10**9, payback_h=24, gpus=8)
    assert best.name == "c"
    assert why["candidates"] == {"c": 0.9009, "b": 1.2009}  # + 0.18 USD egress / 24 h / 8 GPUs
    assert why["egress_usd"] == 0.18 and why["target_usd_per_gpu_h"] == 0.9


# -- a move that fails, and where to go next ------------------------------------------------------

def test_a_target_that_refused_every_launch_fails_the_move_at_once() -> None:
    """Booting: the target's only offer came back out of capacity and nothing is launching
    there: the move fails now, not at boot_timeout_s."""
    out_b = History(backoff_until={1: T + 60})
    assert target_out(pool(node(1, "a")), B, out_b, now=T)
    assert not target_out(pool(node(1, "a")), B, History(), now=T)  # it may still launch
    assert not target_out(pool(node(1, "a"), node(2, "b", NodeState.LAUNCHING)), B, out_b, now=T)


def test_a_failed_target_is_avoided_for_the_cooldown_and_another_is_tried_at_once() -> None:
    s = pool(node(1, "a"))
    first = _decide(s, T, now=T + 300)
    assert first is not None and first.target == "c"  # the cheapest
    kw = dict(plan=PLAN, starved_since=T, checkpoint_bytes=10**10, last_move_ended_at=None, gpus=2)
    second = decide(s, (A, B, C), "a", OUT_A, now=T + 400, failed_moves={"c": T + 350}, **kw)
    assert second is not None and second.target == "b"  # no cooldown after a failure: the next one
    assert decide(s, (A, B, C), "a", OUT_A, now=T + 400, failed_moves={"c": T + 350, "b": T + 390}, **kw) is None
    again = decide(s, (A, B, C), "a", OUT_A, now=T + 350 + PLAN.cooldown_s, failed_moves={"c": T + 350}, **kw)
    assert again is not None and again.target == "c"  # the cooldown is over


def _spot(i: int, region: str, price: float) -> Offer:
    return offer(i, region, price)


def _od(i: int, region: str) -> Offer:
    return Offer(index=i, provider="aws", region=region, zone=f"{region}a", instance_type="g5", gpus_per_node=1,
                 price_usd_h=3.06, on_demand=True)


def test_deadline_aware_moves_to_spot_elsewhere_before_buying_on_demand() -> None:
    """Spot and on-demand allowed (behind the line), the job's domain out of spot: the
    default waits out its patience (on-demand fills in meanwhile); deadline_aware moves at
    once to the domain with spot, and builds it from spot only. With on-demand only
    allowed (no spot offer anywhere) nothing moves."""
    a = DomainView("a", (_spot(0, "us-east-1", 1.0), _od(3, "us-east-1")))
    b = DomainView("b", (_spot(1, "us-west-2", 1.1), _od(4, "us-west-2")))
    s = pool(node(1, "a"), target=2)
    kw = dict(now=T, plan=Plan(), starved_since=None, checkpoint_bytes=10**10, last_move_ended_at=None, gpus=1)
    assert get_policy("spotvisor").migrate(s, (a, b), "a", OUT_A, **kw) is None
    move = get_policy("deadline_aware").migrate(s, (a, b), "a", OUT_A, **kw)
    assert move is not None and (move.target, move.reason, move.markets) == ("b", "spot_elsewhere", frozenset({"spot"}))
    assert get_policy("deadline_aware").migrate(s, (a, b), "a", History(), **kw) is None  # spot here: stay
    od_a, od_b = DomainView("a", (_od(3, "us-east-1"),)), DomainView("b", (_od(4, "us-west-2"),))
    assert get_policy("deadline_aware").migrate(s, (od_a, od_b), "a", History(), **kw) is None
