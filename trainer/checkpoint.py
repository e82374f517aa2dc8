"""Checkpoint commit protocol: when a checkpoint exists, and which one resume takes.

Layout under a store's root URI (``file:///abs/path`` or ``s3://bucket/prefix``)::

    step-00000042/
        rank-0.pt            shards, written by every rank with write_shard()
        rank-1.pt
        manifest.json        written LAST, by rank 0 only, with commit()

Protocol for one checkpoint at step N:

1. Every rank writes its shard(s) under ``step-<N:08d>/`` with :func:`write_shard`,
   which returns the shard's size (bytes) and sha256.
2. The ranks meet at a barrier; the :class:`ShardInfo` of every rank are gathered on
   rank 0 (the trainer does this; this module does no collectives).
3. Rank 0 calls :func:`commit` with a :class:`Manifest`: step, world size, global
   batch size, data position, every shard's size and sha256, and a free ``extra``.
   ``commit`` checks that every listed shard is present with its size, then writes
   ``manifest.json``.

A checkpoint **exists only if** its ``manifest.json`` exists, parses, names the step
of its directory, and every shard it lists is present with the listed size. The
sha256 is checked when a shard is loaded (:func:`load_shard`), not when listing,
so finding the newest checkpoint costs one listing plus one small read.

Why the manifest is last: a node can be killed at any instant (that is the point
of a spot instance), and S3/OSS have no atomic rename of a directory, so a
half-written step directory is a normal sight. Writing the manifest after every
shard makes its presence the single commit point: every reader sees either no
manifest (the step is in progress or torn, and is ignored) or a manifest whose
shards were all written before it. A single object PUT is atomic on S3 and
``os.replace`` is atomic on a POSIX file system, so the manifest itself is never
seen half-written.

Resume takes :func:`latest_committed`; a torn directory (a shard missing or short,
no manifest, a manifest that does not parse) is never selected, the previous
committed one is. :func:`gc` removes torn directories older than the newest
committed one and committed ones beyond the newest ``keep``; it never touches a
directory newer than the newest committed one, since that may be in progress.

No torch import here: the trainer turns its state into bytes (``torch.save``) itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from trainer.storage import (
    CheckpointError,
    CheckpointStore,
    FileStore,
    ObjectNotFoundError,
    S3Store,
    StorageError,
    check_key,
)

__all__ = [
    "CheckpointError",
    "StorageError",
    "ObjectNotFoundError",
    "CorruptCheckpointError",
    "CommitConflictError",
    "MissingShardError",
    "ShardInfo",
    "Manifest",
    "StepDir",
    "CheckpointStore",
    "FileStore",
    "S3Store",
    "open_store",
    "scan_step",
    "step_dir",
    "write_shard",
    "write_dir",
    "fetch_dir",
    "file_sha256",
    "commit",
    "scan",
    "list_committed",
    "latest_committed",
    "load_shard",
    "discard",
    "record_answered",
    "gc",
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
]


def open_store(
    uri: str, *, s3_endpoint_url: str | None = None, oss_endpoint: str | None = None
) -> CheckpointStore:
    """The store for ``uri``: ``file:///abs/path`` -> FileStore, ``s3://bucket/prefix`` -> S3Store,
    ``oss://bucket/prefix`` -> OssStore (needs ``oss_endpoint``).

    Endpoints default to ``$SPOTVISOR_S3_ENDPOINT_URL`` / ``$SPOTVISOR_OSS_ENDPOINT``.

    Raises:
        ValueError: unsupported scheme, malformed URI, or oss:// without an endpoint (one-line message).
    """
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme == "file":
        return FileStore(uri)
    if scheme == "s3":
        return S3Store(uri, endpoint_url=s3_endpoint_url or os.environ.get("SPOTVISOR_S3_ENDPOINT_URL") or None)
    if scheme == "oss":
        endpoint = oss_endpoint or os.environ.get("SPOTVISOR_OSS_ENDPOINT")
        if not endpoint:
            raise ValueError(f"checkpoint URI {uri!r} needs an OSS endpoint (job.oss_endpoint / $SPOTVISOR_OSS_ENDPOINT)")
        from trainer.oss_store import OssStore  # oss2 is imported only by those who use OSS

        return OssStore(uri, endpoint=endpoint)
    raise ValueError(
        f"unsupported checkpoint URI {uri!r}: use file:///abs/path, s3://bucket/prefix or oss://bucket/prefix"
    )


log = structlog.get_logger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------- errors



class CorruptCheckpointError(CheckpointError):
    """A shard of a committed checkpoint is missing, or its size or sha256 differs from the manifest."""


class CommitConflictError(CheckpointError):
    """A manifest for this step already exists with different content."""


class MissingShardError(CheckpointError):
    """``commit`` refused: a shard listed in the manifest is absent or has another size."""


# --------------------------------------------------------------------------- types


@dataclass(frozen=True)
class ShardInfo:
    """One shard file of a checkpoint.

    Attributes:
        name: path relative to the step directory, '/'-separated (e.g. ``"rank-0.pt"``).
        size: length in bytes.
        sha256: lowercase hex digest (64 characters) of the shard's bytes.

    Raises:
        ValueError: at construction, on a bad name, a negative size or a malformed digest.
    """

    name: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        _check_shard_name(self.name)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise ValueError(f"shard {self.name!r}: size must be an int >= 0, got {self.size!r}")
        if not isinstance(self.sha256, str) or not _SHA256_RE.match(self.sha256):
            raise ValueError(
                f"shard {self.name!r}: sha256 must be 64 lowercase hex chars, got {self.sha256!r}"
            )

    @classmethod
    def of(cls, name: str, data: bytes) -> ShardInfo:
        """The ShardInfo of ``data`` stored as ``name``."""
        return cls(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())


@dataclass(frozen=True)
class Manifest:
    """What rank 0 commits for one checkpoint; its presence is the commit.

    Attributes:
        step: optimizer steps completed when the state was taken (>= 0).
        world_size: ranks that wrote the checkpoint (>= 1).
        global_batch_size: samples per optimizer step (>= 1); constant across resizes.
        data_position: where the data stream resumes, JSON-serialisable,
            e.g. ``{"consumed_samples": 1200, "seed": 0}``.
        shards: every shard of the checkpoint (names unique); a list is turned into a tuple.
        time: unix seconds of the commit; defaults to now.
        extra: free-form JSON-serialisable dict, e.g. ``{"notice_ids": [...]}``.

    Raises:
        ValueError: at construction, on an out-of-range number, duplicate shard
            names, or a dict that JSON cannot encode.
    """

    step: int
    world_size: int
    global_batch_size: int
    data_position: dict
    shards: tuple[ShardInfo, ...]
    time: float = field(default_factory=time.time)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, low in (("step", 0), ("world_size", 1), ("global_batch_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"manifest {name} must be an int >= {low}, got {value!r}")
        shards = tuple(self.shards)
        if not all(isinstance(s, ShardInfo) for s in shards):
            raise ValueError("manifest shards must be ShardInfo instances")
        names = [s.name for s in shards]
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ValueError(f"manifest shard names must be unique and not {MANIFEST_NAME!r}: {names}")
        object.__setattr__(self, "shards", shards)
        t = self.time
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise ValueError(f"manifest time must be finite unix seconds, got {self.time!r}")
        object.__setattr__(self, "time", float(self.time))
        for name in ("data_position", "extra"):
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise ValueError(f"manifest {name} must be a dict, got {type(value).__name__}")
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"manifest {name} is not JSON-serialisable: {exc}") from exc

    def shard(self, name: str) -> ShardInfo:
        """The shard called ``name``.

        Raises:
            KeyError: no such shard; the message lists the manifest's shard names.
        """
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(f"step {self.step} has no shard {name!r}; it has {[s.name for s in self.shards]}")

    def to_json(self) -> str:
        """The manifest as JSON text (UTF-8 safe, keys sorted, ``format`` = MANIFEST_FORMAT)."""
        body = dataclasses.asdict(self)
        body["format"] = MANIFEST_FORMAT
        return json.dumps(body, sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse what :meth:`to_json` wrote.

        Raises:
            CheckpointError: not UTF-8 or JSON, a missing or ill-typed field, an
                unknown ``format``, or any value the constructor refuses.
        """
        try:
            body = json.loads(text)
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, got {type(body).__name__}")
            if body.get("format") != MANIFEST_FORMAT:
                raise ValueError(
                    f"unsupported manifest format {body.get('format')!r} (this code reads {MANIFEST_FORMAT})"
                )
            shards = body["shards"]
            if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
                raise ValueError("'shards' must be a list of objects")
            return cls(
                step=body["step"],
                world_size=body["world_size"],
                global_batch_size=body["global_batch_size"],
                data_position=body["data_position"],
                shards=tuple(ShardInfo(name=s["name"], size=s["size"], sha256=s["sha256"]) for s in shards),
                time=body["time"],
                extra=body["extra"],
            )
        # JSONDecodeError and UnicodeDecodeError are ValueErrors.
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"bad manifest: {exc!r}") from exc

    def _content(self) -> Manifest:
        """Self as stored (JSON round trip), with ``time`` zeroed: what commit compares."""
        return dataclasses.replace(Manifest.from_json(self.to_json()), time=0.0)


@dataclass(frozen=True)
class StepDir:
    """One ``step-<N>`` directory as :func:`scan` found it.

    Attributes:
        step: N.
        prefix: ``"step-<N:08d>/"``.
        keys: every key under the prefix -> size in bytes.
        manifest: the verified manifest, or None when the directory is not committed.
        reason: why it is not committed (None when it is).
    """

    step: int
    prefix: str
    keys: dict
    manifest: Manifest | None
    reason: str | None

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def _check_shard_name(name: str) -> None:
    if not isinstance(name, str):
        raise ValueError(f"shard name must be a str, got {name!r}")
    check_key(name)



# --------------------------------------------------------------------------- protocol


def step_dir(step: int) -> str:
    """The directory name of step ``step``: ``step_dir(42) == "step-00000042"``.

    Raises:
        ValueError: negative step.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:08d}"


def _manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def write_shard(store: CheckpointStore, step: int, name: str, data: bytes) -> ShardInfo:
    """Store one shard of step ``step`` (any rank); returns its size (bytes) and sha256 for the manifest.

    Raises:
        ValueError: bad step or name (``manifest.json`` is reserved).
        StorageError: the backend failed.
    """
    info = ShardInfo.of(name, data)
    if name == MANIFEST_NAME:
        raise ValueError(f"{MANIFEST_NAME!r} is reserved for the manifest")
    store.put_bytes(f"{step_dir(step)}/{name}", data)
    return info


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Lowercase hex sha256 of a local file, read in 8 MiB blocks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            h.update(block)
    return h.hexdigest()


def write_dir(
    store: CheckpointStore, step: int, local_dir: str | os.PathLike[str], *, prefix: str = ""
) -> list[ShardInfo]:
    """Upload every file under ``local_dir`` as a shard of step ``step`` (any rank, any node).

    A framework's checkpoint folder (DeepSpeed ``global_stepN/``, a Hugging Face
    ``checkpoint-N/``, a DCP directory) becomes shards named ``prefix + relative path``.
    Files are streamed (:meth:`CheckpointStore.put_file`), hashed from disk, and
    uploaded in sorted order; temporary files (``.tmp-`` in the name) are skipped.

    Returns:
        One :class:`ShardInfo` per file (size in bytes, sha256), for the manifest.

    Raises:
        ValueError: bad step, or a file name the manifest cannot hold.
        StorageError: the backend failed, or a file vanished while uploading.
    """
    root = Path(local_dir)
    infos: list[ShardInfo] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if ".tmp-" in path.name:
            continue
        name = prefix + rel
        if name == MANIFEST_NAME:
            raise ValueError(f"{MANIFEST_NAME!r} is reserved for the manifest; rename {path}")
        try:
            info = ShardInfo(name=name, size=path.stat().st_size, sha256=file_sha256(path))
        except OSError as exc:
            raise StorageError(f"reading {path}: {exc}") from exc
        store.put_file(f"{step_dir(step)}/{name}", path)
        infos.append(info)
    return infos


def fetch_dir(
    store: CheckpointStore,
    manifest: Manifest,
    local_dir: str | os.PathLike[str],
    *,
    prefix: str = "",
    names: Iterable[str] | None = None,
) -> list[Path]:
    """Download the shards of a committed checkpoint whose names start with ``prefix``
    (or exactly ``names``) into ``local_dir``, without the prefix; each checked for size and sha256.

    Returns:
        The local paths written.

    Raises:
        KeyError: a name in ``names`` is not in the manifest.
        CorruptCheckpointError: a shard is gone, or its size or sha256 differs (the file is removed).
        StorageError: the backend failed.
    """
    root = Path(local_dir)
    wanted = [manifest.shard(n) for n in names] if names is not None else [
        s for s in manifest.shards if s.name.startswith(prefix)
    ]
    out = []
    for info in wanted:
        rel = info.name[len(prefix):] if info.name.startswith(prefix) else info.name
        target = root.joinpath(*rel.split("/"))
        try:
            store.get_file(f"{step_dir(manifest.step)}/{info.name}", target)
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(
                f"step {manifest.step}: shard {info.name} is missing from {store.uri}"
            ) from exc
        size, digest = target.stat().st_size, file_sha256(target)
        if (size, digest) != (info.size, info.sha256):
            target.unlink(missing_ok=True)
            raise CorruptCheckpointError(
                f"step {manifest.step}: shard {info.name} is {size} bytes sha256 {digest}, "
                f"manifest says {info.size} bytes sha256 {info.sha256}"
            )
        out.append(target)
    return out


def commit(store: CheckpointStore, manifest: Manifest) -> None:
    """Commit a checkpoint (rank 0 only, after every rank's write_shard returned).

    Checks every listed shard is present with its size, then writes
    ``manifest.json`` last. Idempotent: if the step already has a manifest with
    the same content (``time`` aside, so a retry that rebuilt the manifest is
    fine), nothing is written. A manifest that does not parse is overwritten.

    Raises:
        MissingShardError: a listed shard is absent or has another size; nothing written.
        CommitConflictError: the step already has a different manifest; nothing written.
        StorageError: the backend failed (safe to retry).
    """
    prefix = step_dir(manifest.step) + "/"
    present = store.list(prefix)
    bad = []
    for s in manifest.shards:
        size = present.get(prefix + s.name)
        if size is None:
            bad.append(f"{s.name} (absent)")
        elif size != s.size:
            bad.append(f"{s.name} ({size} bytes, expected {s.size})")
    if bad:
        raise MissingShardError(f"cannot commit step {manifest.step} in {store.uri}: shards {', '.join(bad)}")
    key = _manifest_key(manifest.step)
    if key in present:
        try:
            existing = Manifest.from_json(store.get_bytes(key))
        except ObjectNotFoundError:
            existing = None
        except CheckpointError as exc:
            if isinstance(exc, StorageError):
                raise
            log.warning("checkpoint_manifest_overwritten", uri=store.uri, step=manifest.step, error=str(exc))
            existing = None
        if existing is not None:
            if existing._content() == manifest._content():
                log.info("checkpoint_commit_idempotent", uri=store.uri, step=manifest.step)
                return
            raise CommitConflictError(
                f"step {manifest.step} in {store.uri} is already committed with a different manifest "
                f"(world_size {existing.world_size}, data_position {existing.data_position}); "
                f"discard() it first if it is known bad"
            )
    store.put_bytes(key, manifest.to_json().encode())
    log.info("checkpoint_committed", uri=store.uri, step=manifest.step, shards=len(manifest.shards))


def _group_step_dirs(listing: dict[str, int]) -> dict[int, dict[str, int]]:
    groups: dict[int, dict[str, int]] = {}
    for key, size in listing.items():
        head, sep, _ = key.partition("/")
        m = _STEP_DIR_RE.match(head)
        if sep and m:
            groups.setdefault(int(m.group(1)), {})[key] = size
    return groups


def _verify(store: CheckpointStore, step: int, keys: dict[str, int]) -> StepDir:
    prefix = step_dir(step) + "/"

    def torn(reason: str) -> StepDir:
        return StepDir(step=step, prefix=prefix, keys=keys, manifest=None, reason=reason)

    key = prefix + MANIFEST_NAME
    if key not in keys:
        return torn("no manifest")
    try:
        manifest = Manifest.from_json(store.get_bytes(key))
    except ObjectNotFoundError:  # deleted since the listing (gc elsewhere)
        return torn("no manifest")
    except StorageError:
        raise  # a transient read error must not make a good checkpoint look torn
    except CheckpointError as exc:
        return torn(f"unparsable manifest: {exc}")
    if manifest.step != step:
        return torn(f"manifest names step {manifest.step}")
    for s in manifest.shards:
        size = keys.get(prefix + s.name)
        if size is None:
            return torn(f"shard {s.name} missing")
        if size != s.size:
            return torn(f"shard {s.name} is {size} bytes, manifest says {s.size}")
    return StepDir(step=step, prefix=prefix, keys=keys, manifest=manifest, reason=None)


def _scan_iter(store: CheckpointStore) -> Iterator[StepDir]:
    groups = _group_step_dirs(store.list("step-"))
    for step in sorted(groups, reverse=True):
        yield _verify(store, step, groups[step])


def scan(store: CheckpointStore) -> list[StepDir]:
    """Every step directory, newest first, each verified (manifest + sizes; not sha256).

    Raises:
        StorageError: the backend failed.
    """
    return list(_scan_iter(store))


def scan_step(store: CheckpointStore, step: int) -> Manifest | None:
    """The manifest of ``step`` if that step is committed (manifest present, parses, names
    the step, every shard present at its size; not sha256), else None. One listing of the
    step's directory and one manifest read.

    Raises:
        StorageError: the backend failed (never reported as "not committed").
    """
    return _verify(store, step, store.list(step_dir(step) + "/")).manifest


def list_committed(store: CheckpointStore) -> list[Manifest]:
    """The committed checkpoints, newest first. One listing plus one manifest read per step directory.

    Raises:
        StorageError: the backend failed (never reported as "not committed").
    """
    return [d.manifest for d in _scan_iter(store) if d.manifest is not None]


def latest_committed(store: CheckpointStore) -> Manifest | None:
    """The newest committed checkpoint (what resume takes), or None if there is none.

    Reads manifests newest first and stops at the first that verifies.

    Raises:
        StorageError: the backend failed.
    """
    for d in _scan_iter(store):
        if d.manifest is not None:
            return d.manifest
    return None


def load_shard(store: CheckpointStore, manifest: Manifest, name: str) -> bytes:
    """The bytes of shard ``name`` of a committed checkpoint, checked against size and sha256.

    Raises:
        KeyError: the manifest lists no shard ``name``.
        CorruptCheckpointError: the shard is gone, or its size or sha256 differs.
        StorageError: the backend failed.
    """
    info = manifest.shard(name)
    key = f"{step_dir(manifest.step)}/{name}"
    try:
        data = store.get_bytes(key)
    except ObjectNotFoundError as exc:
        raise CorruptCheckpointError(
            f"step {manifest.step}: shard {name} is missing from {store.uri}"
        ) from exc
    if len(data) != info.size:
        raise CorruptCheckpointError(
            f"step {manifest.step}: shard {name} is {len(data)} bytes, manifest says {info.size}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise CorruptCheckpointError(
            f"step {manifest.step}: shard {name} sha256 {digest} != manifest {info.sha256}"
        )
    return data


def _delete_step_dir(store: CheckpointStore, d: StepDir) -> None:
    # Manifest first: an interrupted delete leaves an uncommitted (torn) directory,
    # never a manifest whose shards are partly gone.
    manifest_key = d.prefix + MANIFEST_NAME
    if manifest_key in d.keys:
        store.delete([manifest_key])
    store.delete([k for k in d.keys if k != manifest_key])


def discard(store: CheckpointStore, step: int) -> bool:
    """Delete step ``step``'s directory (manifest first), e.g. after CorruptCheckpointError.

    Returns whether anything was there.

    Raises:
        StorageError: the backend failed.
    """
    prefix = step_dir(step) + "/"
    keys = store.list(prefix)
    if not keys:
        return False
    _delete_step_dir(store, StepDir(step=step, prefix=prefix, keys=keys, manifest=None, reason="discarded"))
    log.info("checkpoint_discarded", uri=store.uri, step=step)
    return True


def gc(store: CheckpointStore, keep: int = 2) -> list[str]:
    """Delete what resume can never take. Run from one process (rank 0 after a commit).

    Deletes torn step directories older than the newest committed one, and
    committed ones beyond the newest ``keep``. Never deletes the newest committed
    one, nor any directory newer than it (it may be in progress). With no
    committed checkpoint, deletes nothing.

    Example: committed 10, 30, 40; torn 5, 20; in progress 50; keep=2
    -> deletes 5, 10, 20; keeps 30, 40, 50.

    Returns:
        The deleted step directory names (``"step-00000010"``), oldest first.

    Raises:
        ValueError: keep < 1.
        StorageError: the backend failed (what was deleted so far stays deleted).
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    dirs = scan(store)  # newest first
    committed = [d for d in dirs if d.committed]
    if not committed:
        return []
    newest = committed[0].step
    doomed = [d for d in dirs if d.step < newest and not d.committed] + committed[keep:]
    deleted = []
    for d in sorted(doomed, key=lambda d: d.step):
        _delete_step_dir(store, d)
        deleted.append(step_dir(d.step))
        log.info("checkpoint_gc", uri=store.uri, step=d.step, reason=d.reason or "beyond keep")
    return deleted


def record_answered(store: CheckpointStore, manifest: Manifest, handled_ids: Iterable[str], *,
                    extra: dict | None = None, write: bool = True) -> Manifest:
    """A step already committed now answers more notices (the job resumed there, or a
    periodic and a notice commit fell on one boundary): its manifest must name them, or
    a worker restarted there would act on them once more. Nothing is saved again; the
    same shards get a richer ``extra`` (``notice_ids``, plus ``extra``) in one atomic put
    of the manifest.

    Args:
        handled_ids: every notice id the job has handled (the guard's, oldest first).
        write: put the manifest (rank 0); other ranks only compute what it now says.

    Returns:
        The manifest as it stands now (``manifest`` itself when it already named them).

    Raises:
        StorageError: the put failed.
    """
    handled = list(handled_ids)
    if set(handled) <= set(manifest.extra.get("notice_ids", ())):
        return manifest
    new = dataclasses.replace(manifest, extra={**manifest.extra, **(extra or {}), "notice_ids": handled},
                              time=time.time())
    if write:
        store.put_bytes(f"{step_dir(manifest.step)}/{MANIFEST_NAME}", new.to_json().encode())
    return new
