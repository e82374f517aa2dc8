"""A second copy of each rank's shards on another node, so that a sharded job survives a
node lost without notice in its running processes, without going back to its last commit.

After every step (``--replicate-shards``), right after the optimizer step, rank ``r`` sends its
shards (every parameter's and AdamW's moments, the rows it holds) to its *buddy*
``(r + L) % W`` and receives those of ``(r - L) % W`` (``L``: ranks per node, so the buddy
is on the next node; torchrun numbers a node's ranks contiguously), into host memory
(:class:`BuddyReplica`). A copy replaces the one before only once it has wholly arrived,
so a peer lost in the middle of the exchange leaves the previous copy intact.

After a loss the survivors re-form (:mod:`trainer.recovery`), tell each other their old
rank, their step and the copy they hold (:func:`recovery_holders`: pure), and when
every lost rank's shards are in a surviving buddy's copy *at the survivors' step*, the
old layout is whole again: each old shard is held by its owner or by the owner's buddy.
:mod:`trainer.integrations.p2p_reshard` then moves it to the new, smaller layout, and the
step that failed is trained again: no step lost. Otherwise (two neighbouring nodes lost
at once, a copy a step behind, survivors at different steps) the answer is a reason,
and the survivors load the newest commit as before.

Measured costs (``bench.resize_scaling`` and bench/README.md): the exchange moves each
rank's shard once per replicated step over the same links as training, and each rank
holds two buffers of its predecessor's shard (the copy, and the one arriving).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BuddyReplica", "Copy", "buddy", "recovery_holders"]

log = logging.getLogger(__name__)


def buddy(rank: int, world: int, per_node: int) -> int | None:
    """The rank that keeps ``rank``'s copy: the same local rank on the next node
    (``(rank + per_node) % world``); None when the world is one node (no other node to keep it)."""
    if world <= per_node or per_node < 1:
        return None
    return (rank + per_node) % world


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """A replica this rank holds: old rank ``of``'s shards as of ``step``."""

    of: int
    step: int
    tensors: list[torch.Tensor]


def recovery_holders(survivors: Sequence[dict[str, Any]], old_world: int, per_node: int) -> list[int] | str:
    """Which new rank holds each old shard after a loss, or why the replicas cannot rebuild it.

    Args:
        survivors: one entry per rank of the new group, in new-rank order:
            ``{"old": old rank, "step": its step, "copy": [of, step] or None}``.
        old_world: ranks before the loss.
        per_node: ranks per node (the buddy offset).

    Returns:
        ``holders``, ``holders[i]`` the new rank holding old shard ``i`` (its owner, or its
        buddy's copy); or a one-line reason the survivors must reload the newest commit.
    """
    steps = sorted({int(s["step"]) for s in survivors})
    if len(steps) != 1:
        return f"the survivors are at different steps {steps}"
    step = steps[0]
    by_old = {int(s["old"]): new for new, s in enumerate(survivors)}
    holders: list[int] = []
    for i in range(old_world):
        if i in by_old:
            holders.append(by_old[i])
            continue
        keeper = buddy(i, old_world, per_node)
        if keeper is None or keeper not in by_old:
            return f"old rank {i} and the rank keeping its copy ({keeper}) are both gone"
        copy = survivors[by_old[keeper]].get("copy")
        if not copy or int(copy[0]) != i:
            return f"old rank {keeper} holds no copy of old rank {i}"
        if int(copy[1]) != step:
            return f"the copy of old rank {i} is of step {copy[1]}, the survivors are at step {step}"
        holders.append(by_old[keeper])
    return holders


class BuddyReplica:
    """This rank's side of the buddy exchange: what it sends, and the copy it keeps.

    Collective over the default group: every rank calls :meth:`replicate` at the same
    steps with its own shards (the same tensors' shapes as at the last call, or new ones
    after a resize: :meth:`forget`)."""

    def __init__(self) -> None:
        self.copy: Copy | None = None
        self._spare: list[torch.Tensor] | None = None  # the buffer the next copy arrives in
        self.bytes_sent = 0

    def forget(self) -> None:
        """Drop the copy and buffers (the layout changed: a resize)."""
        self.copy = self._spare = None

    def replicate(self, shards: Sequence[torch.Tensor], *, step: int, rank: int, world: int, per_node: int) -> None:
        """Send ``shards`` (this rank's, as of ``step``) to its buddy and take its predecessor's.

        Raises:
            whatever the transport raises when a peer is gone (the copy held stays the previous one).
        """
        to = buddy(rank, world, per_node)
        if to is None:
            return
        frm = (rank - per_node) % world
        spare = self._spare
        if spare is None:  # the predecessor's shards have this rank's shapes only when rows split
            spare = self._buffers_for(shards, to, frm)  # evenly: ask for them (a few bytes per tensor)
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, tag=i) for i, t in enumerate(shards)]
        ops += [dist.P2POp(dist.irecv, b, frm, tag=i) for i, b in enumerate(spare)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        old = self.copy
        self.copy = Copy(frm, step, spare)
        self._spare = old.tensors if old is not None and old.of == frm else None
        self.bytes_sent = sum(t.numel() * t.element_size() for t in shards)

    @staticmethod
    def _buffers_for(shards: Sequence[torch.Tensor], to: int, frm: int) -> list[torch.Tensor]:
        """Buffers shaped like the predecessor's shards: each rank sends its shapes to its buddy."""
        mine = torch.tensor([d for t in shards for d in (t.dim(), *t.shape)], dtype=torch.int64)
        n = torch.tensor([mine.numel()], dtype=torch.int64)
        theirs_n = torch.empty(1, dtype=torch.int64)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, n, to, tag=1 << 20),
                                            dist.P2POp(dist.irecv, theirs_n, frm, tag=1 << 20)]):
            work.wait()
        theirs = torch.empty(int(theirs_n), dtype=torch.int64)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, to, tag=(1 << 20) + 1),
                                            dist.P2POp(dist.irecv, theirs, frm, tag=(1 << 20) + 1)]):
            work.wait()
        dims, out, k = theirs.tolist(), [], 0
        for t in shards:
            nd = dims[k]
            out.append(torch.empty(dims[k + 1:k + 1 + nd], dtype=t.dtype, device=t.device))
            k += 1 + nd
        return out
