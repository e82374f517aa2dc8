"""A second copy of each rank's shards on another node, so that a sharded job survives a
node lost without notice in its running processes, without going back to its last commit.

Every ``--replicate-every`` steps (with ``--replicate-shards``), right after the optimizer
step, rank ``r`` sends its shards (every parameter's and AdamW's moments, the rows it
holds) to its *buddy* ``(r + L) % W`` and receives those of ``(r - L) % W`` (``L``: ranks
per node, so the buddy is on the next node; torchrun numbers a node's ranks
contiguously), into host memory (:class:`BuddyReplica`). A copy replaces the one before
only once it has wholly arrived, so a peer lost in the middle of the exchange leaves the
previous copy intact; once replaced, the previous copy stays whole in its buffer until
the next copy starts arriving there. After a resize or a rebuild (a new layout, no copy
of it yet) the jobs copy before their next step, not after it: a second loss in that step
(losses come in waves) finds the new layout copied already.

Each rank also keeps a snapshot of its own shards as of the last copy's step, taken right
before the next optimizer step (:meth:`BuddyReplica.snapshot_before_update`): by then the
step's collectives have run, so every rank has its copy of that step, and the snapshot it
replaces (of the copy before) is no longer needed. A peer lost *inside* a copy's exchange
leaves the survivors a step past the copies, some holding the new copy and some only the
one before: with the snapshot, the old layout is whole again at the copies' step.

After a loss the survivors re-form (:mod:`trainer.recovery`), tell each other their old
rank, their step, their snapshot's step and the copies they hold (:func:`recovery_holders`:
pure), and take the newest step at which a surviving buddy holds a copy of each lost
rank's shards (its last copy or the one before) and every survivor holds its own (it is
at that step, or keeps a snapshot of it): the old layout is whole again there, each old
shard held by its owner or by the owner's buddy. :mod:`trainer.integrations.p2p_reshard`
then moves it to the new, smaller layout, and training goes on from that step: no step
lost when the copies are of the survivors' step, one when the loss fell inside a copy, at
most ``N`` with copies every ``N`` steps. Else (two neighbouring nodes lost at once, a copy from
before the last one, survivors that cannot go back) the answer is a reason, and the
survivors load the newest commit as before.

Measured costs (``bench.replica_overhead``, bench/README.md): the exchange moves each
rank's shard once per copy over the same links as training; each rank holds two buffers
of its predecessor's shard (the copy, and the one arriving) and a snapshot of its own,
each in a mapping of its own in host memory (:func:`_host_buffer`), also where the shards
are on a GPU: there the predecessor's shards arrive piece by piece through a staging area
of :data:`STAGING_BYTES` on the device (:func:`rounds`), so a GPU holds no copy. At 200 M
on two CPU cores, copying every step costs +4.8 % of a step (+6.0 % in an earlier run);
the snapshot 0.13-0.18 s of a 15.5 s step (+5.1 % for both, in one run).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BuddyReplica", "Copy", "add_replica_flags", "agree_on_holders", "buddy", "on_device", "per_node",
           "recovery_holders", "rounds", "STAGING_BYTES"]

log = logging.getLogger(__name__)

#: device memory a copy borrows while it arrives where the shards are on a GPU (bytes): the
#: predecessor's shards pass through it, a round at a time, into host memory (a copy and
#: the spare it arrives in would otherwise be two more shards on the GPU)
STAGING_BYTES = 256 << 20


def add_replica_flags(parser: Any, what: str) -> None:
    """``--replicate-shards`` and ``--replicate-every`` on a sharded trainer's ``parser``
    (an ``argparse.ArgumentParser``); ``what``: what is copied, for the help."""
    from trainer.runtime import positive_int

    parser.add_argument("--replicate-shards", action="store_true",
                        help=f"copy each rank's {what} to a rank on the next node (every --replicate-every "
                             "steps), and keep a snapshot of its own as of the copy, so a node lost without "
                             "notice costs at most --replicate-every steps (off: the survivors reload the last "
                             "commit)")
    parser.add_argument("--replicate-every", type=positive_int, default=1, metavar="STEPS",
                        help="with --replicate-shards: copy after every STEPS steps (default 1: a loss costs no "
                             "step, or one when it falls inside a copy; more: less traffic, a loss costs up to "
                             "STEPS)")


def per_node() -> int:
    """Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``): a copy goes this many ranks on."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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


def recovery_holders(survivors: Sequence[dict[str, Any]], old_world: int,
                     per_node: int) -> tuple[list[int], int] | str:
    """Which new rank holds each old shard after a loss, and the step they are all of; or
    why the copies cannot rebuild the old layout.

    Args:
        survivors: one entry per rank of the new group, in new-rank order: ``{"old": old
            rank, "step": the step its shards are at (None: at none, torn by the loss),
            "snap": the step of the snapshot of its own shards it keeps or None, "copy":
            [of, step] or None, "prev": the copy before it, [of, step] or None}``.
        old_world: ranks before the loss.
        per_node: ranks per node (the buddy offset).

    Returns:
        ``(holders, step)``: ``holders[i]`` the new rank holding old shard ``i`` as of
        ``step`` (its owner, from its shards or their snapshot, or its buddy's copy of it),
        ``step`` the newest step at which the lost ranks' copies and every survivor's own
        shards are all held (a survivor past it goes back to its snapshot: a loss inside a
        copy's exchange, or copies not made every step); or a one-line reason the
        survivors must reload the newest commit.
    """
    by_old = {int(s["old"]): new for new, s in enumerate(survivors)}
    holders: list[int] = []
    held: dict[int, set[int]] = {}  # each lost rank's: the steps its buddy holds a copy of
    for i in range(old_world):
        if i in by_old:
            holders.append(by_old[i])
            continue
        keeper = buddy(i, old_world, per_node)
        if keeper is None or keeper not in by_old:
            return f"old rank {i} and the rank keeping its copy ({keeper}) are both gone"
        kept = survivors[by_old[keeper]]
        held[i] = {int(c[1]) for c in (kept.get("copy"), kept.get("prev")) if c and int(c[0]) == i}
        if not held[i]:
            return f"old rank {keeper} holds no copy of old rank {i}"
        holders.append(by_old[keeper])
    if not held:  # nobody was lost
        at = sorted({s["step"] for s in survivors}, key=lambda x: (x is None, x))
        return (holders, at[0]) if len(at) == 1 and at[0] is not None else \
            f"the survivors are at different steps {at}"  # type: ignore[return-value]
    steps = sorted(set.intersection(*held.values()), reverse=True)
    if not steps:
        return "the copies of the lost ranks are of different steps " + \
            ", ".join(f"{sorted(v)} (old rank {i})" for i, v in sorted(held.items()))
    for step in steps:
        if all(s["step"] == step or s.get("snap") == step for s in survivors):
            return holders, step  # type: ignore[return-value]
    s = next(s for s in survivors if s["step"] != steps[0] and s.get("snap") != steps[0])
    kept = "no snapshot" if s.get("snap") is None else f"a snapshot of step {s['snap']}"
    at = "torn by the loss" if s["step"] is None else f"at step {s['step']}"
    return f"the copies are of step {steps[0]}, old rank {s['old']} is {at} and keeps {kept}"


def agree_on_holders(job: Any, replica: "BuddyReplica", old_rank: int, old_world: int, per_node: int, *,
                     torn: bool = False, **mine: Any) -> tuple[tuple[list[int], int] | str, list[dict[str, Any]]]:
    """Collective over the survivors' new group, after a loss: every survivor's ``{"old",
    "step", "snap", "copy", "prev"}`` (and ``mine``, for the caller's own checks) exchanged
    as JSON, and :func:`recovery_holders` over them, then refused (a reason) where going
    back to the copies' step would pass the newest commit (``job.committed_step``) or a
    stream's position (``job.streaming``). ``torn``: this rank's own shards are at no one
    step (the loss fell inside an optimizer step that has collectives of its own, as
    ZeRO's): it can only go back to its snapshot. Returns ``(holders and step, or a
    reason; the survivors' entries)``."""
    from trainer.exchange import all_gather_json

    def held(c: Copy | None) -> list[int] | None:
        return [c.of, c.step] if c is not None else None

    snap = replica.snapshot
    survivors = all_gather_json({"old": old_rank, "step": None if torn else job.state.step,
                                 "snap": snap.step if snap is not None else None,
                                 "copy": held(replica.copy), "prev": held(replica.previous), **mine})
    got = recovery_holders(survivors, old_world, per_node)
    if isinstance(got, tuple) and got[1] != job.state.step:
        back = got[1]
        if job.committed_step is not None and job.committed_step >= back:
            got = f"the newest commit (step {job.committed_step}) is as new as the copies (step {back})"
        elif job.streaming:
            got = f"a stream's position cannot go back to the copies' step {back}"
    return got, survivors


def rounds(shapes: Sequence[Sequence[int]], itemsizes: Sequence[int],
           max_bytes: int) -> list[list[tuple[int, int, int]]]:
    """How a copy of tensors of ``shapes`` (elements of ``itemsizes`` bytes) passes through a
    staging area of ``max_bytes``: rounds of ``(tensor, first element, elements)`` pieces of
    the flattened tensors, in order, each round's pieces laid end to end at 16-byte aligned
    offsets within ``max_bytes``; every element in exactly one piece. Pure: the sender and
    its buddy compute it alike from the sender's shapes.

    Raises:
        ValueError: ``max_bytes`` holds no element of some tensor.
    """
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for t, (shape, size) in enumerate(zip(shapes, itemsizes, strict=True)):
        left, start = math.prod(shape), 0
        while left > 0:
            fit = (max_bytes - used) // size
            if fit <= 0:
                if not cur:
                    raise ValueError(f"a staging area of {max_bytes} bytes holds no {size}-byte element")
                out.append(cur)
                cur, used = [], 0
                continue
            n = min(left, fit)
            cur.append((t, start, n))
            start, left = start + n, left - n
            used = -(-(used + n * size) // 16) * 16
    if cur:
        out.append(cur)
    return out


def on_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (a copy or a snapshot, in host memory) where the job's shards are, for the
    exchange that rebuilds the old layout after a loss (NCCL sends device memory); the
    same tensors where that is the CPU."""
    return [t if t.device == device else t.to(device) for t in tensors]


def _host_buffer(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A long-lived host-memory buffer for a copy of a tensor of ``like``'s dtype,
    uninitialised, wherever ``like`` lives: in an anonymous mapping of its own (``mmap``),
    outside the allocator's heap: kept in the heap, gigabytes of copies made every training
    step's temporaries page-fault afresh (+12 % of a 200 M step here,
    ``bench.replica_overhead``, against +2.6 % at 50 M mapped apart). Not pinned: a device
    copies into it synchronously (torch's pinned allocator rounds each block up to a power
    of two and keeps freed blocks; not measured on a GPU yet)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(tuple(shape), dtype=like.dtype)
    itemsize = torch.empty((), dtype=like.dtype).element_size()
    area = mmap.mmap(-1, numel * itemsize)  # the tensor keeps it alive (torch.frombuffer)
    return torch.frombuffer(area, dtype=like.dtype, count=numel).view(tuple(shape))


def _wait(works: Sequence[Any], interrupt: threading.Event | None) -> None:
    """Wait for ``works`` (a copy's sends and receives); with ``interrupt`` (the loss
    watch's, :class:`trainer.membership.LossWatch`), give up once it is set: the other
    survivors of a lost peer are re-forming the group.

    gloo leaves a point-to-point operation waiting until the group's timeout when the
    peer it waits on failed another exchange or died (measured with torch 2.13: a rank
    whose buddy died after sending its own copy waited the whole 120 s in its send while
    the others re-formed), and neither shutting its sockets down nor aborting the group
    ends that wait. So a worker thread waits, and this one follows the interrupt too; the
    abandoned wait ends at the group's timeout (its buffers keep their transport alive).

    Raises:
        torch.distributed.DistError: interrupted (a peer is lost).
        whatever the transport raises when a peer is gone.
    """
    if interrupt is None:
        for work in works:
            work.wait()
        return
    done, failed = threading.Event(), []

    def wait_all() -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait_all, name="spotvisor-copy-wait", daemon=True).start()
    while not done.wait(0.01):
        if interrupt.is_set():
            raise dist.DistError("the survivors of a lost peer re-form the group: the buddy copy is abandoned")
    if failed:
        raise failed[0]


class BuddyReplica:
    """This rank's side of the buddy exchange: what it sends, and the copy it keeps.

    Collective over the default group: every rank calls :meth:`replicate` at the same
    steps with its own shards (the same tensors' shapes as at the last call, or new ones
    after a resize: :meth:`forget`)."""

    def __init__(self, staging_bytes: int | None = None) -> None:
        #: the staging area's size (bytes) where the shards are on a device; given, the copy
        #: goes through a staging area on the CPU too (the same path, tested without a GPU)
        self.staging_bytes = staging_bytes
        self.copy: Copy | None = None
        #: the copy before :attr:`copy`, whole in the buffer the next copy will arrive in
        #: (None from the moment that copy starts arriving)
        self.previous: Copy | None = None
        #: this rank's own shards as of the last copy's step (:meth:`snapshot_before_update`)
        self.snapshot: Copy | None = None
        self._spare: list[torch.Tensor] | None = None  # the buffer the next copy arrives in

    def forget(self) -> None:
        """Drop the copies, the snapshot and the buffers (the layout changed: a resize)."""
        self.copy = self.previous = self.snapshot = self._spare = None

    def held(self, step: int) -> Copy | None:
        """The copy this rank holds of ``step`` (the last, or the one before), if any."""
        return next((c for c in (self.copy, self.previous) if c is not None and c.step == step), None)

    def snapshot_before_update(self, shards: Sequence[torch.Tensor], *, step: int, rank: int) -> bool:
        """Right before an optimizer step (``shards``: this rank's own, at ``step``, after
        the step's collectives): keep a snapshot of them when the last copy is of ``step``
        and none is kept yet. The collectives prove that every rank has its copy of
        ``step`` (each finished it before the step began), so the snapshot it replaces, of
        the copy before, is needed no more; a peer lost inside the next copy leaves the
        survivors a step past every copy they are sure to hold, and this snapshot takes
        them back. Returns whether it kept one."""
        if not self.wants_snapshot(step):
            return False
        self.keep_snapshot(shards, step=step, rank=rank)
        return True

    def wants_snapshot(self, step: int) -> bool:
        """Whether :meth:`snapshot_before_update` at ``step`` keeps one (a caller whose
        shards cost something to list asks first)."""
        return self.copy is not None and self.copy.step == step and (self.snapshot is None
                                                                     or self.snapshot.step != step)

    def keep_snapshot(self, shards: Sequence[torch.Tensor], *, step: int, rank: int) -> None:
        """Keep a copy of this rank's own ``shards`` as of ``step`` in host memory (into the
        last snapshot's buffers when it has one)."""
        old = self.snapshot
        if old is not None and len(old.tensors) == len(shards) and all(
                a.shape == b.shape for a, b in zip(old.tensors, shards)):
            for into, t in zip(old.tensors, shards):
                into.copy_(t)
            self.snapshot = Copy(rank, step, old.tensors)
        else:
            self.snapshot = Copy(rank, step, [_host_buffer(t.shape, t).copy_(t) for t in shards])

    def replicate(self, shards: Sequence[torch.Tensor], *, step: int, rank: int, world: int, per_node: int,
                  interrupt: threading.Event | None = None) -> None:
        """Send ``shards`` (this rank's, as of ``step``) to its buddy and take its predecessor's.
        ``interrupt``: set when the other survivors of a lost peer re-form the group (the
        loss watch's); the copy then gives up at once (shards in host memory: gloo).

        Raises:
            whatever the transport raises when a peer is gone, or
            torch.distributed.DistError: interrupted (the copy held stays the previous one).
        """
        on_cpu = all(t.device.type == "cpu" for t in shards)
        if not on_cpu:
            interrupt = None  # NCCL's wait blocks no thread; the loss watch aborts its kernels
        to = buddy(rank, world, per_node)
        if to is None:
            return
        frm = (rank - per_node) % world
        spare, self.previous = self._spare, None  # the copy before is overwritten from here on
        # the predecessor's shards have this rank's shapes only when rows split evenly: ask for
        # them (a few bytes per tensor), again when there are more (an optimizer's state since)
        if spare is None or len(spare) != len(shards):
            spare = self._buffers_for(shards, to, frm)
        if self.staging_bytes is None and on_cpu:
            ops = [dist.P2POp(dist.isend, t.contiguous(), to, tag=i) for i, t in enumerate(shards)]
            ops += [dist.P2POp(dist.irecv, b, frm, tag=i) for i, b in enumerate(spare)]
            _wait(dist.batch_isend_irecv(ops), interrupt)
        else:
            self._through_staging(shards, spare, to, frm, interrupt)
        old = self.copy
        self.copy = Copy(frm, step, spare)
        self.previous = old if old is not None and old.of == frm else None
        self._spare = self.previous.tensors if self.previous is not None else None

    def _through_staging(self, shards: Sequence[torch.Tensor], into: Sequence[torch.Tensor], to: int,
                         frm: int, interrupt: threading.Event | None = None) -> None:
        """The copy through a staging area on the shards' device, a round at a time
        (:func:`rounds`): this rank's pieces sent straight from its shards, its
        predecessor's received into the staging area and copied from there into ``into``
        (host memory) before the next round reuses it."""
        limit = self.staging_bytes or STAGING_BYTES
        out = [t.contiguous().view(-1) for t in shards]
        sends = rounds([t.shape for t in shards], [t.element_size() for t in shards], limit)
        takes = rounds([b.shape for b in into], [b.element_size() for b in into], limit)
        area = torch.empty(limit, dtype=torch.uint8, device=shards[0].device if shards else "cpu")
        sent = taken = 0  # each piece's tag: its number in the plan, the same at both ends
        for i in range(max(len(sends), len(takes))):
            ops = []
            for t, start, n in (sends[i] if i < len(sends) else []):
                ops.append(dist.P2POp(dist.isend, out[t].narrow(0, start, n), to, tag=sent))
                sent += 1
            landed, at = [], 0
            for t, start, n in (takes[i] if i < len(takes) else []):
                size = n * into[t].element_size()
                piece = area.narrow(0, at, size).view(into[t].dtype)
                ops.append(dist.P2POp(dist.irecv, piece, frm, tag=taken))
                taken += 1
                landed.append((into[t].view(-1).narrow(0, start, n), piece))
                at = -(-(at + size) // 16) * 16
            _wait(dist.batch_isend_irecv(ops) if ops else [], interrupt)
            for dst, piece in landed:
                dst.copy_(piece)  # into pageable host memory: synchronous, so the next round may reuse the area

    @staticmethod
    def _buffers_for(shards: Sequence[torch.Tensor], to: int, frm: int) -> list[torch.Tensor]:
        """Buffers shaped like the predecessor's shards: each rank sends its shapes to its buddy
        (small tensors on the shards' device: NCCL sends device memory)."""
        device = shards[0].device if shards else torch.device("cpu")
        mine = torch.tensor([d for t in shards for d in (t.dim(), *t.shape)], dtype=torch.int64, device=device)
        n = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
        theirs_n = torch.empty(1, dtype=torch.int64, device=device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, n, to, tag=1 << 20),
                                            dist.P2POp(dist.irecv, theirs_n, frm, tag=1 << 20)]):
            work.wait()
        theirs = torch.empty(int(theirs_n), dtype=torch.int64, device=device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, to, tag=(1 << 20) + 1),
                                            dist.P2POp(dist.irecv, theirs, frm, tag=(1 << 20) + 1)]):
            work.wait()
        dims, out, k = theirs.tolist(), [], 0
        for t in shards:
            nd = dims[k]
            out.append(_host_buffer(dims[k + 1:k + 1 + nd], t))
            k += 1 + nd
        return out
