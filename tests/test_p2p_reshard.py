"""The peer-to-peer reshard of dim-0 shards (``trainer.integrations.p2p_reshard``): the plan
tiles every new shard from the old ones exactly, for any sizes (hypothesis), and real gloo
ranks carry it out for a shrink (in the old group, the leaving ranks sending) and a grow
(in the new group, the joiners holding nothing), each rank ending with exactly its new
``torch.chunk`` rows and having received only the rows it lacked."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.integrations.p2p_reshard import chunk_rows, grow_ranks, kept_bytes, plan


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(0, 40), min_size=1, max_size=5), old=st.integers(1, 9), new=st.integers(1, 9))
def test_the_pieces_tile_every_new_shard_from_within_the_old_ones(rows: list[int], old: int, new: int) -> None:
    pieces = plan(rows, old, new)
    for t, n in enumerate(rows):
        for j in range(new):
            start, size = chunk_rows(n, new, j)
            runs = sorted((p.start, p.rows) for p in pieces if p.tensor == t and p.dst == j)
            covered = [r for s, k in runs for r in range(s, s + k)]
            assert covered == list(range(start, start + size))  # whole, in order, no row twice
        for p in (p for p in pieces if p.tensor == t):
            s, k = chunk_rows(n, old, p.src)
            assert s <= p.start and p.start + p.rows <= s + k and p.rows > 0
    # the shards themselves are torch.chunk's
    for n in rows:
        for w in (old, new):
            assert [chunk_rows(n, w, r)[1] for r in range(w)] == [
                c.shape[0] for c in torch.arange(n).chunk(w)] + [0] * (w - len(torch.arange(n).chunk(w)))


def test_a_bad_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="world sizes"):
        plan([4], 0, 2)
    with pytest.raises(ValueError, match="a grow of 0 ranks by 1"):
        grow_ranks([4], [4], 0, 1)


def _kept(kept: list[list[int]], ranks: list[int]) -> int:
    return sum(kept[i][r] for i, r in enumerate(ranks[:len(kept)]))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(0, 60), min_size=1, max_size=4), row_bytes=st.lists(st.integers(1, 9), min_size=4,
       max_size=4), old_nodes=st.integers(1, 4), joining_nodes=st.integers(0, 3), per_node=st.integers(1, 2))
def test_a_grow_places_its_joiners_where_the_fewest_bytes_move(rows: list[int], row_bytes: list[int], old_nodes: int,
                                                                 joining_nodes: int, per_node: int) -> None:
    """Rank 0 stays 0, everyone gets one rank, a node's ranks stay consecutive, the old
    nodes keep their order, and no placement of the old nodes among the new ones (node 0
    pinned) that keeps their order keeps more bytes in place: checked against every one.
    (One that breaks the order can keep more, e.g. where old shards are empty: a tensor
    of 5 rows over 4 ranks grown to 5.)"""
    old, world = old_nodes * per_node, (old_nodes + joining_nodes) * per_node
    ranks = grow_ranks(rows, row_bytes, old, world - old, per_node)
    assert sorted(ranks) == list(range(world)) and ranks[0] == 0
    assert ranks[:old] == sorted(ranks[:old]) and ranks[old:] == sorted(ranks[old:])
    assert all(ranks[r] - ranks[r - r % per_node] == r % per_node for r in range(world))  # whole nodes

    def spread(nodes: tuple[int, ...]) -> list[int]:  # old node n at new node nodes[n]
        return [nodes[r // per_node] * per_node + r % per_node for r in range(old)]

    kept = kept_bytes(rows, row_bytes, old, world)
    best = max(_kept(kept, spread((0, *p))) for p in itertools.combinations(range(1, world // per_node),
                                                                            old_nodes - 1))  # in order
    assert _kept(kept, ranks) == best >= _kept(kept, list(range(world)))
    if _kept(kept, list(range(world))) == best:
        assert ranks == list(range(world))  # nothing to gain: the joiners are appended


def test_a_grow_of_part_of_a_node_appends_its_joiners() -> None:
    assert grow_ranks([100], [4], 3, 1, per_node=2) == [0, 1, 2, 3]
    assert grow_ranks([100], [4], 4, 2, per_node=2) == [0, 1, 4, 5, 2, 3]  # node 1 after the joining one


def test_doubling_a_world_moves_half_the_state_not_nearly_all_of_it() -> None:
    """8 ranks grow to 16 (a second node of 8): each joiner sits beside the old rank whose
    rows it takes. Appended, 15/16 of the state would move and old rank 7 would send its
    whole shard; placed, half moves and no rank sends more than half its shard."""
    rows, row_bytes = [16 * 1000], [4]
    ranks = grow_ranks(rows, row_bytes, 8, 8)
    assert ranks == [0, 2, 4, 6, 8, 10, 12, 14] + [1, 3, 5, 7, 9, 11, 13, 15]
    total = rows[0] * row_bytes[0]
    kept = kept_bytes(rows, row_bytes, 8, 16)
    assert total - _kept(kept, ranks) == total // 2
    assert total - _kept(kept, list(range(16))) == total * 15 // 16
    assert grow_ranks(rows, row_bytes, 2, 1) == [0, 2, 1]  # from 2 to 3: 1/3 moves, not 1/2


SHAPES = [(10, 3), (7,), (1, 4), (0, 2), (33, 5)]


def _full(t: int) -> torch.Tensor:
    n = 1
    for d in SHAPES[t]:
        n *= d
    return torch.arange(n, dtype=torch.float32).reshape(SHAPES[t]) + 1000 * t


def _worker(rank: int, tmp: str, world: int, holders: list[int], takers: list[int], in_memory: bool) -> None:
    from trainer.integrations.fsdp_shards import within
    from trainer.integrations.p2p_reshard import exchange

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    rows = [s[0] for s in SHAPES]
    old_world, new_world = len(holders), len(takers)
    old: dict[int, list[torch.Tensor]] = {}
    for i in (i for i, r in enumerate(holders) if r == rank):
        if in_memory:  # each old shard a view of memory spanning every row (stale beyond its own: -7)
            memory = [torch.full(s, -7.0) for s in SHAPES]
            for t, n in enumerate(rows):
                own = chunk_rows(n, old_world, i)
                memory[t].narrow(0, *own).copy_(_full(t).narrow(0, *own))
            old[i] = [memory[t].narrow(0, *chunk_rows(n, old_world, i)) for t, n in enumerate(rows)]
        else:
            old[i] = [_full(t).narrow(0, *chunk_rows(n, old_world, i)).clone() for t, n in enumerate(rows)]
    new = None
    if rank in takers:
        j = takers.index(rank)
        new = [torch.full((chunk_rows(n, new_world, j)[1], *SHAPES[t][1:]), -1.0) for t, n in enumerate(rows)]
        if in_memory and old:  # its new shards in the memory of the old one it holds (ShardMover's way)
            i = holders.index(rank)
            views = [within(old[i][t], chunk_rows(n, new_world, j)[0] - chunk_rows(n, old_world, i)[0],
                            chunk_rows(n, new_world, j)[1]) for t, n in enumerate(rows)]
            new = [v if v is not None else fresh for v, fresh in zip(views, new)]
    traffic = exchange(plan(rows, old_world, new_world), old, new, rows=rows, old_world=old_world,
                       new_world=new_world, holders=holders, takers=takers)
    ok = None
    if rank in takers:
        j = takers.index(rank)
        ok = all(torch.equal(new[t], _full(t).narrow(0, *chunk_rows(n, new_world, j))) for t, n in enumerate(rows))
    intact = all(torch.equal(shard[t], _full(t).narrow(0, *chunk_rows(n, old_world, i)))  # what it sent from
                 for i, shard in old.items() for t, n in enumerate(rows))
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"ok": ok, "sent": traffic.sent_bytes,
                                                         "received": traffic.received_bytes,
                                                         "copied": traffic.copied_bytes,
                                                         "in_place": traffic.in_place_bytes, "intact": intact}))
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path: Path, world: int, holders: list[int], takers: list[int], in_memory: bool = False) -> list[dict]:
    mp.start_processes(_worker, args=(str(tmp_path), world, holders, takers, in_memory), nprocs=world,
                       start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _bytes_lacking(j: int, old_world: int, new_world: int, holder_of: dict[int, int], me: int) -> int:
    """Bytes new shard ``j`` lacks on rank ``me``: its rows not in the old shard ``me`` held."""
    total = 0
    for t, n in enumerate(s[0] for s in SHAPES):
        width = 4 * int(torch.tensor(SHAPES[t][1:]).prod()) if len(SHAPES[t]) > 1 else 4
        start, size = chunk_rows(n, new_world, j)
        if me in holder_of:
            s, k = chunk_rows(n, old_world, holder_of[me])
            size -= max(0, min(start + size, s + k) - max(start, s))
        total += size * width
    return total


@pytest.mark.timeout(120)
def test_a_shrink_in_the_old_group_leaves_each_survivor_its_new_rows(tmp_path: Path) -> None:
    """World 4 -> 3: rank 1 leaves; ranks 0, 2, 3 become new shards 0, 1, 2."""
    got = _run(tmp_path, 4, [0, 1, 2, 3], [0, 2, 3])
    assert [g["ok"] for g in got] == [True, None, True, True]
    holder_of = {r: r for r in range(4)}
    assert [g["received"] for g in got] == [
        _bytes_lacking(0, 4, 3, holder_of, 0), 0, _bytes_lacking(1, 4, 3, holder_of, 2),
        _bytes_lacking(2, 4, 3, holder_of, 3)]
    assert sum(g["sent"] for g in got) == sum(g["received"] for g in got)
    assert got[1]["sent"] > 0  # the leaving rank's rows went to the survivors


@pytest.mark.timeout(120)
def test_a_grow_in_the_new_group_sends_the_joiners_only_their_rows(tmp_path: Path) -> None:
    """World 2 -> 3: ranks 0 and 1 hold the old shards, rank 2 joins with nothing."""
    got = _run(tmp_path, 3, [0, 1], [0, 1, 2])
    assert [g["ok"] for g in got] == [True, True, True]
    holder_of = {0: 0, 1: 1}
    assert [g["received"] for g in got] == [_bytes_lacking(j, 2, 3, holder_of, j) for j in range(3)]
    assert got[2]["sent"] == 0


@pytest.mark.timeout(120)
def test_a_rank_holding_a_lost_peers_replica_sends_both_shards(tmp_path: Path) -> None:
    """After a loss: world 3 -> 2, old rank 1 lost, its shard's replica on old rank 2 (new
    rank 1), which so holds old shards 1 and 2; new rank 0 is old rank 0."""
    got = _run(tmp_path, 2, [0, 1, 1], [0, 1])
    assert [g["ok"] for g in got] == [True, True]
    holder_of = {0: 0}
    assert got[0]["received"] == _bytes_lacking(0, 3, 2, holder_of, 0)
    assert got[1]["received"] == 0  # its new rows all lie in the two old shards it holds
    assert got[1]["sent"] == got[0]["received"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("old_world,holders,takers", [(3, [0, 1, 2], [0, 2]), (2, [0, 2], [0, 1, 2])],
                         ids=["shrink-3-2", "grow-2-3-placed"])
def test_new_shards_in_the_memory_of_the_old_ones_move_only_the_rows_lacking(
        tmp_path: Path, old_world: int, holders: list[int], takers: list[int]) -> None:
    """A rank whose old shard is a view of memory that spans its new rows (as a grow's
    survivor keeps it, and FSDP2's padding) takes its new shard as a view of that same
    memory: the rows it holds are neither copied nor moved, the rows it lacks land
    beside them, and the rows it sends are untouched by what it receives."""
    world = max(len(takers), old_world)
    got = _run(tmp_path, world, holders, takers, in_memory=True)
    assert all(g["ok"] in (True, None) and g["intact"] for g in got), got
    for j, r in enumerate(takers):
        if r in holders:
            i = holders.index(r)
            assert got[r]["copied"] == 0 and got[r]["in_place"] > 0, got[r]
            assert got[r]["received"] == _bytes_lacking(j, old_world, len(takers), {r: i}, r), got[r]
    assert sum(g["sent"] for g in got) == sum(g["received"] for g in got)
