"""A quota (or auth) error at launch takes its offer family out for a backoff, not until a
restart (daemon/control/quota.py): the schedule's bounds, its reset on success, and the
daemon's event saying when the family is tried again."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from daemon.control import quota  # noqa: E402
from daemon.control.offers import History, Offer, rank_offers  # noqa: E402

_FAMILIES = st.sampled_from(["aws/us-east-1/p5", "aws/us-east-1/p4d", "aws/us-west-2/p5", "aws"])
_STEPS = st.lists(st.tuples(st.sampled_from(["error", "success"]), _FAMILIES,
                            st.floats(min_value=0, max_value=1e6, allow_nan=False)), max_size=40)


@given(_STEPS)
def test_backoff_is_bounded_grows_and_resets(steps) -> None:
    state: dict[str, quota.FamilyBackoff] = {}
    streak: dict[str, int] = {}
    for kind, family, now in steps:
        if kind == "error":
            before = state.get(family)
            state = quota.after_error(state, family, now=now)
            if before is not None and before.until > now:  # already out: a launch in flight when it went out
                assert state[family] == before
                continue
            streak[family] = streak.get(family, 0) + 1
            wait = quota.quota_backoff_s(state[family].failures)
            assert state[family].until == now + wait and state[family].failures == streak[family]
            # never forever, never under 10 min, at most 2 h; one more error never waits less
            assert quota.QUOTA_BACKOFF_BASE_S <= wait <= quota.QUOTA_BACKOFF_CAP_S
            if before is not None:
                assert wait >= quota.quota_backoff_s(before.failures)
            assert wait == min(7200.0, 600.0 * 2 ** (streak[family] - 1))
        else:
            state = quota.after_success(state, family)
            streak.pop(family, None)
            assert family not in state  # the next error starts at 10 min again
        assert set(state) == set(streak)  # only the families with an error streak sit out


def test_families_and_a_family_out_leaves_the_others_buyable() -> None:
    assert quota.offer_family("aws", "us-east-1", "p5.48xlarge") == "aws/us-east-1/p5"
    assert quota.offer_family("aliyun", "cn-hangzhou", "ecs.gn7i-c32g1.8xlarge") == "aliyun/cn-hangzhou/gn7i"
    assert quota.offer_family("aws", "us-east-1") == "aws"
    state = quota.after_error({}, "aws/us-east-1/p5", now=1000.0)
    offers = [Offer(0, "aws", "us-east-1", "us-east-1a", "p5.48xlarge", 8, 30.0),
              Offer(1, "aws", "us-east-1", "us-east-1a", "p4d.24xlarge", 8, 20.0)]
    until = {o.index: state["aws/us-east-1/p5"].until for o in offers
             if quota.offer_family(o.provider, o.region, o.instance_type) in state}
    assert [o.index for o in rank_offers(offers, History(backoff_until=until), now=1599.0)] == [1]
    assert [o.index for o in rank_offers(offers, History(backoff_until=until), now=1600.0)] == [1, 0]
