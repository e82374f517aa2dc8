"""The daemon's check of a trainer's world size against the nodes it admitted
(``daemon.control.reactions.world_size_mismatch``, issue 25 item 11). Pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from daemon.control.actions import NodeView
from daemon.control.lifecycle import NodeState
from daemon.control.reactions import WorldSizeMismatch, world_size_mismatch

_nodes = st.lists(st.tuples(st.sampled_from(list(NodeState)), st.integers(1, 8)), max_size=6)


def _views(nodes: list[tuple[NodeState, int]]) -> list[NodeView]:
    return [NodeView(id=f"n{i}", state=state, gpus=gpus, created_at=0.0) for i, (state, gpus) in enumerate(nodes)]


@given(_nodes, st.integers(1, 64))
def test_flagged_exactly_when_the_world_exceeds_the_gpus_of_the_nodes_in_the_job(nodes, world) -> None:
    in_job = [g for state, g in nodes if state in (NodeState.RUNNING, NodeState.DRAINING)]
    found = world_size_mismatch(world, _views(nodes))
    if world > sum(in_job):
        assert found == WorldSizeMismatch(world, sum(in_job), len(in_job))
    else:
        assert found is None


def test_the_issues_case() -> None:
    """Two admitted nodes of one GPU, world size 3 (an outsider was rank 2)."""
    two = _views([(NodeState.RUNNING, 1), (NodeState.RUNNING, 1), (NodeState.READY, 1)])
    assert world_size_mismatch(3, two) == WorldSizeMismatch(3, 2, 2)
    assert world_size_mismatch(2, two) is None and world_size_mismatch(1, two) is None
