"""Peer-to-peer reshard of dim-0 sharded state: each rank receives exactly the rows its new
shard lacks, from the ranks that hold them; nothing is gathered whole anywhere.

FSDP2 shards every parameter (and AdamW's moments, which take the parameter's layout)
along dim 0 in ``torch.chunk``'s way: at world ``W`` rank ``r`` holds the rows
``Shard.local_shard_size_and_offset(rows, W, r)`` gives (the function DTensor itself
lays shards out with). When the world goes from ``W_old`` to ``W_new``, new shard ``j``
overlaps a few old shards ``i``; each overlap is one :class:`Piece`, a run of whole rows
sent from the rank holding old shard ``i`` to the rank that will hold new shard ``j``
(a local copy when that is the same rank). :func:`plan` is pure: every rank computes the
same pieces from the shapes alone, so no metadata travels, through rank 0 or anywhere.
:func:`exchange` carries a plan out with ``torch.distributed`` point-to-point sends
(``batch_isend_irecv``, one tag per piece), straight from a view of the old shard into
a view of the new one: no buffer, so the extra memory a rank needs is its new shard.

Where it runs: a shrink's exchange runs in the *old* group, before it changes (the
leaving ranks hold old shards and must send them); a grow's in the *new* one (the
joiners hold no old shard, and are not in the old group). ``holders[i]`` and
``takers[j]`` name the ranks, in the group the exchange runs in, of old shard ``i`` and
new shard ``j``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Shard

__all__ = ["Piece", "Traffic", "Transfer", "chunk_rows", "plan", "exchange", "grow_ranks", "kept_bytes", "transfer"]

#: pieces in flight at once (each a pending send or receive): bounds the transport's queues
MAX_IN_FLIGHT = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, start + rows)`` (global row numbers) of tensor ``tensor``, which old
    shard ``src`` holds and new shard ``dst`` needs."""

    tensor: int
    src: int
    dst: int
    start: int
    rows: int


@dataclasses.dataclass(slots=True)
class Traffic:
    """What one rank moved in an :func:`exchange`: bytes sent to and received from other ranks
    (a piece it holds and takes itself is ``copied``, or ``in_place`` where its new shard
    is a view of the old one's rows), and the number of each."""

    sent_bytes: int = 0
    received_bytes: int = 0
    copied_bytes: int = 0
    in_place_bytes: int = 0  # where the new shard is a view of the old one's rows: not moved at all
    sends: int = 0
    receives: int = 0
    seconds: float = 0.0  # in the exchange, this rank


#: one transfer of a plan on this rank: ``(its number in the plan, source rank, destination
#: rank, the view it sends or None, the tensor it receives into or None)``
Transfer = tuple[int, int, int, "torch.Tensor | None", "torch.Tensor | None"]


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, size)``: the rows shard ``rank`` of ``world`` holds of a tensor of ``rows`` rows
    (``torch.chunk``'s split, DTensor's ``Shard(0)``: the last shards may be short or empty)."""
    size, start = Shard.local_shard_size_and_offset(rows, world, rank)
    return int(start), int(size)


def plan(rows: Sequence[int], old_world: int, new_world: int) -> list[Piece]:
    """Every piece of a reshard of tensors with ``rows[t]`` rows each, from ``old_world``
    shards to ``new_world``: for each new shard, the runs of its rows by the old shard that
    holds them. The pieces of new shard ``j`` tile its rows exactly; those from old shard
    ``i`` lie within its rows. Ordered by tensor, new shard, then start.

    Raises:
        ValueError: a world size below 1, or a negative row count.
    """
    if old_world < 1 or new_world < 1:
        raise ValueError(f"world sizes must be >= 1, got {old_world} -> {new_world}")
    out: list[Piece] = []
    for t, n in enumerate(rows):
        if n < 0:
            raise ValueError(f"tensor {t} has {n} rows")
        old = [chunk_rows(n, old_world, i) for i in range(old_world)]
        for j in range(new_world):
            start, size = chunk_rows(n, new_world, j)
            end = start + size
            for i, (s, k) in enumerate(old):
                lo, hi = max(start, s), min(end, s + k)
                if hi > lo:
                    out.append(Piece(t, i, j, lo, hi - lo))
    return out


def kept_bytes(rows: Sequence[int], row_bytes: Sequence[int], old_world: int, new_world: int) -> list[list[int]]:
    """``kept[i][j]``: the bytes of new shard ``j`` that old shard ``i`` holds already (a rank
    holding old shard ``i`` and taking new shard ``j`` moves none of them), over tensors of
    ``rows[t]`` rows of ``row_bytes[t]`` bytes each. Raises ValueError as :func:`plan`."""
    kept = [[0] * new_world for _ in range(old_world)]
    for p in plan(rows, old_world, new_world):
        kept[p.src][p.dst] += p.rows * row_bytes[p.tensor]
    return kept


def grow_ranks(rows: Sequence[int], row_bytes: Sequence[int], old_world: int, joiners: int,
               per_node: int = 1) -> list[int]:
    """Where a grow from ``old_world`` ranks by ``joiners`` puts everyone: the new rank of
    each old rank (``[:old_world]``), then of each joiner in admission order, so that the
    old ranks keep the most bytes of their new shards (:func:`kept_bytes`) and the fewest
    move. Appending the joiners shifts every old rank's shard: doubling a world of 8 that
    way moves 15/16 of the state, old rank 7 sending its whole shard; with each joiner
    beside the rank whose rows it takes, half of the state moves and no rank sends more
    than half its shard (the busiest rank moves half as much). From 2 to 3 ranks: 1/3 of
    the state moves instead of 1/2; from 8 to 9, 0.28 instead of 0.5.

    Nodes move whole: a node's ``per_node`` ranks stay consecutive, as torchrun numbers
    them (a copy's buddy is ``per_node`` ranks on: :func:`trainer.integrations.replicas.buddy`),
    and where ``old_world`` or ``joiners`` is not whole nodes of it the joiners are
    appended. Old rank 0 stays rank 0 (the group's leader), the old nodes keep their order
    and so do the joiners: the most bytes kept of any placement that keeps that order
    (tested against every one of small worlds; one that breaks it can keep more in
    corner cases, e.g. where old shards are empty). A dynamic programme over (new node,
    old nodes placed); of placements that keep as much, the joiners go last: one that
    gains nothing appends them (``list(range(old_world + joiners))``).

    Raises:
        ValueError: ``old_world`` or ``per_node`` below 1, ``joiners`` below 0, or as :func:`plan`.
    """
    if old_world < 1 or joiners < 0 or per_node < 1:
        raise ValueError(f"a grow of {old_world} ranks by {joiners}, {per_node} per node")
    world = old_world + joiners
    if old_world % per_node or joiners % per_node:
        return list(range(world))
    kept = kept_bytes(rows, row_bytes, old_world, world)
    olds, nodes = old_world // per_node, world // per_node
    # node[n][b]: the bytes old node n keeps as new node b (each local rank its own shard)
    node = [[sum(kept[n * per_node + k][b * per_node + k] for k in range(per_node)) for b in range(nodes)]
            for n in range(olds)]
    # best[b][n]: the most bytes kept with new nodes < b taken by old nodes < n and b - n joining ones
    none = -1
    best = [[none] * (olds + 1) for _ in range(nodes + 1)]
    best[1][1] = node[0][0]  # old node 0 stays node 0
    for b in range(1, nodes):
        for n in range(1, min(b, olds) + 1):
            if best[b][n] == none:
                continue
            if n < olds:
                best[b + 1][n + 1] = max(best[b + 1][n + 1], best[b][n] + node[n][b])
            if b - n < nodes - olds:
                best[b + 1][n] = max(best[b + 1][n], best[b][n])
    place, joined = [0] * olds, []  # the new node of each old node; those of the joining ones
    b, n = nodes, olds
    while b > 1:  # back from the end: a joining node where one reaches the best, else an old one
        if b > n and best[b - 1][n] != none and best[b - 1][n] == best[b][n]:
            joined.append(b - 1)
        else:
            n -= 1
            place[n] = b - 1
        b -= 1
    order = place + joined[::-1]
    return [order[r // per_node] * per_node + r % per_node for r in range(world)]


def exchange(pieces: Sequence[Piece], old: Mapping[int, Sequence[torch.Tensor]], new: Sequence[torch.Tensor] | None,
             *, rows: Sequence[int], old_world: int, new_world: int, holders: Sequence[int],
             takers: Sequence[int]) -> Traffic:
    """Carry out ``pieces`` (of :func:`plan` over ``rows``) on this rank of the default group:
    send the rows of its old shards others need, receive the rows its new shards need, copy
    the ones it both holds and takes.

    Collective over the default group: every rank calls it with the same plan (a rank that
    neither holds nor takes a shard has nothing to do). The pieces go in batches of
    :data:`MAX_IN_FLIGHT` consecutive pieces of the plan, the same batches on every rank;
    a rank posts its part of a batch once its part of the one before is done, so every
    send it waits on was posted by its peer in the same batch (no cycle of waits).

    Args:
        old: ``old[i][t]``: tensor ``t`` of old shard ``i``, rows first, for each old shard this
            rank holds (its own; after a loss, also a lost rank's, from its replica).
        new: ``new[t]``: tensor ``t``'s new local shard on this rank, allocated, written here
            (None: it takes none).
        holders: ``holders[i]``: the rank holding old shard ``i`` (``len == old_world``; a rank
            may hold several).
        takers: ``takers[j]``: the rank taking new shard ``j`` (``len == new_world``).

    Returns:
        This rank's :class:`Traffic`.

    Raises:
        ValueError: ``holders`` / ``takers`` of the wrong length, or a local shard whose row
            count is not the plan's (the layout is not ``torch.chunk``'s): before any send.
    """
    if len(holders) != old_world or len(takers) != new_world:
        raise ValueError(f"{len(holders)} holders for {old_world} old shards, {len(takers)} takers for {new_world}")
    me = dist.get_rank()
    checks = [(f"old shard {i}", old.get(i), i, old_world) for i, r in enumerate(holders) if r == me]
    if me in takers:
        checks.append(("new shard", new, takers.index(me), new_world))
    for label, shards, which, world in checks:
        for t, n in enumerate(rows):
            want = chunk_rows(n, world, which)[1]
            got = None if shards is None or t >= len(shards) else shards[t]
            if got is None or got.dim() == 0 or got.shape[0] != want:
                raise ValueError(f"tensor {t}: this rank's {label} has shape "
                                 f"{None if got is None else tuple(got.shape)}, the plan gives it {want} rows")
    mine: list[Transfer] = []
    for tag, p in enumerate(pieces):
        src, dst = holders[p.src], takers[p.dst]
        if me not in (src, dst):
            continue
        view = into = None
        if me == src:
            s0 = chunk_rows(rows[p.tensor], old_world, p.src)[0]
            view = old[p.src][p.tensor].narrow(0, p.start - s0, p.rows)
        if me == dst:
            d0 = chunk_rows(rows[p.tensor], new_world, p.dst)[0]
            into = new[p.tensor].narrow(0, p.start - d0, p.rows)  # type: ignore[union-attr]
        mine.append((tag, src, dst, view, into))
    return transfer(mine, len(pieces))


def transfer(mine: Sequence[Transfer], total: int) -> Traffic:
    """This rank's part of a plan of ``total`` transfers numbered alike on every rank:
    each one it both sends and receives copied in place, the others sent or received
    (the number is the tag). They go in batches of :data:`MAX_IN_FLIGHT` consecutive
    numbers, the same batches on every rank; a rank posts its part of a batch once its
    part of the one before is done, so every send it waits on was posted by its peer in
    the same batch (no cycle of waits); its in-place copies of a batch run after its sends
    and receives are posted, while the transport carries them (a peer waiting on this
    rank's send does not wait for them too); one whose destination is its source's very
    memory (a new shard made a view of the old one's rows) is not copied at all.
    Collective over the default group. Returns this rank's :class:`Traffic`."""
    me = dist.get_rank()
    batches: dict[int, list[Transfer]] = {}
    for t in mine:
        batches.setdefault(t[0] // MAX_IN_FLIGHT, []).append(t)
    traffic, t0 = Traffic(), time.perf_counter()
    for b in range(-(-total // MAX_IN_FLIGHT)):
        ops: list[dist.P2POp] = []
        local: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tag, src, dst, view, into in batches.get(b, []):
            if src == dst and _aliases(into, view):  # type: ignore[arg-type]
                traffic.in_place_bytes += view.numel() * view.element_size()  # type: ignore[union-attr]
            elif src == dst:
                local.append((into, view))  # type: ignore[arg-type]
                traffic.copied_bytes += view.numel() * view.element_size()  # type: ignore[union-attr]
            elif me == src:
                ops.append(dist.P2POp(dist.isend, view.contiguous(), dst, tag=tag))  # type: ignore[union-attr]
                traffic.sent_bytes += view.numel() * view.element_size()  # type: ignore[union-attr]
                traffic.sends += 1
            else:
                ops.append(dist.P2POp(dist.irecv, into, src, tag=tag))  # type: ignore[arg-type]
                traffic.received_bytes += into.numel() * into.element_size()  # type: ignore[union-attr]
                traffic.receives += 1
        works = dist.batch_isend_irecv(ops) if ops else []
        for into, view in local:  # while the transport moves this batch's bytes
            into.copy_(view)
        for work in works:
            work.wait()
    traffic.seconds = time.perf_counter() - t0
    return traffic


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)
