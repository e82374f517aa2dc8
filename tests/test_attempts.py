"""The rule of who leads a trainer attempt (daemon/control/attempts.py), as a table and as properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.control.attempts import StartReport, Verdict, claim_verdict

ALL = frozenset({"n1", "n2", "n3"})


@pytest.mark.parametrize("claim, leader, admitted, reports, verdict", [
    # rank 0 stays on the running attempt's node: taken at once
    (StartReport("n1", "a2", 0, 3), "n1", ALL, [], Verdict.ACCEPT),
    # another node, nobody vouching: waits
    (StartReport("n2", "evil", 0, 1), "n1", ALL, [], Verdict.WAIT),
    # a third node vouching is not enough while the leader is admitted
    (StartReport("n2", "a2", 0, 2), "n1", ALL, [StartReport("n3", "a2", 1, 2)], Verdict.WAIT),
    # the leader vouches (its workers are rank 1 of a2): rank 0 moved in a restart
    (StartReport("n2", "a2", 0, 3), "n1", ALL, [StartReport("n1", "a2", 1, 3)], Verdict.ACCEPT),
    # ... but not at another world size
    (StartReport("n2", "a2", 0, 3), "n1", ALL, [StartReport("n1", "a2", 1, 2)], Verdict.WAIT),
    # the leader left: any admitted node vouches
    (StartReport("n2", "a2", 0, 2), "n1", frozenset({"n2", "n3"}), [StartReport("n3", "a2", 1, 2)], Verdict.ACCEPT),
    # the only admitted node: the survivor of a shrink
    (StartReport("n2", "a2", 0, 1), "n1", frozenset({"n2"}), [], Verdict.ACCEPT),
    # a claimant that is leaving leads on an admitted node's word (two notices at once: rank 0
    # of the survivors' attempt on the second noticed node), never on its own
    (StartReport("n2", "a2", 0, 2), "n1", frozenset({"n3"}), [StartReport("n3", "a2", 1, 2)], Verdict.ACCEPT),
    (StartReport("n2", "a2", 0, 1), "n1", frozenset({"n3"}), [], Verdict.WAIT),
    (StartReport("n2", "a2", 0, 1), "n1", frozenset(), [StartReport("n3", "a2", 1, 1)], Verdict.WAIT),
    # ... nor while the admitted running leader has not vouched
    (StartReport("n2", "a2", 0, 2), "n1", frozenset({"n1", "n3"}), [StartReport("n3", "a2", 1, 2)], Verdict.WAIT),
    # two claims to one attempt: neither, unless one is the running leader
    (StartReport("n2", "a2", 0, 2), None, ALL, [StartReport("n3", "a2", 0, 2), StartReport("n1", "a2", 1, 2)],
     Verdict.CONFLICT),
    (StartReport("n1", "a2", 0, 2), "n1", ALL, [StartReport("n3", "a2", 0, 2)], Verdict.ACCEPT),
])
def test_the_rule_in_a_table(claim, leader, admitted, reports, verdict) -> None:
    assert claim_verdict(claim, running_leader=leader, admitted=admitted, reports=reports) is verdict


nodes = st.sampled_from(["n1", "n2", "n3", "n4"])
reports = st.builds(StartReport, nodes, st.sampled_from(["a1", "a2", "evil"]), st.integers(0, 3) | st.none(),
                    st.integers(1, 4) | st.none())


@given(claim=reports, hostile=st.lists(reports, max_size=12), admitted=st.frozensets(nodes, min_size=1))
def test_no_reports_without_the_leaders_own_take_the_job_from_an_admitted_leader(claim, hostile, admitted) -> None:
    """While the running attempt's leader (n1) is admitted, another node's claim is taken
    only on n1's own word: reports of any other nodes, any number, never suffice."""
    admitted = admitted | {"n1"}
    others = [r for r in hostile if r.node != "n1"]
    if claim.node != "n1":
        assert claim_verdict(claim, running_leader="n1", admitted=admitted, reports=others) is not Verdict.ACCEPT


@given(claim=reports, hostile=st.lists(reports, max_size=12), admitted=st.frozensets(nodes))
def test_the_running_leader_is_never_blocked(claim, hostile, admitted) -> None:
    if claim.node == "n1":
        assert claim_verdict(claim, running_leader="n1", admitted=admitted, reports=hostile) is Verdict.ACCEPT
