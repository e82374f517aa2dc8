"""Checkpoint stores: where the commit protocol's objects live (file://, s3://, oss://).

A :class:`CheckpointStore` is a flat key -> bytes map under a root URI; keys are
relative '/'-separated paths. The protocol (:mod:`trainer.checkpoint`) needs only
four things of it: a PUT that readers see whole or not at all, a GET, a prefix
listing with sizes, and a delete. Large shards go through :meth:`CheckpointStore.put_file`
and :meth:`CheckpointStore.get_file`, which each backend streams (multipart, parallel)
rather than holding the object in memory.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import tempfile
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError
import structlog

__all__ = [
    "CheckpointError",
    "StorageError",
    "ObjectNotFoundError",
    "CheckpointStore",
    "FileStore",
    "S3Store",
    "check_key",
]

_MIB = 1024 * 1024

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- errors


class CheckpointError(Exception):
    """Base of every error raised by this module."""


class StorageError(CheckpointError):
    """The storage backend failed (I/O, network, auth); ``__cause__`` holds the SDK/OS error."""


class ObjectNotFoundError(StorageError):
    """A key that was read does not exist in the store."""


# --------------------------------------------------------------------------- stores


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key:
        raise ValueError(f"bad store key {key!r}: must be a relative '/'-separated path")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"bad store key {key!r}: empty, '.' or '..' component")


def _atomic_local_write(path: Path, fill) -> None:
    """Write ``path`` through a temporary file in its directory (fsync + replace); ``fill(f)`` writes."""
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        _fsync_dir(path.parent)
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass


class CheckpointStore(ABC):
    """A flat key -> bytes store under a root URI; keys are relative '/'-separated paths.

    All methods block until the backend answers. Constructors do no network I/O.
    """

    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key``, replacing what was there; readers see old or new, never a mix.

        Raises:
            ValueError: malformed key.
            StorageError: the backend failed.
        """

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The bytes at ``key``.

        Raises:
            ObjectNotFoundError: no such key (a StorageError).
            StorageError: the backend failed.
        """

    @abstractmethod
    def list(self, prefix: str = "") -> dict[str, int]:
        """Every key starting with ``prefix`` (plain string prefix) -> its size in bytes.

        Raises:
            StorageError: the backend failed.
        """

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; keys already absent are ignored.

        Raises:
            StorageError: the backend failed for at least one key.
        """

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Store the local file ``path`` at ``key`` (same atomicity as :meth:`put_bytes`).

        Backends stream it (S3: multipart in parallel; OSS: resumable multipart);
        this default reads the file into memory.

        Raises:
            ValueError: malformed key.
            StorageError: the backend failed, or ``path`` cannot be read.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise StorageError(f"reading {path} for {self.uri}/{key}: {exc}") from exc
        self.put_bytes(key, data)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download ``key`` to the local file ``path`` (parents created; written via a temporary file).

        Raises:
            ObjectNotFoundError: no such key.
            StorageError: the backend failed, or ``path`` cannot be written.
        """
        data = self.get_bytes(key)
        try:
            _atomic_local_write(Path(path), lambda f: f.write(data))
        except OSError as exc:
            raise StorageError(f"writing {path} from {self.uri}/{key}: {exc}") from exc

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class FileStore(CheckpointStore):
    """A directory on a local or shared (NFS, Lustre) file system.

    ``put_bytes`` writes a temporary file in the target directory, fsyncs it,
    ``os.replace``-s it over the key and fsyncs the directory, so a crash leaves
    the old content or the new, never a torn file under the key's name.

    Args:
        root: ``file:///abs/path`` or an absolute path.

    Raises:
        ValueError: at construction, for a relative path or a ``file://`` URI with a host.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if isinstance(root, str) and root.startswith("file:"):
            parsed = urllib.parse.urlparse(root)
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file URI {root!r} has host {parsed.netloc!r}: use file:///abs/path")
            path = urllib.parse.unquote(parsed.path)
        else:
            path = os.fspath(root)
        if not os.path.isabs(path):
            raise ValueError(f"checkpoint directory {path!r} must be absolute (file:///abs/path)")
        self.root = Path(path)
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root.joinpath(*key.split("/"))

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            _atomic_local_write(self._path(key), lambda f: f.write(data))
        except OSError as exc:
            raise StorageError(f"writing {self.uri}/{key}: {exc}") from exc

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        try:
            with open(path, "rb") as src:
                _atomic_local_write(self._path(key), lambda f: shutil.copyfileobj(src, f, 8 * _MIB))
        except OSError as exc:
            raise StorageError(f"copying {path} to {self.uri}/{key}: {exc}") from exc

    def _open(self, key: str) -> io.BufferedReader:
        """The object ``key`` opened for reading, if it is a regular file (or a symlink to
        one). Opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read, so a
        FIFO, a socket or a device under a key's name never blocks or is read as data.

        Raises:
            ObjectNotFoundError: nothing there, a symlink that does not resolve (a loop,
                a dangling target), or not a regular file.
            OSError: any other failure to open it.
        """
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ObjectNotFoundError(f"{self.uri}/{key} is a symlink that does not resolve") from exc
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ObjectNotFoundError(f"{self.uri}/{key} is not a regular file")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        try:
            with self._open(key) as src:
                _atomic_local_write(Path(path), lambda f: shutil.copyfileobj(src, f, 8 * _MIB))
        except OSError as exc:
            raise StorageError(f"copying {self.uri}/{key} to {path}: {exc}") from exc

    def get_bytes(self, key: str) -> bytes:
        try:
            with self._open(key) as src:
                return src.read()
        except OSError as exc:
            raise StorageError(f"reading {self.uri}/{key}: {exc}") from exc

    def list(self, prefix: str = "") -> dict[str, int]:
        # Walk only the deepest directory the prefix names, then filter by string prefix.
        base_parts = prefix.split("/")[:-1]
        if any(part in ("", ".", "..") for part in base_parts):
            raise ValueError(f"bad list prefix {prefix!r}: empty, '.' or '..' component")
        start = self.root.joinpath(*base_parts) if base_parts else self.root
        out: dict[str, int] = {}
        try:
            if not start.is_dir():
                if start == self.root:  # an absent root is an empty store; a file there is not
                    if start.exists():
                        raise NotADirectoryError(f"{start} is not a directory")
                return out
            # onerror re-raises: an unreadable directory (permissions, a dropped NFS mount)
            # must fail the listing, never look like "no checkpoint" and restart from step 0.
            for dirpath, _dirnames, filenames in os.walk(start, onerror=_raise):
                rel_dir = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    key = name if rel_dir == "." else f"{rel_dir}/{name}"
                    if not key.startswith(prefix):
                        continue
                    size = self._regular_size(os.path.join(dirpath, name), key)
                    if size is not None:
                        out[key] = size
        except OSError as exc:
            raise StorageError(f"listing {self.uri}/{prefix}: {exc}") from exc
        return out

    def _regular_size(self, path: str, key: str) -> int | None:
        """The size of the regular file at ``path`` (a symlink is followed), or None: gone
        since the walk, or skipped with one ``checkpoint_store_entry_skipped`` log line: a
        symlink that does not resolve (a loop, a dangling target) or not a regular file (a
        FIFO, a socket, a device), which no checkpoint of ours ever is. Raises OSError for
        any other failure (an unreadable directory must never look like "no checkpoint")."""
        try:
            st = os.stat(path)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not os.path.islink(path):
                return None  # deleted while we walked
            if not os.path.islink(path):
                raise
            log.warning("checkpoint_store_entry_skipped", uri=self.uri, key=key,
                        reason=f"a symlink that does not resolve ({exc.strerror})")
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("checkpoint_store_entry_skipped", uri=self.uri, key=key,
                        reason=f"not a regular file (mode {stat.filemode(st.st_mode)})")
            return None
        return st.st_size

    def delete(self, keys: Iterable[str]) -> None:
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"deleting {self.uri}/{key}: {exc}") from exc
            parents.add(path.parent)
        # Remove directories left empty, deepest first, never the root itself.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:  # not empty (or already gone): stop climbing
                    break
                parent = parent.parent


def _raise(exc: OSError) -> None:
    raise exc


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms/file systems cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class S3Store(CheckpointStore):
    """An S3 (or S3-compatible: MinIO, OSS in S3 mode) bucket and key prefix.

    S3 has no atomic rename; a single PUT (or a completed multipart upload) is
    atomic, which is all the protocol needs: shards first, manifest object last.
    Objects above ``multipart_threshold`` bytes go up in parts of
    ``multipart_chunksize`` bytes through boto3's ``upload_fileobj``.

    Args:
        uri: ``s3://bucket`` or ``s3://bucket/prefix``.
        endpoint_url: e.g. ``http://127.0.0.1:9000``; None for AWS.
        client: a ready boto3 S3 client (``endpoint_url`` is then ignored).
        multipart_threshold: bytes; S3 requires parts of >= 5 MiB except the last.
        multipart_chunksize: bytes per part.
        max_concurrency: parallel part transfers per object.
        list_page_size: keys per ListObjectsV2 page (max 1000).

    Credentials and region come from boto3's usual chain (env, profile, instance role).

    Raises:
        ValueError: at construction, for a URI without a bucket or bad sizes.
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        client: object | None = None,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 64 * _MIB,
        max_concurrency: int = 10,
        list_page_size: int = 1000,
    ) -> None:
        parsed = urllib.parse.urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"S3 URI {uri!r} must look like s3://bucket/prefix")
        if multipart_threshold < 1 or multipart_chunksize < 1 or max_concurrency < 1:
            raise ValueError(
                f"multipart_threshold ({multipart_threshold}), multipart_chunksize "
                f"({multipart_chunksize}) and max_concurrency ({max_concurrency}) must be >= 1"
            )
        if not 1 <= list_page_size <= 1000:
            raise ValueError(f"list_page_size must be in 1..1000, got {list_page_size}")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.endpoint_url = endpoint_url
        self._client = client if client is not None else boto3.client("s3", endpoint_url=endpoint_url)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )
        self._page_size = list_page_size

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_bytes(self, key: str, data: bytes) -> None:
        obj = self._key(key)
        try:
            self._client.upload_fileobj(io.BytesIO(data), self.bucket, obj, Config=self._transfer)
        except (BotoCoreError, ClientError, Boto3Error) as exc:
            raise StorageError(f"uploading {self.uri}/{key}: {exc}") from exc

    def get_bytes(self, key: str) -> bytes:
        obj = self._key(key)
        buf = io.BytesIO()
        try:
            self._client.download_fileobj(self.bucket, obj, buf, Config=self._transfer)
        except ClientError as exc:
            if _client_error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from exc
            raise StorageError(f"downloading {self.uri}/{key}: {exc}") from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise StorageError(f"downloading {self.uri}/{key}: {exc}") from exc
        return buf.getvalue()

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        obj = self._key(key)
        try:
            self._client.upload_file(os.fspath(path), self.bucket, obj, Config=self._transfer)
        except (BotoCoreError, ClientError, Boto3Error, OSError) as exc:
            raise StorageError(f"uploading {path} to {self.uri}/{key}: {exc}") from exc

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        obj = self._key(key)
        target = Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # boto3 downloads to a temporary name and renames it into place.
            self._client.download_file(self.bucket, obj, os.fspath(target), Config=self._transfer)
        except ClientError as exc:
            if _client_error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from exc
            raise StorageError(f"downloading {self.uri}/{key}: {exc}") from exc
        except (BotoCoreError, Boto3Error, OSError) as exc:
            raise StorageError(f"downloading {self.uri}/{key} to {path}: {exc}") from exc

    def list(self, prefix: str = "") -> dict[str, int]:
        root = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, int] = {}
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root + prefix, PaginationConfig={"PageSize": self._page_size}
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    out[item["Key"][len(root):]] = int(item["Size"])
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"listing {self.uri}/{prefix}: {exc}") from exc
        return out

    def delete(self, keys: Iterable[str]) -> None:
        objs = [self._key(k) for k in keys]
        for i in range(0, len(objs), 1000):  # DeleteObjects takes at most 1000 keys
            batch = objs[i : i + 1000]
            try:
                resp = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except (BotoCoreError, ClientError) as exc:
                raise StorageError(f"deleting {len(batch)} objects under {self.uri}: {exc}") from exc
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"deleting under {self.uri}: {len(errors)} of {len(batch)} failed, "
                    f"first {first.get('Key')!r}: {first.get('Code')} {first.get('Message')}"
                )


def _client_error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
