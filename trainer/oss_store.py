"""Alibaba Cloud OSS as a checkpoint store (``oss://bucket/prefix``), through the ``oss2`` SDK.

Split from :mod:`trainer.storage` so that only jobs that use OSS import oss2.
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path

import oss2
import requests

from trainer.storage import (
    _MIB,
    CheckpointStore,
    ObjectNotFoundError,
    StorageError,
    _fsync_dir,
    check_key,
)

__all__ = ["OssStore"]

# Public OSS endpoints name their region: oss-<region>[-internal].aliyuncs.com
# (https://www.alibabacloud.com/help/en/oss/user-guide/regions-and-endpoints).
_OSS_REGION_RE = re.compile(r"(?:^|\.)oss-([a-z0-9-]+?)(?:-internal)?\.aliyuncs\.com$")
_OSS_GLOBAL_ENDPOINTS = ("accelerate", "accelerate-overseas", "rg-china-mainland")


def _oss_region_of(endpoint: str) -> str | None:
    """The region ID an OSS endpoint names (``https://oss-cn-hangzhou.aliyuncs.com`` ->
    ``cn-hangzhou``); None for an endpoint that names none (acceleration, an IP, a proxy)."""
    host = urllib.parse.urlparse(endpoint if "://" in endpoint else f"https://{endpoint}").hostname or ""
    m = _OSS_REGION_RE.search(host)
    if m is None or m.group(1) in _OSS_GLOBAL_ENDPOINTS:
        return None
    return m.group(1)


class OssStore(CheckpointStore):
    """An Alibaba Cloud OSS bucket and key prefix, through the ``oss2`` SDK.

    Like S3, OSS has no rename; a PutObject, or a CompleteMultipartUpload, makes
    the whole object visible at once and an upload that never completes stays
    invisible, which is all the commit protocol needs.

    - ``put_bytes`` is one PutObject (OSS takes up to 5 GiB in one PUT).
    - ``put_file`` is ``oss2.resumable_upload``: files of at least
      ``multipart_threshold`` bytes go up as a multipart upload
      (InitiateMultipartUpload, ``num_threads`` parallel UploadPart of
      ``part_size`` bytes, CompleteMultipartUpload), smaller ones in one PutObject.
      The upload id and the parts done are recorded under ``checkpoint_dir``, so a
      retry of the same file to the same key after a failure uploads only the
      missing parts. An upload abandoned for good (the node died) keeps its parts
      on OSS, billed, until a bucket lifecycle rule aborts it: configure one
      ("AbortMultipartUpload" after a day or so).
    - ``get_file`` is ``oss2.resumable_download`` into a temporary file next to
      the target, then an ``os.replace``: objects of at least
      ``multipart_threshold`` bytes come down as ``num_threads`` parallel ranged
      GETs, resumable the same way.
    - ``list`` pages through ListObjectsV2 (``oss2.ObjectIteratorV2``);
      ``delete`` is DeleteMultipleObjects, 1000 keys a request.

    Every transfer is checked end to end with OSS's CRC-64 (``x-oss-hash-crc64ecma``).
    Requests are signed with signature V4, which needs the bucket's region.

    API reference: https://www.alibabacloud.com/help/en/oss/developer-reference/
    ``putobject``, ``getobject``, ``headobject``, ``listobjectsv2``,
    ``deletemultipleobjects``, ``initiatemultipartupload``, ``uploadpart``,
    ``completemultipartupload``, ``listparts``; signature V4:
    https://www.alibabacloud.com/help/en/oss/developer-reference/recommend-to-use-signature-version-4

    Args:
        uri: ``oss://bucket`` or ``oss://bucket/prefix``.
        endpoint: e.g. ``https://oss-cn-hangzhou.aliyuncs.com`` (``-internal`` inside
            the region's VPC); ``https://`` is assumed when no scheme is given.
        region: region ID, e.g. ``cn-hangzhou``. None: taken from a public
            ``oss-<region>`` endpoint, else from ``$SPOTVISOR_OSS_REGION``.
        auth: an ``oss2`` auth object. None: signature V4 with the credentials in
            ``$OSS_ACCESS_KEY_ID`` / ``$OSS_ACCESS_KEY_SECRET`` (and
            ``$OSS_SESSION_TOKEN`` for STS), read at each request.
        multipart_threshold: bytes; files (and objects, for ``get_file``) of at
            least this size move in parts.
        part_size: bytes per part, >= 100 KiB (OSS's minimum for all parts but the
            last); oss2 doubles it if a file would need more than 10,000 parts.
        num_threads: parallel part transfers per file.
        checkpoint_dir: local directory for the resume records (oss2's
            ``.py-oss-upload`` / ``.py-oss-download`` go under it); None: the home
            directory, oss2's default. Created at the first ``put_file`` / ``get_file``.
        timeout_s: seconds to connect, and to wait for each read, per request.
        list_page_size: keys per ListObjectsV2 page (1..1000).

    Raises:
        ValueError: at construction, for a URI without a valid bucket name, an
            endpoint oss2 refuses, no region where signature V4 needs one, or bad sizes.
    """

    MIN_PART_SIZE = 100 * 1024

    def __init__(
        self,
        uri: str,
        *,
        endpoint: str,
        region: str | None = None,
        auth: object | None = None,
        multipart_threshold: int = 64 * _MIB,
        part_size: int = 64 * _MIB,
        num_threads: int = 4,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 60.0,
        list_page_size: int = 1000,
    ) -> None:
        parsed = urllib.parse.urlparse(uri)
        if parsed.scheme != "oss" or not parsed.netloc:
            raise ValueError(f"OSS URI {uri!r} must look like oss://bucket/prefix")
        if multipart_threshold < 1 or part_size < self.MIN_PART_SIZE or num_threads < 1:
            raise ValueError(
                f"multipart_threshold ({multipart_threshold}) and num_threads ({num_threads}) must be >= 1, "
                f"part_size ({part_size}) >= {self.MIN_PART_SIZE}"
            )
        if not 1 <= list_page_size <= 1000:
            raise ValueError(f"list_page_size must be in 1..1000, got {list_page_size}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.uri = f"oss://{self.bucket}/{self.prefix}" if self.prefix else f"oss://{self.bucket}"
        self.endpoint = endpoint if "://" in endpoint else f"https://{endpoint}"
        self.region = region or _oss_region_of(self.endpoint) or os.environ.get("SPOTVISOR_OSS_REGION") or None
        if auth is None:
            if self.region is None:
                raise ValueError(
                    f"OSS endpoint {self.endpoint!r} does not name a region: pass region= "
                    "or set $SPOTVISOR_OSS_REGION (e.g. cn-hangzhou)"
                )
            auth = oss2.ProviderAuthV4(oss2.credentials.EnvironmentVariableCredentialsProvider())
        try:
            self._bucket = oss2.Bucket(auth, self.endpoint, self.bucket, connect_timeout=timeout_s,
                                       region=self.region)
        except oss2.exceptions.ClientError as exc:
            raise ValueError(f"OSS store {uri!r} at {self.endpoint!r}: {_oss_describe(exc)}") from exc
        self._threshold = multipart_threshold
        self._part_size = part_size
        self._threads = num_threads
        self._record_root = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self._page_size = list_page_size

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextlib.contextmanager
    def _errors(self, doing: str, *, missing: str | None = None) -> Iterator[None]:
        """Translate oss2/requests/OS errors into StorageError (``missing``: the
        ``uri/key`` whose absence is an ObjectNotFoundError)."""
        try:
            yield
        except oss2.exceptions.NotFound as exc:
            # NoSuchKey, or a HEAD's bare 404 (no body to name the code); not NoSuchBucket.
            if missing is not None and exc.code in ("NoSuchKey", ""):
                raise ObjectNotFoundError(f"{missing} does not exist") from exc
            raise StorageError(f"{doing}: {_oss_describe(exc)}") from exc
        except (oss2.exceptions.OssError, requests.RequestException, OSError) as exc:
            raise StorageError(f"{doing}: {_oss_describe(exc)}") from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        obj = self._key(key)
        with self._errors(f"uploading {self.uri}/{key}"):
            self._bucket.put_object(obj, data)

    def get_bytes(self, key: str) -> bytes:
        obj = self._key(key)
        with self._errors(f"downloading {self.uri}/{key}", missing=f"{self.uri}/{key}"):
            result = self._bucket.get_object(obj)
            data = result.read()
            oss2.utils.check_crc("get", result.client_crc, result.server_crc, result.request_id)
        return data

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        obj = self._key(key)
        with self._errors(f"uploading {path} to {self.uri}/{key}"):
            store = oss2.ResumableStore(root=self._record_root) if self._record_root else None
            oss2.resumable_upload(self._bucket, obj, os.fspath(path), store=store,
                                  multipart_threshold=self._threshold, part_size=self._part_size,
                                  num_threads=self._threads)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        obj = self._key(key)
        target = Path(path)
        # A fixed name, so a retry finds oss2's resume record; ".tmp-" so write_dir skips it.
        tmp = target.with_name(f".{target.name}.tmp-oss")
        done = False
        with self._errors(f"downloading {self.uri}/{key} to {path}", missing=f"{self.uri}/{key}"):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                store = oss2.ResumableDownloadStore(root=self._record_root) if self._record_root else None
                oss2.resumable_download(self._bucket, obj, os.fspath(tmp), store=store,
                                        multiget_threshold=self._threshold, part_size=self._part_size,
                                        num_threads=self._threads)
                os.replace(tmp, target)
                done = True
            finally:
                if not done:
                    tmp.unlink(missing_ok=True)
        _fsync_dir(target.parent)

    def list(self, prefix: str = "") -> dict[str, int]:
        root = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, int] = {}
        with self._errors(f"listing {self.uri}/{prefix}"):
            for info in oss2.ObjectIteratorV2(self._bucket, prefix=root + prefix, max_keys=self._page_size):
                rel = info.key[len(root):]
                if rel:  # skip the console's "folder" placeholder named exactly like the root
                    out[rel] = int(info.size)
        return out

    def delete(self, keys: Iterable[str]) -> None:
        names = list(dict.fromkeys(keys))
        objs = [self._key(k) for k in names]
        for i in range(0, len(objs), 1000):  # DeleteMultipleObjects takes at most 1000 keys
            with self._errors(f"deleting {len(objs[i : i + 1000])} objects under {self.uri} (first {names[i]!r})"):
                self._bucket.batch_delete_objects(objs[i : i + 1000])


def _oss_describe(exc: BaseException) -> str:
    """One line about an oss2 / requests / OS error: status, OSS code, message, request id."""
    if isinstance(exc, oss2.exceptions.RequestError):
        text = f"request failed: {exc.exception}"
    elif isinstance(exc, oss2.exceptions.ServerError):
        text = f"HTTP {exc.status} {exc.code or '(no error code)'}"
        if exc.message:
            text += f": {exc.message}"
        if exc.request_id:
            text += f" (request id {exc.request_id})"
    elif isinstance(exc, oss2.exceptions.OssError):  # ClientError, InconsistentError: body says it
        text = str(exc.body)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())
