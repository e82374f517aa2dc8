"""Who holds each old shard after a node is lost (``trainer.integrations.replicas``): the
owner if it survived, else the buddy's copy, and a reason (so the survivors reload the
newest commit) whenever a copy is missing, stale, or lost with its owner."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainer.integrations.replicas import buddy, recovery_holders


def _survivors(world: int, per_node: int, lost: set[int], step: int = 6, copy_step: int = 6,
               snap: int | None = None) -> list[dict]:
    out = []
    for r in range(world):
        if r in lost:
            continue
        frm = (r - per_node) % world
        out.append({"old": r, "step": step, "snap": snap, "copy": [frm, copy_step] if world > per_node else None})
    return out


def test_one_node_lost_is_rebuilt_from_its_buddy() -> None:
    assert recovery_holders(_survivors(3, 1, {2}), 3, 1) == ([0, 1, 0], 6)  # old rank 2's copy is on old rank 0


def test_a_node_of_two_ranks_lost_is_rebuilt_from_the_next_node() -> None:
    # nodes (0, 1) (2, 3) (4, 5); node (2, 3) lost: copies on ranks 4, 5 = new ranks 2, 3
    assert recovery_holders(_survivors(6, 2, {2, 3}), 6, 2) == ([0, 1, 2, 3, 2, 3], 6)


def test_two_neighbouring_nodes_lost_cannot_be_rebuilt() -> None:
    got = recovery_holders(_survivors(4, 1, {1, 2}), 4, 1)
    assert got == "old rank 1 and the rank keeping its copy (2) are both gone"


def test_a_copy_a_step_behind_is_used_only_with_a_snapshot_of_that_step() -> None:
    got = recovery_holders(_survivors(3, 1, {1}, step=7, copy_step=6), 3, 1)
    assert got == "the copies are of step 6, old rank 0 is at step 7 and keeps no snapshot"
    assert recovery_holders(_survivors(3, 1, {1}, step=7, copy_step=6, snap=6), 3, 1) == ([0, 1, 1], 6)
    got = recovery_holders(_survivors(3, 1, {1}, step=7, copy_step=4, snap=6), 3, 1)
    assert got == "the copies are of step 4, old rank 0 is at step 7 and keeps a snapshot of step 6"


def test_survivors_at_another_step_than_the_copies_reload() -> None:
    s = _survivors(3, 1, {1})
    s[0]["step"] = 7
    assert recovery_holders(s, 3, 1) == "the copies are of step 6, old rank 0 is at step 7 and keeps no snapshot"


def test_a_single_node_job_has_no_copy() -> None:
    assert buddy(0, 4, 4) is None
    assert recovery_holders(_survivors(4, 4, {3}), 4, 4) == "old rank 3 and the rank keeping its copy (None) are both gone"


@given(nodes=st.integers(2, 8), per_node=st.integers(1, 4), data=st.data())
def test_any_one_node_lost_is_rebuilt_each_shard_from_its_owner_or_its_buddy(nodes: int, per_node: int,
                                                                              data: st.DataObject) -> None:
    world = nodes * per_node
    node = data.draw(st.integers(0, nodes - 1))
    lost = set(range(node * per_node, (node + 1) * per_node))
    survivors = _survivors(world, per_node, lost)
    got = recovery_holders(survivors, world, per_node)
    assert isinstance(got, tuple) and got[1] == 6
    holders = got[0]
    assert len(holders) == world
    new_of = {s["old"]: n for n, s in enumerate(survivors)}
    for i, h in enumerate(holders):
        assert h == (new_of[i] if i not in lost else new_of[buddy(i, world, per_node)])
        assert survivors[h]["old"] not in lost
