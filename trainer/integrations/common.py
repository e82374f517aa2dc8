"""The commit protocol, once for every trainer (:class:`Committer`), and its folder form
for frameworks that save a *directory* (DeepSpeed, HF Trainer, DCP).

:class:`Committer` is the protocol (save, upload, manifest last, status line, gc); a
:class:`ShardWriter` is the format: the reference trainer's one in-memory shard
(:mod:`trainer.run`), or a framework's folder (:class:`DirCheckpointer`).

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

A worker that ran a user's script (:mod:`trainer.integrations.hf_launch`) ends through
:func:`end_worker`: every rank leaves the process group together, then the process ends
without the interpreter's finalization, which a libtorch thread can abort.
"""

from __future__ import annotations

import atexit
from gc import collect as collect_garbage  # the name gc here is trainer.checkpoint.gc (the store's)
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar, runtime_checkable

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
from trainer.runtime import DistContext, StatusWriter, barrier, exit_process

__all__ = ["Committer", "ShardWriter", "DirCheckpointer", "CommitResult", "merge_shards", "all_gather_objects", "broadcast_object",
           "newest_intact", "end_worker"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class CommitResult:
    """What one :meth:`Committer.commit` did: the manifest and its cost (seconds, bytes):
    ``save_s`` the format's save, ``upload_s`` the shards and the manifest to the store
    (rank 0's), ``seconds`` the whole commit as the training loop waited for it
    (barriers and collectives included; default ``save_s + upload_s``); ``reused``: the
    step was committed already, nothing saved."""

    __slots__ = ("manifest", "save_s", "upload_s", "bytes", "reused", "seconds")

    def __init__(self, manifest: Manifest, save_s: float, upload_s: float, nbytes: int, *,
                 reused: bool = False, seconds: float | None = None) -> None:
        self.manifest = manifest
        self.save_s = save_s
        self.upload_s = upload_s
        self.bytes = nbytes
        self.reused = reused
        self.seconds = save_s + upload_s if seconds is None else seconds


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


@runtime_checkable
class ShardWriter(Protocol):
    """How one checkpoint format becomes shards in the store, for :meth:`Committer.commit`.

    Each method is called on every rank, in this order, at the same point: ``prepare``
    (before the save is timed), ``save`` (the framework's save, collective if it likes:
    it is timed as ``save_s``), then, after a barrier, ``upload`` (timed as ``upload_s``;
    the shards this rank uploaded, ``[]`` for none), and ``cleanup`` (once the outcome
    is known, committed or not). ``upload`` raises CheckpointError, ValueError or OSError
    for a failure every rank then learns of; a ``save`` that raises goes up as it is on
    its rank and as a CheckpointError naming that rank on the others, once their saves
    returned, and leaves what it wrote (no ``cleanup``); a save that is itself collective
    must fail on every rank, as DCP's does.
    """

    def prepare(self, step: int) -> None: ...

    def save(self, step: int) -> None: ...

    def upload(self, step: int) -> list[ShardInfo]: ...

    def cleanup(self, step: int) -> None: ...


class Committer:
    """The commit protocol, once for every format (:class:`ShardWriter`)::

        all ranks    writer.save(step)            the format's own (collective) save
        all ranks    barrier                      every file of this step is written
        all ranks    writer.upload(step)          this rank's shards (streamed, sha256)
        all ranks    all_gather_object(shards)    rank 0 learns every rank's shards
        rank 0       commit(manifest)             manifest LAST: the single commit point
        all ranks    broadcast(manifest)          nobody trains on until it is committed
        all ranks    status line; rank 0 gc

    A step already committed (:attr:`last_committed`: resumed there, or a periodic and a
    notice commit at one boundary) is not saved again: its manifest records the notices
    it now answers (:func:`~trainer.checkpoint.record_answered`), and its status line is
    written so a waiting agent can leave.

    Args:
        ctx: this process (rank, local rank, world size).
        store: where checkpoints are committed.
        status: the agent's status file writer (``checkpoint_committed`` lines).
        guard: the job's guard; the notices a commit answers are marked handled.
        keep: committed checkpoints kept by gc after each commit (>= 1).
        last_committed: the newest commit this rank knows of (every rank the same).

    Every method is collective: all ranks call it at the same point.
    """

    def __init__(self, ctx: DistContext, store: CheckpointStore, status: StatusWriter, guard: PreemptionGuard,
                 *, keep: int = 2, last_committed: Manifest | None = None) -> None:
        self.ctx, self.store, self.status, self.guard = ctx, store, status, guard
        self.keep = keep
        self.last_committed = last_committed

    def writer(self, save: ShardWriter | Callable[[Path], None]) -> ShardWriter:
        """The :class:`ShardWriter` that ``save`` stands for (here: ``save`` itself)."""
        if not isinstance(save, ShardWriter):
            raise TypeError(f"{type(self).__name__}.commit needs a ShardWriter, got {type(save).__name__}")
        return save

    def commit(
        self,
        step: int,
        save: ShardWriter | Callable[[Path], None],
        *,
        reason: str,
        decision: Decision | None,
        global_batch_size: int,
        data_position: dict,
        extra: dict | None = None,
        presave_s: float = 0.0,
    ) -> CommitResult:
        """Save step ``step`` (``save``: the format's writer, :meth:`writer`), upload its shards
        and commit it, manifest last.

        ``presave_s``: seconds the framework already spent saving before this call
        (e.g. the HF Trainer saves before ``on_save``); added to the reported ``save_s``
        so the daemon's flush-deadline check sees the whole flush. The manifest's
        ``extra`` holds ``extra``, the notice ids, ``reason``, ``save_s`` and ``upload_s``.

        Returns:
            The manifest and the measured save/upload seconds and bytes.

        Raises:
            CheckpointError: any rank failed (a save, an upload, the manifest's put, or the
                re-answer's put); no manifest was written (raised on every rank, naming the
                rank and its error).
        """
        start = time.perf_counter()
        self.guard.mark_handled(list(decision.notice_ids) if decision else [])
        last = self.last_committed
        # rank 0's word on whether the step is committed already, not each rank's: a rank that
        # joined in process since may not hold the manifest in memory, and a rank that took
        # the reuse path while another saved would wait in a collective the other never makes
        if broadcast_object(self.ctx, last is not None and last.step == step):
            return self._reuse(last, decision, reason, extra or {}, start)
        writer = self.writer(save)
        writer.prepare(step)
        barrier(self.ctx)
        t0 = time.perf_counter()
        own = self._try(writer.save, step)
        failed = None if own is None else f"rank {self.ctx.rank}: save failed: {type(own).__name__}: {own}"
        errors = [e for e in all_gather_objects(self.ctx, failed) if e]  # every rank learns (and waits)
        if own is not None:
            raise own  # as the format raised it, here; the others raise CheckpointError
        if errors:
            raise CheckpointError(f"step {step} not committed: {'; '.join(map(str, errors))}")
        t1 = time.perf_counter()
        shards, error = self._upload(writer, step)
        t2 = time.perf_counter()
        save_s, upload_s = presave_s + (t1 - t0), t2 - t1
        gathered = all_gather_objects(self.ctx, (shards, error))
        outcome: tuple[Manifest | None, str | None] = (None, None)
        if self.ctx.is_leader:
            extra = {**(extra or {}), "notice_ids": self.guard.handled_ids, "reason": reason,
                     "save_s": round(save_s, 4), "upload_s": round(upload_s, 4)}
            outcome = self._commit_manifest(step, gathered, global_batch_size, data_position, extra)
            upload_s = time.perf_counter() - t1  # the manifest's put is part of the upload
        # every rank reports rank 0's timings (the daemon's flush check reads them as rank 0's node's)
        manifest, err, save_s, upload_s = broadcast_object(  # type: ignore[misc]
            self.ctx, (*outcome, save_s, upload_s))
        writer.cleanup(step)
        if manifest is None:
            raise CheckpointError(f"step {step} not committed: {err}")
        self.last_committed = manifest
        result = CommitResult(manifest, save_s, upload_s, sum(s.size for s in manifest.shards),
                              seconds=presave_s + time.perf_counter() - start)
        self._emit(step, decision, reason, result)
        self._gc(step, reason, result)
        return result

    @staticmethod
    def _try(fn: Callable[[int], object], step: int) -> Exception | None:
        """``fn(step)``; None, or what it raised, for the other ranks to learn of before
        it goes up: a failure on one rank must not leave the others waiting in the next
        collective, nor let them train on as if the step were committed."""
        try:
            fn(step)
        except Exception as exc:  # noqa: BLE001 - re-raised by commit() once the peers know
            return exc
        return None

    def _upload(self, writer: ShardWriter, step: int) -> tuple[list[ShardInfo] | None, str | None]:
        try:
            return writer.upload(step), None
        except (CheckpointError, ValueError, OSError) as exc:
            return None, f"rank {self.ctx.rank}: {exc}"

    def _commit_manifest(self, step: int, gathered: list, global_batch_size: int, data_position: dict,
                         extra: dict) -> tuple[Manifest | None, str | None]:
        """Rank 0: the manifest of every rank's shards, committed; or why not."""
        errors = [e for _, e in gathered if e]
        if errors:
            return None, "; ".join(errors)
        try:
            manifest = Manifest(step=step, world_size=self.ctx.world_size, global_batch_size=global_batch_size,
                                data_position=data_position, shards=merge_shards([s for s, _ in gathered]),
                                time=time.time(), extra=extra)
            commit(self.store, manifest)
        except Exception as exc:  # noqa: BLE001 - the peers learn of it through the broadcast
            log.exception("rank 0: the manifest of step %d was not committed", step)
            return None, f"rank 0: {type(exc).__name__}: {exc}"
        return manifest, None

    def _reuse(self, last: Manifest | None, decision: Decision | None, reason: str, extra: dict,
               start: float) -> CommitResult:
        """The step is committed already (rank 0's ``last``; another rank's may be None):
        record the notices it answers now (with ``extra`` and ``reason``, so a commit read
        back from the store names this attempt), nothing saved. Rank 0 puts the manifest;
        every rank gets its word on it."""
        outcome: tuple[Manifest | None, str | None] = (last, None)
        if self.ctx.is_leader:
            assert last is not None  # rank 0 chose this path from its own
            try:
                outcome = (record_answered(self.store, last, self.guard.handled_ids,
                                           extra={**extra, "reason": reason}), None)
            except Exception as exc:  # noqa: BLE001 - the peers learn of it through the broadcast
                log.exception("rank 0: the manifest of step %d was not re-answered", last.step)
                outcome = (None, f"rank 0: {type(exc).__name__}: {exc}")
        answered, err = broadcast_object(self.ctx, outcome)  # type: ignore[misc]
        if answered is None:
            raise CheckpointError(f"step {last.step} committed, but the notices it answers were not recorded: {err}")
        self.last_committed = last = answered
        result = CommitResult(last, 0.0, 0.0, sum(s.size for s in last.shards), reused=True,
                              seconds=time.perf_counter() - start)
        self._emit(last.step, decision, reason, result)
        return result

    def _emit(self, step: int, decision: Decision | None, reason: str, r: CommitResult) -> None:
        self.status.emit(
            "checkpoint_committed",
            step,
            notice_ids=list(decision.notice_ids) if decision else [],
            kinds=list(decision.kinds) if decision else [],
            seconds=round(r.seconds, 4),  # the whole commit, as the loop waited for it
            save_s=round(r.save_s, 4),  # the format's save, rank 0's
            upload_s=round(r.upload_s, 4),  # rank 0's node's shards to the store
            bytes=r.bytes,
            reason=reason,
            reused=r.reused,
        )

    def _gc(self, step: int, reason: str, r: CommitResult) -> None:
        if not self.ctx.is_leader:
            return
        log.info("committed step %d (%s): %d bytes, save %.2f s, upload %.2f s",
                 step, reason, r.bytes, r.save_s, r.upload_s)
        try:
            gc(self.store, keep=self.keep)
        except CheckpointError as exc:
            log.warning("checkpoint gc failed: %s", exc)


class _Folder:
    """A :class:`ShardWriter` for a framework that saves a folder: ``save_fn(local)`` on
    every rank into node-local ``scratch/save-<step>``, uploaded by each node's leader."""

    def __init__(self, ctx: DistContext, store: CheckpointStore, scratch: Path,
                 save_fn: Callable[[Path], None]) -> None:
        self.ctx, self.store, self.scratch, self.save_fn = ctx, store, scratch, save_fn

    def _local(self, step: int) -> Path:
        return self.scratch / f"save-{step:08d}"

    def prepare(self, step: int) -> None:
        if self.ctx.is_local_leader:
            shutil.rmtree(self._local(step), ignore_errors=True)

    def save(self, step: int) -> None:
        self.save_fn(self._local(step))

    def upload(self, step: int) -> list[ShardInfo]:
        return write_dir(self.store, step, self._local(step)) if self.ctx.is_local_leader else []

    def cleanup(self, step: int) -> None:
        if self.ctx.is_local_leader:
            shutil.rmtree(self._local(step), ignore_errors=True)


class DirCheckpointer(Committer):
    """Commits a framework's checkpoint folder through the manifest-last protocol
    (:class:`Committer`, with each node's folder as its shards) and fetches it back.

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
        super().__init__(ctx, store, status, guard, keep=keep)
        self.scratch = Path(scratch)

    def writer(self, save: ShardWriter | Callable[[Path], None]) -> ShardWriter:
        """``save(local_dir)``, a framework's save into a folder, on every rank: each node's
        folder (``scratch/save-<step>``) is uploaded by its leader and removed after."""
        return save if isinstance(save, ShardWriter) else _Folder(self.ctx, self.store, self.scratch, save)

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


# --------------------------------------------------------------------------- the end of a worker


def end_worker(code: int) -> NoReturn:
    """End this worker once the user's script has returned (``code`` 0) or refused to run.

    In order, each step what the interpreter's own exit would do, or must be done before it:

    1. the non-daemon threads the script left are joined (as at a normal exit);
    2. ``code`` 0 with a process group: every rank meets at a barrier, so none leaves
       while a peer is still in a collective with it (a peer that failed makes this
       rank's barrier raise: exit 1, one line), the cycles the script left are
       collected while the group is still registered, then the group is destroyed:
       its last reference, when torch's was the last, drops with the GIL released
       (gloo's worker threads are joined; NCCL's communicators shut down);
    3. the ``atexit`` handlers run (the script's and its libraries', ``logging``'s
       among them) on an intact interpreter;
    4. :func:`trainer.runtime.exit_process`: streams flushed, ``os._exit(code)``.

    Why not return and let the interpreter finalize (``terminate called without an
    active exception``, SIGABRT, on rank 1 of a completed run; the stack below is from a
    core of the same abort in a two-rank script shaped like the Trainer's end): a
    gloo worker thread releases its last work *after* waking the rank that waited on it;
    when that work holds tensors whose Python objects the rank dropped meanwhile (HF's
    ``store_flos`` all-gather is the last collective of ``Trainer.train``), the release
    takes the GIL (``TensorImpl::decref_pyobject``). Once ``Py_FinalizeEx`` has begun,
    CPython ends such a thread with ``pthread_exit``; its forced unwind through the
    ``noexcept`` work destructor is ``std::terminate``: SIGABRT, and torchrun reports the
    finished job as failed. Destroying the group joins those threads only when nothing
    else holds it, and on the HF path something of the Trainer's keeps a reference (its
    two ``pt_gloo_runloop`` threads still run after ``gc.collect()`` and
    ``destroy_process_group``), so the last step never finalizes. What that skips:
    objects still alive are not collected (files the script left open and unreferenced
    were closed in step 2). The stack::

        ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject
        -> pybind11::gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> pthread_exit
        -> _Unwind_ForcedUnwind -> __gxx_personality_v0 -> std::terminate
        (main thread: Py_FinalizeEx)
    """
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    if code == 0 and dist.is_available() and dist.is_initialized():
        try:
            if dist.get_world_size() > 1:
                dist.barrier()
        except RuntimeError as exc:  # torch's DistError and gloo's connection errors
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"spotvisor: a peer left before every rank finished its script: {first}", file=sys.stderr,
                  flush=True)
            code = 1
        else:
            collect_garbage()
            dist.destroy_process_group()
    atexit._run_exitfuncs()  # what Py_FinalizeEx calls; the module has no public name for it
    exit_process(code)
