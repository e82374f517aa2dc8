"""The commit protocol for frameworks that save a *directory* (DeepSpeed, HF Trainer, DCP).

A framework writes its checkpoint folder on node-local disk, each rank its own
files (DeepSpeed: ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank and the
model states on rank 0; HF Trainer: ``rng_state_<r>.pth`` per rank and the rest on
rank 0; DCP: ``__<r>_0.distcp`` per rank and ``.metadata`` on the coordinator).
:class:`DirCheckpointer` turns that folder into one committed checkpoint::

    all ranks   save_fn(local_dir)           the framework's own (collective) save
    all ranks   barrier                      every file of this node is on disk
    node leader write_dir(store, step, dir)  upload this node's files (streamed, sha256)
    all ranks   all_gather_object(shards)    rank 0 learns every node's shards
    rank 0      commit(manifest)             manifest LAST: the single commit point
    all ranks   broadcast(ok)                nobody trains on until it is committed

Files written by several nodes under one name (e.g. a config every node writes)
must be identical (same sha256) and are listed once; different content under one
name is an error, because resume could not tell which one is right.

Resume (:meth:`DirCheckpointer.fetch_latest`): rank 0 picks the newest committed
checkpoint, every node leader downloads all of its shards into a fresh node-local
folder (checked against size and sha256), and if any node finds a shard corrupt,
rank 0 discards that checkpoint and all ranks try the previous one.

Each commit appends the ``checkpoint_committed`` status line the agent waits for
(with the notice ids it answers), and records its cost in the manifest's ``extra``
(``save_s``, ``upload_s``, ``bytes``) for the daemon's flush-deadline pre-flight.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from trainer.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
    ShardInfo,
    commit,
    discard,
    fetch_dir,
    gc,
    latest_committed,
    record_answered,
    write_dir,
)
from trainer.guard import Decision, PreemptionGuard
from trainer.runtime import DistContext, StatusWriter, barrier

__all__ = ["DirCheckpointer", "CommitResult", "merge_shards", "all_gather_objects", "broadcast_object",
           "newest_intact"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class CommitResult:
    """What one :meth:`DirCheckpointer.commit` did: the manifest and its cost (seconds, bytes)."""

    __slots__ = ("manifest", "save_s", "upload_s", "bytes")

    def __init__(self, manifest: Manifest, save_s: float, upload_s: float, nbytes: int) -> None:
        self.manifest = manifest
        self.save_s = save_s
        self.upload_s = upload_s
        self.bytes = nbytes


def merge_shards(per_rank: list[list[ShardInfo]]) -> tuple[ShardInfo, ...]:
    """One shard list from every node's uploads, sorted by name.

    Raises:
        CheckpointError: two nodes uploaded different content under one name.
    """
    merged: dict[str, ShardInfo] = {}
    for shards in per_rank:
        for s in shards:
            seen = merged.get(s.name)
            if seen is not None and seen != s:
                raise CheckpointError(
                    f"two nodes wrote {s.name!r} with different content ({seen.sha256[:12]} vs "
                    f"{s.sha256[:12]}): save it from one rank only"
                )
            merged[s.name] = s
    return tuple(merged[n] for n in sorted(merged))


def all_gather_objects(ctx: DistContext, obj: object) -> list[object]:
    """Every rank's ``obj`` (rank order); ``[obj]`` without a process group of more than one."""
    if not (ctx.initialized and ctx.world_size > 1):
        return [obj]
    out: list[object] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(ctx: DistContext, obj: object) -> object:
    """Rank 0's ``obj`` on every rank; ``obj`` itself without a process group of more than one."""
    if not (ctx.initialized and ctx.world_size > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def newest_intact(ctx: DistContext, store: CheckpointStore, fetch: Callable[[Manifest], T], *,
                  fetch_here: bool = True) -> tuple[Manifest | None, T | None]:
    """The one resume path: the newest committed checkpoint that every rank that fetches
    finds intact. Collective: every rank calls it.

    Rank 0 picks the newest committed manifest (a torn checkpoint, with no manifest, is
    never considered) and broadcasts it; each rank with ``fetch_here`` calls
    ``fetch(manifest)`` (download and check size and sha256, load); if any rank raises
    CorruptCheckpointError, rank 0 discards that checkpoint and all ranks try the
    previous one.

    Returns:
        ``(manifest, what fetch returned)``, or ``(None, None)`` when nothing is committed.

    Raises:
        StorageError (and what ``fetch`` raises besides CorruptCheckpointError): on the
        rank that saw it; the peers then fail in their next collective.
    """
    while True:
        manifest = latest_committed(store) if ctx.is_leader else None
        manifest = broadcast_object(ctx, manifest)
        if manifest is None:
            return None, None
        got: T | None = None
        corrupt = None
        if fetch_here:
            try:
                got = fetch(manifest)
            except CorruptCheckpointError as exc:
                corrupt = str(exc)
        reports = [r for r in all_gather_objects(ctx, corrupt) if r]
        if not reports:
            return manifest, got
        if ctx.is_leader:
            log.error("discarding corrupt checkpoint step %d: %s", manifest.step, reports[0])
            discard(store, manifest.step)
        barrier(ctx)


class DirCheckpointer:
    """Commits a framework's checkpoint folder through the manifest-last protocol.

    Args:
        ctx: this process (rank, local rank, world size).
        store: where checkpoints are committed.
        scratch: node-local directory (e.g. :func:`trainer.runtime.scratch_dir`);
            ``scratch/save-<step>`` and ``scratch/resume-<step>`` are used and removed.
        status: the agent's status file writer.
        guard: the job's guard; the notices a commit answers are marked handled.
        keep: committed checkpoints kept by gc after each commit (>= 1).

    Every method is collective: all ranks call it at the same point.
    """

    def __init__(
        self,
        ctx: DistContext,
        store: CheckpointStore,
        scratch: Path,
        status: StatusWriter,
        guard: PreemptionGuard,
        *,
        keep: int = 2,
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.scratch = Path(scratch)
        self.status = status
        self.guard = guard
        self.keep = keep
        self.last_committed: Manifest | None = None

    # -- commit

    def commit(
        self,
        step: int,
        save_fn: Callable[[Path], None],
        *,
        reason: str,
        decision: Decision | None,
        global_batch_size: int,
        data_position: dict,
        extra: dict | None = None,
        presave_s: float = 0.0,
    ) -> CommitResult:
        """Save (``save_fn(local_dir)`` on every rank), upload, and commit step ``step``.

        ``presave_s``: seconds the framework already spent saving before this call
        (e.g. the HF Trainer saves before ``on_save``); added to the reported ``save_s``
        so the daemon's flush-deadline check sees the whole flush.

        A step already committed (e.g. the job resumed at it) is not saved again;
        its status line is still written so a waiting agent can leave.

        Returns:
            The manifest and the measured save/upload seconds and bytes.

        Raises:
            CheckpointError: any rank failed; no manifest was written (raised on every rank).
        """
        notice_ids = list(decision.notice_ids) if decision else []
        self.guard.mark_handled(notice_ids)
        last = self.last_committed
        if last is not None and last.step == step:
            # already committed (resumed here, or periodic + notice at one boundary)
            answered = record_answered(self.store, last, self.guard.handled_ids, write=self.ctx.is_leader)
            if answered is not last:
                barrier(self.ctx)
                self.last_committed = last = answered
            result = CommitResult(last, 0.0, 0.0, sum(s.size for s in last.shards))
            self._emit(step, decision, reason, result, reused=True)
            return result
        local = self.scratch / f"save-{step:08d}"
        if self.ctx.is_local_leader:
            shutil.rmtree(local, ignore_errors=True)
        barrier(self.ctx)
        t0 = time.perf_counter()
        save_fn(local)
        barrier(self.ctx)
        t1 = time.perf_counter()
        save_s = presave_s + (t1 - t0)
        shards: list[ShardInfo] | None = []
        error = None
        if self.ctx.is_local_leader:
            try:
                shards = write_dir(self.store, step, local)
            except (CheckpointError, ValueError, OSError) as exc:
                error = f"rank {self.ctx.rank}: {exc}"
                shards = None
        t2 = time.perf_counter()
        gathered = all_gather_objects(self.ctx, (shards, error))
        outcome: tuple[Manifest | None, str | None] = (None, None)
        if self.ctx.is_leader:
            errors = [e for _, e in gathered if e]
            if errors:
                outcome = (None, "; ".join(errors))
            else:
                try:
                    manifest = Manifest(
                        step=step,
                        world_size=self.ctx.world_size,
                        global_batch_size=global_batch_size,
                        data_position=data_position,
                        shards=merge_shards([s for s, _ in gathered]),
                        time=time.time(),
                        extra={
                            **(extra or {}),
                            "notice_ids": self.guard.handled_ids,
                            "reason": reason,
                            "save_s": round(save_s, 4),
                            "upload_s": round(t2 - t1, 4),
                        },
                    )
                    commit(self.store, manifest)
                    outcome = (manifest, None)
                except (CheckpointError, ValueError) as exc:
                    outcome = (None, str(exc))
        manifest, err = broadcast_object(self.ctx, outcome)  # type: ignore[misc]
        if self.ctx.is_local_leader:
            shutil.rmtree(local, ignore_errors=True)
        if manifest is None:
            raise CheckpointError(f"step {step} not committed: {err}")
        self.last_committed = manifest
        result = CommitResult(manifest, save_s, t2 - t1, sum(s.size for s in manifest.shards))
        self._emit(step, decision, reason, result, reused=False)
        if self.ctx.is_leader:
            log.info("committed step %d (%s): %d bytes, save %.2f s, upload %.2f s",
                     step, reason, result.bytes, result.save_s, result.upload_s)
            try:
                gc(self.store, keep=self.keep)
            except CheckpointError as exc:
                log.warning("checkpoint gc failed: %s", exc)
        return result

    def _emit(self, step: int, decision: Decision | None, reason: str, r: CommitResult, *, reused: bool) -> None:
        self.status.emit(
            "checkpoint_committed",
            step,
            notice_ids=list(decision.notice_ids) if decision else [],
            kinds=list(decision.kinds) if decision else [],
            seconds=round(r.save_s + r.upload_s, 4),
            save_s=round(r.save_s, 4),
            upload_s=round(r.upload_s, 4),
            bytes=r.bytes,
            reason=reason,
            reused=reused,
        )

    # -- resume

    def fetch_latest(self) -> tuple[Manifest | None, Path | None]:
        """Download the newest committed checkpoint into a node-local folder on every node.

        A checkpoint a node finds corrupt (sha256 or size differs) is discarded by
        rank 0 and the previous committed one is tried; a torn one (no manifest)
        is never considered.

        Returns:
            ``(manifest, local_dir)``, or ``(None, None)`` when nothing is committed.
            The handled notice ids of the manifest are marked on the guard.

        Raises:
            StorageError: the store failed (on the rank that saw it; peers then fail
                in the next collective).
        """
        def fetch(manifest: Manifest) -> Path:
            local = self.scratch / f"resume-{manifest.step:08d}"
            shutil.rmtree(local, ignore_errors=True)
            fetch_dir(self.store, manifest, local)
            return local

        manifest, _ = newest_intact(self.ctx, self.store, fetch, fetch_here=self.ctx.is_local_leader)
        if manifest is None:
            return None, None
        barrier(self.ctx)
        self.guard.mark_handled(manifest.extra.get("notice_ids", ()))
        self.last_committed = manifest
        return manifest, self.scratch / f"resume-{manifest.step:08d}"

    def cleanup(self, local: Path | None) -> None:
        """Remove a folder :meth:`fetch_latest` returned (node leader, after every local rank loaded)."""
        barrier(self.ctx)
        if local is not None and self.ctx.is_local_leader:
            shutil.rmtree(local, ignore_errors=True)
