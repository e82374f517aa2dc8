"""Alibaba Cloud OSS as a checkpoint store (``oss://bucket/prefix``), through the ``oss2`` SDK.

Split from :mod:`trainer.storage` so that only jobs that use OSS import oss2.
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import oss2
import requests
import structlog
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from trainer.contract import OSS_RAM_ROLE_ENV
from trainer.storage import (
    _MIB,
    CheckpointStore,
    ObjectNotFoundError,
    StorageError,
    _fsync_dir,
    check_key,
)

__all__ = ["OssStore"]

log = structlog.get_logger("spotvisor.storage")
T = TypeVar("T")

# Public OSS endpoints name their region: oss-<region>[-internal].aliyuncs.com
# (https://www.alibabacloud.com/help/en/oss/user-guide/regions-and-endpoints).
_OSS_REGION_RE = re.compile(r"(?:^|\.)oss-([a-z0-9-]+?)(?:-internal)?\.aliyuncs\.com$")
_OSS_GLOBAL_ENDPOINTS = ("accelerate", "accelerate-overseas", "rg-china-mainland")


#: the ECS instance metadata service (Alibaba Cloud, "Instance metadata": an instance RAM
#: role's temporary credentials at ``/latest/meta-data/ram/security-credentials/<role>``,
#: https://www.alibabacloud.com/help/en/ecs/user-guide/attach-an-instance-ram-role-to-an-ecs-instance)
METADATA_BASE_URL = "http://100.100.100.200"


def ram_role_credentials_url(role: str, base_url: str = METADATA_BASE_URL) -> str:
    """Where an ECS instance reads ``role``'s temporary credentials (JSON with
    ``AccessKeyId``, ``AccessKeySecret``, ``SecurityToken``, ``Expiration``).
    Raises ValueError for a name that is not a RAM role name."""
    if not re.fullmatch(r"[A-Za-z0-9.-]{1,64}", role):
        raise ValueError(f"{role!r} is not a RAM role name (letters, digits, '.', '-'; at most 64)")
    return f"{base_url.rstrip('/')}/latest/meta-data/ram/security-credentials/{role}"


def _default_credentials() -> "oss2.credentials.CredentialsProvider":
    """Keys from the environment, else the instance RAM role named in ``$SPOTVISOR_OSS_RAM_ROLE``
    (a GPU node launched with a domain's ``launch.ram_role`` has no keys of its own)."""
    role = os.environ.get(OSS_RAM_ROLE_ENV, "").strip()
    if os.environ.get("OSS_ACCESS_KEY_ID") or not role:
        return oss2.credentials.EnvironmentVariableCredentialsProvider()
    base = os.environ.get("SPOTVISOR_ALIYUN_METADATA_URL", METADATA_BASE_URL)  # tests: a local stand-in
    return oss2.credentials.EcsRamRoleCredentialsProvider(ram_role_credentials_url(role, base))


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

    An operation that meets a server error (HTTP 5xx, or 429) is tried again, up to
    ``max_attempts`` in all with exponential backoff and jitter, as botocore's
    ``standard`` retry mode does for S3: a 500 or 503 during a notice's flush would
    otherwise fail the commit and lose every step since the last one. oss2 itself
    retries only failed connections (``oss2.defaults.request_retries``). A retried
    ``put_file`` / ``get_file`` resumes from its record: only the missing parts move.

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
            ``$OSS_SESSION_TOKEN`` for STS), read at each request; without
            ``$OSS_ACCESS_KEY_ID`` and with ``$SPOTVISOR_OSS_RAM_ROLE``, the instance RAM
            role's temporary credentials from the ECS metadata service
            (:func:`ram_role_credentials_url`; oss2 refreshes them before they expire).
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
        max_attempts: tries per operation on a server error (>= 1; 3 as botocore's
            ``standard`` mode).

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
        max_attempts: int = 3,
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
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
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
            auth = oss2.ProviderAuthV4(_default_credentials())
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
        self._max_attempts = max_attempts

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _retrying(self, doing: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again on a server error (:func:`_transient`) up to
        ``max_attempts`` in all; the last error propagates."""

        def retried(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.warning("oss_request_retried", doing=doing, attempt=state.attempt_number,
                        error=_oss_describe(exc) if exc is not None else None)

        retrying = Retrying(retry=retry_if_exception(_transient), stop=stop_after_attempt(self._max_attempts),
                            wait=wait_exponential_jitter(multiplier=0.2, max=2.0, jitter=0.2),
                            before_sleep=retried, reraise=True)
        return retrying(fn)

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
        doing = f"uploading {self.uri}/{key}"
        with self._errors(doing):
            self._retrying(doing, lambda: self._bucket.put_object(obj, data))

    def get_bytes(self, key: str) -> bytes:
        obj = self._key(key)
        doing = f"downloading {self.uri}/{key}"

        def get() -> bytes:
            result = self._bucket.get_object(obj)
            data = result.read()
            oss2.utils.check_crc("get", result.client_crc, result.server_crc, result.request_id)
            return data

        with self._errors(doing, missing=f"{self.uri}/{key}"):
            return self._retrying(doing, get)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        obj = self._key(key)
        doing = f"uploading {path} to {self.uri}/{key}"
        with self._errors(doing):
            store = oss2.ResumableStore(root=self._record_root) if self._record_root else None
            self._retrying(doing, lambda: oss2.resumable_upload(
                self._bucket, obj, os.fspath(path), store=store, multipart_threshold=self._threshold,
                part_size=self._part_size, num_threads=self._threads))

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        obj = self._key(key)
        target = Path(path)
        # A fixed name, so a retry finds oss2's resume record; ".tmp-" so write_dir skips it.
        tmp = target.with_name(f".{target.name}.tmp-oss")
        done = False
        doing = f"downloading {self.uri}/{key} to {path}"
        with self._errors(doing, missing=f"{self.uri}/{key}"):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                store = oss2.ResumableDownloadStore(root=self._record_root) if self._record_root else None
                self._retrying(doing, lambda: oss2.resumable_download(
                    self._bucket, obj, os.fspath(tmp), store=store, multiget_threshold=self._threshold,
                    part_size=self._part_size, num_threads=self._threads))
                os.replace(tmp, target)
                done = True
            finally:
                if not done:
                    tmp.unlink(missing_ok=True)
        _fsync_dir(target.parent)

    def list(self, prefix: str = "") -> dict[str, int]:
        root = f"{self.prefix}/" if self.prefix else ""
        doing = f"listing {self.uri}/{prefix}"

        def page_through() -> dict[str, int]:  # a retry lists from the start
            out: dict[str, int] = {}
            for info in oss2.ObjectIteratorV2(self._bucket, prefix=root + prefix, max_keys=self._page_size):
                rel = info.key[len(root):]
                if rel:  # skip the console's "folder" placeholder named exactly like the root
                    out[rel] = int(info.size)
            return out

        with self._errors(doing):
            out = self._retrying(doing, page_through)
        return out

    def delete(self, keys: Iterable[str]) -> None:
        names = list(dict.fromkeys(keys))
        objs = [self._key(k) for k in names]
        for i in range(0, len(objs), 1000):  # DeleteMultipleObjects takes at most 1000 keys
            doing = f"deleting {len(objs[i : i + 1000])} objects under {self.uri} (first {names[i]!r})"
            with self._errors(doing):
                self._retrying(doing, lambda: self._bucket.batch_delete_objects(objs[i : i + 1000]))


def _transient(exc: BaseException) -> bool:
    """A server error worth another try: HTTP 5xx (InternalError, ServiceUnavailable) or
    429. Not a 4xx (the request is wrong), not a failed connection (oss2 retried it)."""
    return isinstance(exc, oss2.exceptions.ServerError) and (exc.status >= 500 or exc.status == 429)


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
