"""Who holds each old shard after a node is lost (``trainer.integrations.replicas``): the
owner if it survived, else the buddy's copy, and a reason (so the survivors reload the
newest commit) whenever a copy is missing, stale, or lost with its owner."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

from trainer.integrations.replicas import BuddyReplica, Copy, _wait, buddy, recovery_holders, rounds


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


def test_a_snapshot_is_kept_once_per_copy_before_the_update_after_it() -> None:
    """Right before each optimizer step: a snapshot of the shards when the last copy is of
    the step they are at, once; none before the first copy, none between copies."""
    replica, shards = BuddyReplica(), _shards(0, 6)
    assert not replica.snapshot_before_update(shards, step=6, rank=0)  # no copy yet
    replica.copy = Copy(2, 6, [])
    assert replica.snapshot_before_update(shards, step=6, rank=0)
    assert replica.snapshot.step == 6 and all(torch.equal(a, b) for a, b in zip(replica.snapshot.tensors, shards))
    kept = replica.snapshot.tensors
    assert not replica.snapshot_before_update(_shards(0, 7), step=6, rank=0)  # kept already
    assert not replica.snapshot_before_update(_shards(0, 7), step=7, rank=0)  # copies every 2 steps: none of 7
    replica.copy = Copy(2, 8, [])
    assert replica.snapshot_before_update(_shards(0, 8), step=8, rank=0)
    assert replica.snapshot.tensors is kept and torch.equal(kept[0], _shards(0, 8)[0])  # in the same buffers


def test_a_loss_inside_a_copy_goes_back_one_step_to_the_snapshots() -> None:
    """Old rank 2 dies inside the copy of step 7: every survivor has stepped to 7 and keeps
    a snapshot of step 6 (taken before step 7's update). Old rank 0, its buddy, never got
    its copy of step 7 (copy: 6); old rank 1 got rank 0's (copy: 7, the one before: 6)."""
    s = [{"old": 0, "step": 7, "snap": 6, "copy": [2, 6], "prev": [2, 5]},
         {"old": 1, "step": 7, "snap": 6, "copy": [0, 7], "prev": [0, 6]}]
    assert recovery_holders(s, 3, 1) == ([0, 1, 0], 6)
    s[0]["copy"], s[0]["prev"] = [2, 7], [2, 6]  # rank 2 died after its copy had arrived
    assert recovery_holders(s, 3, 1) == ([0, 1, 0], 7)  # no step lost
    s[0]["copy"], s[0]["prev"], s[1]["snap"] = [2, 6], None, 5
    assert recovery_holders(s, 3, 1) == ("the copies are of step 6, old rank 1 is at step 7 and keeps a snapshot "
                                         "of step 5")


def test_the_lost_ranks_of_a_node_go_back_to_the_one_step_all_their_copies_hold() -> None:
    # nodes (0, 1) (2, 3) (4, 5); node (2, 3) lost inside the copy of step 7: old rank 4
    # received rank 2's copy of step 7, old rank 5 only rank 3's of step 6
    s = [{"old": r, "step": 7, "snap": 6, "copy": [(r - 2) % 6, 7], "prev": [(r - 2) % 6, 6]} for r in (0, 1, 4, 5)]
    s[3]["copy"], s[3]["prev"] = [3, 6], None
    assert recovery_holders(s, 6, 2) == ([0, 1, 2, 3, 2, 3], 6)
    s[2]["prev"] = None  # rank 4 has only step 7 of rank 2, rank 5 only step 6 of rank 3
    assert recovery_holders(s, 6, 2) == ("the copies of the lost ranks are of different steps [7] (old rank 2), "
                                         "[6] (old rank 3)")


def test_a_survivor_torn_by_the_loss_goes_back_to_its_snapshot_or_nobody_does() -> None:
    """A loss inside ZeRO's optimizer step leaves a survivor's partitions at no one step
    (``"step": None``): only its snapshot of the copies' step counts."""
    s = [{"old": 0, "step": None, "snap": 6, "copy": [2, 6], "prev": None},
         {"old": 1, "step": 6, "snap": 5, "copy": [0, 6], "prev": None}]
    assert recovery_holders(s, 3, 1) == ([0, 1, 0], 6)
    s[0]["snap"] = 5
    assert recovery_holders(s, 3, 1) == "the copies are of step 6, old rank 0 is torn by the loss and keeps a " \
                                        "snapshot of step 5"


_HELD = st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(3, 7)).map(list))


@given(world=st.integers(2, 6), per_node=st.integers(1, 2), data=st.data())
def test_a_rebuild_only_ever_uses_shards_held_at_its_step(world: int, per_node: int, data: st.DataObject) -> None:
    """Whatever each survivor reports (its step, snapshot, copy and the one before), a
    rebuild it agrees to reads every old shard as of one step: from a survivor at that step
    or keeping a snapshot of it, or from a copy of it of that step."""
    lost = data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world - 1))
    survivors = [{"old": r, "step": data.draw(st.one_of(st.none(), st.integers(4, 8))),
                  "snap": data.draw(st.one_of(st.none(), st.integers(3, 7))),
                  "copy": data.draw(_HELD), "prev": data.draw(_HELD)} for r in range(world) if r not in lost]
    got = recovery_holders(survivors, world, per_node)
    if isinstance(got, str):
        return
    holders, step = got
    for i, h in enumerate(holders):
        s = survivors[h]
        if s["old"] == i:
            assert step in (s["step"], s["snap"])
        else:
            assert i in lost and s["old"] == buddy(i, world, per_node) and [i, step] in (s["copy"], s["prev"])


@given(nodes=st.integers(2, 6), per_node=st.integers(1, 3), data=st.data())
def test_a_node_lost_inside_a_copy_costs_at_most_that_step(nodes: int, per_node: int, data: st.DataObject) -> None:
    """Every rank stepped to 7 (its snapshot of step 6 taken before the update), then one
    node is lost inside the copy of step 7, each exchange having finished or not: the
    survivors rebuild step 7 when every lost rank's copy of it arrived, else step 6."""
    world = nodes * per_node
    node = data.draw(st.integers(0, nodes - 1))
    lost = set(range(node * per_node, (node + 1) * per_node))
    arrived = {r: data.draw(st.booleans()) for r in range(world)}
    survivors = [{"old": r, "step": 7, "snap": 6, "copy": [(r - per_node) % world, 7 if arrived[r] else 6],
                  "prev": [(r - per_node) % world, 6] if arrived[r] else None}
                 for r in range(world) if r not in lost]
    got = recovery_holders(survivors, world, per_node)
    keepers = [buddy(i, world, per_node) for i in lost]
    assert isinstance(got, tuple) and got[1] == (7 if all(arrived[k] for k in keepers) else 6)


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


@given(shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), max_size=6),
       sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=6, max_size=6), max_bytes=st.integers(8, 200))
def test_a_copy_through_a_staging_area_moves_every_element_once_within_the_area(
        shapes: list[list[int]], sizes: list[int], max_bytes: int) -> None:
    sizes = sizes[:len(shapes)]
    plan = rounds(shapes, sizes, max_bytes)
    seen: dict[int, list[tuple[int, int]]] = {}
    for pieces in plan:
        assert pieces, "no empty round"
        at = 0
        for t, start, n in pieces:
            assert n > 0 and at % 16 == 0 and at + n * sizes[t] <= max_bytes
            at = -(-(at + n * sizes[t]) // 16) * 16
            seen.setdefault(t, []).append((start, n))
    for t, shape in enumerate(shapes):
        numel = torch.Size(shape).numel()
        got = sorted(seen.get(t, []))
        assert sum(n for _, n in got) == numel
        assert all(a + n == b for (a, n), (b, _) in zip(got, got[1:])) and (not got or got[0][0] == 0)


def test_a_staging_area_smaller_than_an_element_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no 8-byte element"):
        rounds([(3,)], [8], 4)


class _Work:
    """A point-to-point operation's handle that completes (or fails) when told to."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release, self.error = threading.Event(), error

    def wait(self) -> bool:
        self.release.wait(30)
        if self.error is not None:
            raise self.error
        return True


def test_a_copy_stops_waiting_once_the_loss_round_wakes_its_worker() -> None:
    """gloo may leave a copy's send waiting until the group's timeout after its peer died:
    the wait gives up (DistError: a lost peer, to recovery) as soon as the loss watch's
    event is set, and otherwise returns once every operation completed, or raises the
    first one's error."""
    stuck, woken = [_Work(), _Work()], threading.Event()
    woken.set()
    with pytest.raises(dist.DistError, match="re-form the group"):
        _wait(stuck, woken)
    for w in stuck:  # the abandoned wait's thread ends
        w.release.set()
    done = [_Work(), _Work()]
    for w in done:
        w.release.set()
    _wait(done, threading.Event())  # completed: no interrupt needed
    failed = _Work(RuntimeError("Connection closed by peer"))
    failed.release.set()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _wait([failed], threading.Event())


def _shards(rank: int, step: int) -> list[torch.Tensor]:
    """Rank ``rank``'s shards at ``step``: uneven rows across ranks, three dtypes."""
    rows = 5 if rank == 0 else 4
    base = 1000 * rank + 100 * step
    return [torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + base,
            (torch.arange(rows * 7, dtype=torch.float32) / 8 + base).to(torch.bfloat16).reshape(rows, 7),
            torch.arange(rank + 2, dtype=torch.int64) + base]


def _replica_worker(rank: int, tmp: str, world: int) -> None:
    from trainer.integrations.replicas import BuddyReplica

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    frm, ok = (rank - 1) % world, {}

    def holds(copy, step: int) -> bool:
        return (copy is not None and copy.of == frm and copy.step == step
                and all(torch.equal(a, b) for a, b in zip(copy.tensors, _shards(frm, step), strict=True)))

    for mode, staging in (("direct", None), ("staged", 40)):
        replica = BuddyReplica(staging_bytes=staging)
        for step in (1, 2, 3):  # from the second on, a copy arrives in the buffers of the one before the last
            replica.replicate(_shards(rank, step), step=step, rank=rank, world=world, per_node=1)
        ok[mode] = holds(replica.copy, 3) and holds(replica.previous, 2) and replica.held(2) is replica.previous
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(ok))
    dist.barrier()
    dist.destroy_process_group()


def test_each_rank_keeps_its_predecessors_shards_whether_direct_or_through_a_staging_area(tmp_path: Path) -> None:
    """A GPU's copy arrives through a staging area on the device into host memory; on the
    CPU the same path runs when a staging size is given (here 40 bytes: many rounds, pieces
    cut inside tensors, a round mixing dtypes), and must keep what the direct path keeps;
    the copy before the last stays whole until the next copy arrives in its buffers."""
    world = 3
    mp.start_processes(_replica_worker, args=(str(tmp_path), world), nprocs=world, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert got == [{"direct": True, "staged": True}] * world
