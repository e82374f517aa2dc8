"""Verified, resumable replication of one committed checkpoint from one store to another.

What whole-job migration uses: copy the newest committed checkpoint from the current
domain's store (``s3://bucket-use1/job``) to the target domain's store (another S3
region, ``oss://...``, ``file://...``), then resume the job there.

Protocol for step N (see :mod:`trainer.checkpoint` for the commit protocol itself):

1. Pick the source: ``step=None`` takes :func:`~trainer.checkpoint.latest_committed`
   (manifest present and parses, every shard present at its size), else
   :func:`~trainer.checkpoint.scan_step`. No committed step -> :class:`ReplicationError`.
2. List the destination's ``step-<N>/`` once. A destination manifest for step N that
   names another checkpoint (other shards, world size, batch size or data position) is
   refused before anything is written; one that only differs in ``extra``/``time``
   (the source's manifest was enriched since, e.g. by ``record_answered``) is replaced
   by the source's at the end.
3. For each shard of the manifest, in order:

   a. **Already there?** A destination object of the manifest's size is taken as done
      without moving a byte when the journal (below) records it as verified; a
      destination object of the right size that the journal does not know is read back
      and hashed, and taken as done only if its sha256 matches. Anything else (absent,
      another size, other bytes: a leftover of a cut copy, another job's step N) is
      overwritten, never trusted.
   b. **Copy**: ``src.get_file`` into ``<work_dir>/staging/<sha256>`` (the stores'
      streaming/multipart download), hashed from disk and checked against the
      manifest's size and sha256: a mismatch means the *source* is corrupt and the
      replication is refused (nothing of that shard is written). Then
      ``dst.put_file`` (the stores' multipart upload).
   c. **Verify**: ``dst.get_file`` into ``<work_dir>/verify/`` and hash it; only a
      match counts the shard as copied and is recorded in the journal. A mismatch is a
      :class:`ReplicationError` (the bad object is deleted).

4. Only when every shard is verified at the destination is the manifest written there
   (:func:`~trainer.checkpoint.commit`: sizes listed once more, ``manifest.json``
   last, one atomic PUT), then the step is checked to scan as committed. A copy cut at
   any point before that leaves a step directory without a manifest: torn, so
   ``latest_committed`` at the destination never resumes from it.

Cost of verification: every shard copied is downloaded once more from the destination
(destination egress/GET traffic equal to the bytes copied, and the time to read them).
A rerun (no journal entry) also reads back every shard already present at the
right size, instead of uploading it again.

Resume. The journal is ``<work_dir>/journal.jsonl``, one JSON line per shard verified
at a destination: ``{"dst": uri, "step", "name", "size", "sha256"}``, appended and
fsync-ed after each verification. An entry is trusted only while the destination's
listing still shows the object at that size; a copy cut after k of n shards (an
exception, a killed process) and run again with the same ``work_dir`` transfers only
the n - k others and reads back nothing it already verified. With another (or an
emptied) ``work_dir`` it still transfers only the n - k, but reads the k back to
verify them. (The journal's one blind spot: an object replaced at the destination by
other bytes of the same size after it was journaled. Resume's ``load_shard`` /
``fetch_dir`` check sha256 and would refuse it.) A shard cut inside its upload keeps
its staging copy in ``work_dir`` (reused after re-hashing it, so the source is not
read again); an :class:`~trainer.oss_store.OssStore` destination built with
``checkpoint_dir=<work_dir>/oss-resume`` (:func:`open_store_for` and the CLI do so)
then resumes that upload at the part level (oss2's record names the staging file,
unchanged). S3 uploads restart the shard from its first byte.

Disk: ``work_dir`` needs room for the largest shard (the staging copy is removed once
uploaded, before the read-back). A successful run leaves only the journal and the lock
file. One replication at a time per ``work_dir`` (an exclusive ``flock`` on
``<work_dir>/.lock``).

Shards move one after another; each store parallelises inside a shard (multipart).

CLI::

    python -m trainer.replicate SRC_URI DST_URI [--step N] [--work-dir D] [-v]

prints one summary line; a bad URI or argument is one line on stderr and exit status 2,
a failed replication one line and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from trainer.checkpoint import (
    MANIFEST_NAME,
    CommitConflictError,
    Manifest,
    MissingShardError,
    ShardInfo,
    commit,
    file_sha256,
    latest_committed,
    open_store,
    scan_step,
    step_dir,
)
from trainer.storage import CheckpointError, CheckpointStore, ObjectNotFoundError, StorageError

__all__ = ["ReplicationError", "Progress", "Replication", "replicate", "open_store_for", "main"]

log = structlog.get_logger(__name__)

JOURNAL_NAME = "journal.jsonl"
_LOCK_NAME = ".lock"


class ReplicationError(CheckpointError):
    """The replication was refused or failed its verification; the message is one line naming
    the step, the shard and the store. Running again is safe (what was verified is kept)."""


@dataclass(frozen=True)
class Progress:
    """Where a replication stands, after each shard is settled (copied and verified, or skipped).

    Attributes:
        step: the step being replicated.
        shard: the shard just settled.
        action: ``"copied"`` (transferred and verified) or ``"skipped"`` (already verified at dst).
        shards_done: shards settled so far (copied or skipped), of ``shards_total``.
        shards_total: shards in the manifest.
        bytes_done: bytes of the shards settled so far, of ``bytes_total``.
        bytes_total: bytes of every shard of the manifest.
        bytes_copied: bytes uploaded to dst so far.
        seconds: wall-clock seconds since the replication started.
    """

    step: int
    shard: str
    action: Literal["copied", "skipped"]
    shards_done: int
    shards_total: int
    bytes_done: int
    bytes_total: int
    bytes_copied: int
    seconds: float


@dataclass(frozen=True)
class Replication:
    """What :func:`replicate` did.

    Attributes:
        step: the step replicated (now committed at dst).
        shards_copied: shards transferred, then verified at dst.
        shards_skipped: shards already at dst and verified (journal or read-back), not transferred.
        bytes_copied: bytes uploaded to dst (sum of the copied shards' sizes).
        bytes_total: bytes of every shard of the checkpoint.
        bytes_read_back: bytes downloaded from dst to verify (copied shards, plus
            present shards the journal did not vouch for).
        seconds: wall-clock seconds the call took.
        manifest: the manifest now committed at dst (the source's).
        src_uri: the source store's URI.
        dst_uri: the destination store's URI.
    """

    step: int
    shards_copied: int
    shards_skipped: int
    bytes_copied: int
    bytes_total: int
    bytes_read_back: int
    seconds: float
    manifest: Manifest
    src_uri: str
    dst_uri: str

    def summary(self) -> str:
        """One line for a human: what moved, how much, how fast."""
        return (
            f"replicated step {self.step} from {self.src_uri} to {self.dst_uri}: "
            f"{self.shards_copied} shards copied, {self.shards_skipped} already there; "
            f"{_human(self.bytes_copied)} of {_human(self.bytes_total)} transferred in {self.seconds:.1f} s"
        )


# --------------------------------------------------------------------------- the journal


class _Journal:
    """Shards verified at a destination, as ``(dst uri, step, name, size, sha256)``; append-only JSON lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: set[tuple[str, int, str, int, str]] = set()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("replicate_journal_unreadable", path=str(path), error=str(exc))
            return
        for line in text.splitlines():
            try:
                e = json.loads(line)
                self.entries.add((str(e["dst"]), int(e["step"]), str(e["name"]), int(e["size"]), str(e["sha256"])))
            except (ValueError, TypeError, KeyError):  # a line torn by a kill: that shard is read back instead
                continue

    def has(self, dst: CheckpointStore, step: int, info: ShardInfo) -> bool:
        return (dst.uri, step, info.name, info.size, info.sha256) in self.entries

    def record(self, dst: CheckpointStore, step: int, info: ShardInfo) -> None:
        entry = (dst.uri, step, info.name, info.size, info.sha256)
        if entry in self.entries:
            return
        line = json.dumps({"dst": dst.uri, "step": step, "name": info.name, "size": info.size,
                           "sha256": info.sha256}, sort_keys=True)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # the shard is verified; only a rerun's shortcut is lost
            log.warning("replicate_journal_write_failed", path=str(self.path), error=str(exc))
            return
        self.entries.add(entry)


# --------------------------------------------------------------------------- replication


def replicate(
    src: CheckpointStore,
    dst: CheckpointStore,
    *,
    step: int | None = None,
    work_dir: str | os.PathLike[str],
    on_progress: Callable[[Progress], None] | None = None,
) -> Replication:
    """Copy committed checkpoint ``step`` (None: the newest) from ``src`` to ``dst``, verified, then commit it there.

    Blocking (run it in a thread from async code). Every shard is streamed through a
    file in ``work_dir`` (never held in memory), checked against the source manifest's
    size and sha256 on the way, uploaded, read back from ``dst`` and hashed again; the
    manifest is written at ``dst`` only after every shard verified, so an interrupted
    call leaves nothing ``latest_committed(dst)`` would resume from. Running it again
    (same ``work_dir``) transfers only what is not verified at ``dst`` yet; on a
    complete step it is a no-op (``shards_skipped`` = every shard). See the module
    docstring for the journal, the read-back cost and the disk needed.

    Args:
        src: where the checkpoint is committed.
        dst: where to replicate it (another store: not ``src.uri``).
        step: the step to copy; None takes the newest committed step of ``src``.
        work_dir: a local directory (created) for the staging copy (room for the largest
            shard, in bytes), the read-back copy, the journal and the lock. Keep it across
            retries of the same replication to skip re-verifying shards.
        on_progress: called after each shard is settled, in this thread. An exception it
            raises aborts the replication (what was verified so far is kept): the way to
            stop it from elsewhere (cancelling an ``asyncio.to_thread`` await does not stop
            the thread), e.g. raise when a ``threading.Event`` is set.

    Returns:
        A :class:`Replication` (counts, bytes, seconds, the manifest).

    Raises:
        ValueError: ``step`` is not an int >= 0, or ``src`` and ``dst`` are the same store.
        ReplicationError: no committed checkpoint (or not ``step``) in ``src``; a source
            shard is gone or differs from its manifest (the source is corrupt: refused);
            ``dst`` already commits another checkpoint at that step; a shard read back
            from ``dst`` differs; ``work_dir`` is in use by another replication.
        StorageError: a store failed (transient: running again resumes).
    """
    if step is not None:
        step_dir(step)  # ValueError on a bad step
    if src.uri == dst.uri:
        raise ValueError(f"source and destination are the same store ({src.uri})")
    started = time.monotonic()
    work = Path(work_dir)
    with _locked(work):
        manifest = _source_manifest(src, step)
        step = manifest.step
        prefix = step_dir(step) + "/"
        present = dst.list(prefix)
        _existing_manifest(dst, manifest, present)  # refuses another checkpoint at that step
        journal = _Journal(work / JOURNAL_NAME)
        staging_dir, verify_dir = work / "staging", work / "verify"
        bytes_total = sum(s.size for s in manifest.shards)
        log.info("replicate_started", src=src.uri, dst=dst.uri, step=step, shards=len(manifest.shards),
                 bytes_total=bytes_total)

        copied = skipped = bytes_copied = bytes_read_back = bytes_done = 0
        for i, info in enumerate(manifest.shards):
            key = prefix + info.name
            action: Literal["copied", "skipped"]
            at_dst = present.get(key)
            if at_dst == info.size and journal.has(dst, step, info):
                action = "skipped"  # verified by an earlier run, still there at its size
            else:
                verified = False
                if at_dst == info.size:  # not vouched for by the journal: read it back
                    bytes_read_back += info.size
                    verified = _verify_at_dst(dst, key, info, verify_dir)
                if verified:
                    action = "skipped"
                else:
                    if at_dst is not None:
                        log.warning("replicate_dst_shard_overwritten", dst=dst.uri, step=step, shard=info.name,
                                    size=at_dst, expected_size=info.size)
                    _copy_shard(src, dst, key, info, step, staging_dir)
                    bytes_read_back += info.size
                    if not _verify_at_dst(dst, key, info, verify_dir):
                        with contextlib.suppress(StorageError):
                            dst.delete([key])
                        raise ReplicationError(
                            f"dst verification failed: step {step} shard {info.name} read back from {dst.uri} "
                            f"does not match the manifest ({info.size} bytes sha256 {info.sha256}); "
                            f"the bad copy was deleted"
                        )
                    action = "copied"
                    bytes_copied += info.size
                journal.record(dst, step, info)
            if action == "copied":
                copied += 1
            else:
                skipped += 1
            bytes_done += info.size
            log.info("replicate_shard_" + action, dst=dst.uri, step=step, shard=info.name, size=info.size,
                     done=i + 1, of=len(manifest.shards))
            if on_progress is not None:
                on_progress(Progress(step=step, shard=info.name, action=action, shards_done=i + 1,
                                     shards_total=len(manifest.shards), bytes_done=bytes_done,
                                     bytes_total=bytes_total, bytes_copied=bytes_copied,
                                     seconds=time.monotonic() - started))

        _commit_at_dst(dst, manifest)
        shutil.rmtree(staging_dir, ignore_errors=True)
        shutil.rmtree(verify_dir, ignore_errors=True)
        result = Replication(step=step, shards_copied=copied, shards_skipped=skipped, bytes_copied=bytes_copied,
                             bytes_total=bytes_total, bytes_read_back=bytes_read_back,
                             seconds=time.monotonic() - started, manifest=manifest, src_uri=src.uri,
                             dst_uri=dst.uri)
        log.info("replicate_done", src=src.uri, dst=dst.uri, step=step, shards_copied=copied,
                 shards_skipped=skipped, bytes_copied=bytes_copied, bytes_read_back=bytes_read_back,
                 seconds=round(result.seconds, 3))
        return result


@contextlib.contextmanager
def _locked(work: Path) -> Iterator[None]:
    try:
        work.mkdir(parents=True, exist_ok=True)
        fd = os.open(work / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ReplicationError(f"cannot use work_dir {work}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ReplicationError(f"work_dir {work} is in use by another replication") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _source_manifest(src: CheckpointStore, step: int | None) -> Manifest:
    if step is None:
        manifest = latest_committed(src)
        if manifest is None:
            raise ReplicationError(f"no committed checkpoint in {src.uri}")
        return manifest
    manifest = scan_step(src, step)
    if manifest is None:
        raise ReplicationError(f"step {step} is not committed in {src.uri}")
    return manifest


def _checkpoint_identity(m: Manifest) -> tuple:
    """What makes two manifests the same checkpoint (``extra`` and ``time`` aside)."""
    return (m.step, m.world_size, m.global_batch_size, json.dumps(m.data_position, sort_keys=True), m.shards)


def _existing_manifest(dst: CheckpointStore, manifest: Manifest, present: dict[str, int]) -> Manifest | None:
    """dst's manifest for the step if it parses; refuses one that names another checkpoint."""
    key = f"{step_dir(manifest.step)}/{MANIFEST_NAME}"
    if key not in present:
        return None
    try:
        existing = Manifest.from_json(dst.get_bytes(key))
    except ObjectNotFoundError:
        return None
    except StorageError:
        raise
    except CheckpointError:  # unparsable: commit() overwrites it
        return None
    if _checkpoint_identity(existing) != _checkpoint_identity(manifest):
        raise ReplicationError(
            f"step {manifest.step} in {dst.uri} is already committed with another checkpoint "
            f"(world_size {existing.world_size}, data_position {existing.data_position}); "
            f"discard() it there first if it is known bad"
        )
    return existing


def _verify_at_dst(dst: CheckpointStore, key: str, info: ShardInfo, verify_dir: Path) -> bool:
    """Whether the object at ``key`` in dst has the shard's size and sha256 (downloaded and hashed)."""
    target = verify_dir / info.sha256
    try:
        dst.get_file(key, target)
        size, digest = target.stat().st_size, file_sha256(target)
    except ObjectNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"hashing {target} (read back from {dst.uri}/{key}): {exc}") from exc
    finally:
        target.unlink(missing_ok=True)
    if (size, digest) != (info.size, info.sha256):
        log.warning("replicate_dst_shard_mismatch", dst=dst.uri, key=key, size=size, sha256=digest,
                    expected_size=info.size, expected_sha256=info.sha256)
        return False
    return True


def _copy_shard(src: CheckpointStore, dst: CheckpointStore, key: str, info: ShardInfo, step: int,
                staging_dir: Path) -> None:
    """Stage the shard from src (verified against the manifest), upload it to dst, drop the staging copy.

    A staging copy left by an earlier cut run is reused when it still hashes right;
    it stays on disk if the upload fails, so the next run (and oss2's part record) reuses it.
    """
    staged = staging_dir / info.sha256
    if not _staged_ok(staged, info):
        staged.unlink(missing_ok=True)
        try:
            src.get_file(key, staged)
        except ObjectNotFoundError as exc:
            raise ReplicationError(
                f"step {step}: shard {info.name} is gone from {src.uri} (deleted since the listing?)"
            ) from exc
        try:
            size, digest = staged.stat().st_size, file_sha256(staged)
        except OSError as exc:
            raise StorageError(f"hashing {staged} (from {src.uri}/{key}): {exc}") from exc
        if (size, digest) != (info.size, info.sha256):
            staged.unlink(missing_ok=True)
            raise ReplicationError(
                f"source is corrupt: step {step} shard {info.name} in {src.uri} is {size} bytes sha256 "
                f"{digest}, its manifest says {info.size} bytes sha256 {info.sha256}; refusing to replicate it"
            )
    dst.put_file(key, staged)
    staged.unlink(missing_ok=True)


def _staged_ok(staged: Path, info: ShardInfo) -> bool:
    try:
        return staged.stat().st_size == info.size and file_sha256(staged) == info.sha256
    except OSError:
        return False


def _commit_at_dst(dst: CheckpointStore, manifest: Manifest) -> None:
    """Write the manifest at dst last (commit protocol), then check the step scans as committed."""
    try:
        commit(dst, manifest)
    except MissingShardError as exc:
        raise ReplicationError(f"dst verification failed: {exc}") from exc
    except CommitConflictError as exc:
        # Checked at the start to be the same checkpoint whose source manifest has a newer
        # ``extra``; re-checked here in case another writer committed the step meanwhile.
        current = _existing_manifest(dst, manifest, dst.list(step_dir(manifest.step) + "/"))
        if current is None:
            raise ReplicationError(f"dst verification failed: {exc}") from exc
        dst.put_bytes(f"{step_dir(manifest.step)}/{MANIFEST_NAME}", manifest.to_json().encode())
        log.info("replicate_manifest_updated", dst=dst.uri, step=manifest.step)
    committed = scan_step(dst, manifest.step)
    if committed is None or _checkpoint_identity(committed) != _checkpoint_identity(manifest):
        raise ReplicationError(
            f"dst verification failed: step {manifest.step} does not scan as committed in {dst.uri} after the commit"
        )


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def open_store_for(uri: str, work_dir: str | os.PathLike[str], *, s3_endpoint_url: str | None = None,
                   oss_endpoint: str | None = None) -> CheckpointStore:
    """:func:`~trainer.checkpoint.open_store` for a replication through ``work_dir``: an OSS store
    keeps oss2's part records under ``<work_dir>/oss-resume``, so a shard cut inside its
    upload (or download) resumes at the part level in the next run.

    Raises:
        ValueError: as ``open_store`` (unsupported scheme, malformed URI, OSS without an endpoint).
    """
    store = open_store(uri, s3_endpoint_url=s3_endpoint_url, oss_endpoint=oss_endpoint)
    if urllib.parse.urlparse(uri).scheme == "oss":
        from trainer.oss_store import OssStore

        assert isinstance(store, OssStore)
        store = OssStore(uri, endpoint=store.endpoint, region=store.region,
                         checkpoint_dir=Path(work_dir) / "oss-resume")
    return store


def main(argv: Sequence[str] | None = None, *, configure_logging: bool = False) -> int:
    """``python -m trainer.replicate SRC_URI DST_URI [--step N] [--work-dir D] [-v]``.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).
        configure_logging: point structlog at stderr (warnings; every shard with ``-v``),
            so stdout holds only the summary. The ``__main__`` entry does; a caller that
            configured logging itself does not.

    Returns:
        The exit status: 0 replicated (one summary line on stdout), 1 the replication
        failed, 2 bad arguments or URIs (one line on stderr each).
    """
    p = _Parser(prog="python -m trainer.replicate",
                description="Copy a committed checkpoint to another store, verified, then commit it there.")
    p.add_argument("src", metavar="SRC_URI", help="file:///abs/path, s3://bucket/prefix or oss://bucket/prefix")
    p.add_argument("dst", metavar="DST_URI", help="same forms as SRC_URI")
    p.add_argument("--step", type=int, default=None, help="step to copy (default: the newest committed)")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "spotvisor-replicate",
                   help="staging, journal and OSS part records; keep it to resume (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each shard on stderr")
    args = p.parse_args(argv)
    if configure_logging:
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if args.verbose else logging.WARNING),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        )
    try:
        src, dst = open_store_for(args.src, args.work_dir), open_store_for(args.dst, args.work_dir)
        result = replicate(src, dst, step=args.step, work_dir=args.work_dir)
    except ValueError as exc:
        print(f"{p.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"{p.prog}: replication failed: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main(configure_logging=True))
