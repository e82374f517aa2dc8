"""``job.workdir`` on the control node: packed, content-hashed, published to each store.

At daemon start (:meth:`daemon.controlnode.code_delivery.CodeDelivery.publish`) the
directory is packed into a **deterministic** gzip'd tar (:func:`pack`): entries in sorted
order, mtime, uid and gid zeroed, no owner names, modes normalised (0755 for a directory
or an executable file, 0644 otherwise), a gzip header with no name and no time; so the
same files give the same bytes and the same sha256 on any machine, at any time. Left
out: ``.git`` and ``__pycache__`` anywhere, and names matching ``job.workdir_exclude``
(fnmatch patterns, tried on the path relative to the workdir and on the name alone).
Refused, with one line naming ``job.workdir`` and the fix (:class:`WorkdirError`): a
symlink leading outside the directory, a special file (FIFO, socket, device), files over
``job.workdir_max_bytes`` in total.

The archive is uploaded once per hash to each placement domain's checkpoint store, as
``<checkpoint_uri>/code/<sha256>.tar.gz`` (:func:`publish`: skipped where the object is
there already with its size), with the control node's credentials. The checkpoint
protocol's garbage collection deletes step directories only, never ``code/``.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import os
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from daemon.config import Config

__all__ = ["WorkdirError", "Packed", "CodePin", "ALWAYS_EXCLUDED", "code_key", "pack", "publish"]

ALWAYS_EXCLUDED = (".git", "__pycache__")
CODE_PREFIX = "code"


class WorkdirError(ValueError):
    """``job.workdir`` cannot be packed or published; ``str()`` is one line naming the field and the fix."""


@dataclass(frozen=True, slots=True)
class Packed:
    """A packed workdir: the archive at ``path`` (``bytes`` long), its ``sha256`` (hex),
    ``files`` regular files of ``content_bytes`` in total."""

    path: Path
    sha256: str
    bytes: int
    files: int
    content_bytes: int


@dataclass(frozen=True, slots=True)
class CodePin:
    """The workdir version a daemon run hands every node: its archive's ``sha256`` and
    size (``bytes``), and its URI in each placement domain's store (``uris``, by domain)."""

    sha256: str
    bytes: int
    uris: Mapping[str, str]

    def spec(self, domain: str) -> dict[str, object]:
        """The job spec's ``"workdir"`` for a node of ``domain``: ``{"uri", "sha256", "bytes"}``."""
        return {"uri": self.uris[domain], "sha256": self.sha256, "bytes": self.bytes}


def code_key(sha256: str) -> str:
    """The archive's key under a checkpoint store's root."""
    return f"{CODE_PREFIX}/{sha256}.tar.gz"


def _excluded(rel: str, name: str, patterns: tuple[str, ...]) -> bool:
    return name in ALWAYS_EXCLUDED or any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(name, p)
                                          for p in patterns)


def _info(rel: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(rel)
    ti.type, ti.size, ti.linkname = kind, size, link
    ti.mode = 0o755 if kind == tarfile.DIRTYPE or mode & 0o111 else 0o644
    ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
    return ti


def _entries(root: Path, patterns: tuple[str, ...], max_bytes: int) -> list[tuple[str, Path, os.stat_result]]:
    """Every entry to archive, sorted by relative path, checked (module docstring)."""
    out: list[tuple[str, Path, os.stat_result]] = []
    total = 0
    for top, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        here = Path(top)
        kept_dirs = []
        for name in sorted(dirs + files):
            path = here / name
            rel = path.relative_to(root).as_posix()
            if _excluded(rel, name, patterns):
                continue
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                resolved = (here / target).resolve()
                if os.path.isabs(target) or not resolved.is_relative_to(root):
                    raise WorkdirError(f"job.workdir: {rel} is a symlink to {target}, outside {root} (copy the "
                                       "file in, or leave it out with job.workdir_exclude)")
            elif stat.S_ISDIR(st.st_mode):
                kept_dirs.append(name)
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > max_bytes:
                    raise WorkdirError(f"job.workdir: {root} holds over {max_bytes} bytes (job.workdir_max_bytes; "
                                       f"at {rel}): leave data and checkpoints out with job.workdir_exclude, or "
                                       "raise job.workdir_max_bytes")
            else:
                raise WorkdirError(f"job.workdir: {rel} is not a file, directory or symlink (a FIFO, socket or "
                                   "device cannot be shipped; leave it out with job.workdir_exclude)")
            out.append((rel, path, st))
        dirs[:] = [d for d in dirs if d in kept_dirs]
    return sorted(out, key=lambda e: e[0])


def pack(workdir: str | os.PathLike[str], dest_dir: str | os.PathLike[str], *, exclude: tuple[str, ...] = (),
         max_bytes: int) -> Packed:
    """Pack ``workdir`` into ``<dest_dir>/<sha256>.tar.gz`` (module docstring). Blocking
    (reads every file): call it in a thread from the event loop.

    Raises:
        WorkdirError: not a directory, a symlink leading outside it, a special file, over
            ``max_bytes`` (bytes, the files' total), or unreadable (one line each).
    """
    root = Path(workdir).resolve()
    if not root.is_dir():
        raise WorkdirError(f"job.workdir: {root} is not a directory (give the directory holding the job's code)")
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        entries = _entries(root, tuple(exclude), max_bytes)
        fd, tmp = tempfile.mkstemp(prefix=".pack-", suffix=".tar.gz", dir=dest)
        try:
            files = content = 0
            with os.fdopen(fd, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
                    tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for rel, path, st in entries:
                    if stat.S_ISLNK(st.st_mode):
                        tar.addfile(_info(rel, tarfile.SYMTYPE, 0o777, link=os.readlink(path)))
                    elif stat.S_ISDIR(st.st_mode):
                        tar.addfile(_info(rel, tarfile.DIRTYPE, st.st_mode))
                    else:
                        with open(path, "rb") as f:
                            tar.addfile(_info(rel, tarfile.REGTYPE, st.st_mode, st.st_size), f)
                        files, content = files + 1, content + st.st_size
            with open(tmp, "rb") as f:
                sha = hashlib.file_digest(f, "sha256").hexdigest()
            final = dest / f"{sha}.tar.gz"
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise WorkdirError(f"job.workdir: cannot read {getattr(exc, 'filename', None) or root} "
                           f"({exc.strerror or exc}); make it readable or leave it out with job.workdir_exclude") \
            from None
    return Packed(final, sha, final.stat().st_size, files, content)


def publish(config: Config, packed: Packed) -> CodePin:
    """Upload ``packed`` to each placement domain's checkpoint store (once per store URI;
    skipped where ``code/<sha256>.tar.gz`` is there already with its size). Blocking
    (store I/O): call it in a thread.

    Raises:
        WorkdirError: a store cannot be reached or written (one line naming the URI).
    """
    from trainer.checkpoint import open_store  # boto3 and oss2 load here, not for spotvisord check-config
    from trainer.storage import CheckpointError

    key = code_key(packed.sha256)
    uris: dict[str, str] = {}
    done: set[str] = set()
    for d in config.domains_resolved():
        root = config.checkpoint_uri(d.name).rstrip("/")
        uris[d.name] = f"{root}/{key}"
        if root in done:
            continue
        try:
            store = open_store(root, s3_endpoint_url=d.s3_endpoint_url, oss_endpoint=d.oss_endpoint)
            if store.list(key).get(key) != packed.bytes:
                store.put_file(key, packed.path)
        except (CheckpointError, ValueError) as exc:
            raise WorkdirError(f"job.workdir: cannot upload it to {root}/{key} ({exc}); check the store and the "
                               "control node's credentials for it") from None
        done.add(root)
    return CodePin(packed.sha256, packed.bytes, uris)
