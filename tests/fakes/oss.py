"""A local fake of Alibaba Cloud OSS, for :class:`trainer.storage.OssStore`'s tests.
It speaks to the real ``oss2`` SDK, on 127.0.0.1, in its own event-loop thread, so
blocking ``oss2`` calls from a test (or its worker threads) reach it.

It follows the documents (API reference pages under
https://www.alibabacloud.com/help/en/oss/developer-reference/, named below):

- Addressing: path style, ``/<bucket>/<key>`` (``oss2`` uses it for an IP endpoint,
  ``oss2.api._determine_endpoint_type``); the key is percent-decoded from the raw path.
- Signature V4 (``recommend-to-use-signature-version-4``): ``Authorization:
  OSS4-HMAC-SHA256 Credential=<ak>/<yyyymmdd>/<region>/oss/aliyun_v4_request,
  [AdditionalHeaders=<h1;h2>,] Signature=<hex>`` with ``x-oss-date``
  (``yyyymmddTHHMMSSZ``) and ``x-oss-content-sha256``. CanonicalRequest = method,
  URI-encoded ``/<bucket>/<key>`` ('/' kept), the sorted encoded query
  (``k=v``, or ``k`` for an empty value), the ``name:value`` lines of every
  ``x-oss-*``, ``content-type``, ``content-md5`` and additional header (lower-case,
  sorted), the additional header names, and the payload hash, joined by newlines.
  StringToSign = ``OSS4-HMAC-SHA256``, the date-time, the scope and
  hex(sha256(CanonicalRequest)). The signing key is HMAC-SHA256 chained over
  ``"aliyun_v4" + secret``, date, region, ``oss``, ``aliyun_v4_request``. A bad
  signature is 403 ``SignatureDoesNotMatch`` (the body carries ``StringToSign`` and
  ``CanonicalRequest``, as OSS's does), an unknown key id 403 ``InvalidAccessKeyId``,
  a clock more than 15 minutes off 403 ``RequestTimeTooSkewed``, no Authorization
  403 ``AccessDenied`` (buckets are private).
- Errors (``https://www.alibabacloud.com/help/en/oss/user-guide/overview-14``): XML
  ``<Error><Code/><Message/><RequestId/><HostId/>...</Error>``, with
  ``x-oss-request-id`` on every answer.
- PutObject (``putobject``): the object appears whole once the body is in;
  ``ETag`` = quoted upper-case MD5; ``Content-MD5`` checked if sent (400 ``InvalidDigest``).
  Every write answers ``x-oss-hash-crc64ecma`` (CRC-64/ECMA-182, which ``oss2`` checks).
- GetObject / HeadObject (``getobject``, ``headobject``): ``Range: bytes=a-b`` answers 206
  with ``Content-Range``; an unsatisfiable range answers the whole object (200), as
  documented; ``If-Match`` / ``If-Unmodified-Since`` failing is 412 ``PreconditionFailed``.
  A missing key is 404 ``NoSuchKey``, a missing bucket 404 ``NoSuchBucket``.
- ListObjectsV2 (``listobjectsv2``): ``list-type=2``, ``prefix``, ``delimiter``,
  ``start-after``, ``continuation-token``, ``max-keys`` (1..1000, default 100),
  ``encoding-type=url`` (keys and tokens percent-encoded); ``ListBucketResult`` with
  ``Contents`` (Key, LastModified, ETag, Type, Size, StorageClass), ``KeyCount``,
  ``IsTruncated``, ``NextContinuationToken``.
- DeleteMultipleObjects (``deletemultipleobjects``): ``POST /?delete``, ``Content-MD5``
  required and checked (400 ``InvalidDigest``), at most 1000 keys, absent keys are
  reported ``Deleted`` too; ``Quiet`` true answers no ``Deleted`` entries.
- Multipart (``initiatemultipartupload``, ``uploadpart``, ``completemultipartupload``,
  ``abortmultipartupload``, ``listparts``): an upload's parts are invisible to
  GET/HEAD/LIST until CompleteMultipartUpload; part numbers 1..10000; an unknown upload
  id is 404 ``NoSuchUpload``; Complete checks ascending order (400 ``InvalidPartOrder``),
  each part's ETag (400 ``InvalidPart``) and that every part but the last has at least
  100 KB (400 ``EntityTooSmall``).

UNCONFIRMED (the documents do not say; the fake picks the plausible behaviour): the
error of a malformed V4 Authorization header (400 ``InvalidArgument``); a HEAD error
carries its XML body base64-encoded in ``x-oss-err`` (what ``oss2`` expects:
``oss2.exceptions.make_exception`` and the comment in ``Bucket.object_exists``); the
ETag of a multipart object (MD5 of the parts' MD5s, ``-<n>``); continuation tokens
(opaque here); the error for more than 1000 keys in one delete (400 ``MalformedXML``);
the fine-grained ``EC`` codes (not sent). Only signature V4 is verified (V1 is 403).

Test hooks (not part of OSS): :meth:`FakeOss.create_bucket`, :meth:`FakeOss.fail_next`
(answer the next requests of an operation with an error), :meth:`FakeOss.hang_next`,
:meth:`FakeOss.wait_hanging` and :meth:`FakeOss.release` (hold a request before it takes
effect, then let it through or drop its connection: a node killed mid-upload),
:meth:`FakeOss.objects`, :meth:`FakeOss.uploads`, and :attr:`FakeOss.requests`.

Example::

    with FakeOss(access_key_id="ak", access_key_secret="sk", region="cn-hangzhou") as oss:
        oss.create_bucket("ckpt")
        bucket = oss2.Bucket(oss2.AuthV4("ak", "sk"), oss.endpoint, "ckpt", region="cn-hangzhou")
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import formatdate, parsedate_to_datetime
from urllib.parse import parse_qsl, quote, unquote
from xml.etree import ElementTree as ET

import crcmod
from aiohttp import web

from fakes.serving import LoopThread

__all__ = ["FakeOss", "Seen", "crc64ecma"]

crc64ecma = crcmod.mkCrcFun(0x142F0E1EBA9EA3693, initCrc=0, xorOut=0xFFFFFFFFFFFFFFFF, rev=True)
"""CRC-64/ECMA-182 as OSS computes it (``bytes -> int``)."""

_MIN_PART = 100 * 1024
_SKEW_S = 15 * 60


@dataclass
class _Blob:
    data: bytes
    etag: str  # quoted, as in the ETag header
    mtime: float
    kind: str = "Normal"  # x-oss-object-type: Normal | Multipart
    content_type: str = "application/octet-stream"

    @property
    def crc(self) -> int:
        return crc64ecma(self.data)


@dataclass
class _Upload:
    key: str
    content_type: str
    parts: dict[int, _Blob] = field(default_factory=dict)


@dataclass(frozen=True)
class Seen:
    """One request the fake answered: its OSS operation, bucket, key and HTTP status."""

    op: str
    bucket: str
    key: str
    status: int
    fault: str | None = None  # "fail" | "hang" | "dropped" | None


class _OssError(Exception):
    def __init__(self, code: str, message: str, status: int = 400, **extra: str) -> None:
        super().__init__(code)
        self.code, self.message, self.status, self.extra = code, message, status, extra


def _xml(root: ET.Element) -> bytes:
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8")


def _sub(parent: ET.Element, tag: str, text: object) -> ET.Element:
    node = ET.SubElement(parent, tag)
    node.text = str(text)
    return node


def _v4_encode(text: str, *, keep_slash: bool) -> str:
    return quote(text, safe="-_.~/" if keep_slash else "-_.~")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _md5_etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest().upper()}"'


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class FakeOss:
    """See the module docstring. ``start()`` (or ``with``) → :attr:`endpoint` → ``close()``.

    Args:
        access_key_id, access_key_secret: the one key pair that signs valid requests.
        region: the region signatures must be scoped to.
        clock: ``time.time``-like seconds, for ``x-oss-date`` skew and Last-Modified.
    """

    def __init__(self, *, access_key_id: str = "fake-ak", access_key_secret: str = "fake-sk",
                 region: str = "cn-hangzhou", clock=time.time) -> None:
        self.access_key_id, self.access_key_secret, self.region = access_key_id, access_key_secret, region
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, dict[str, _Blob]] = {}
        self._uploads: dict[str, dict[str, _Upload]] = {}  # bucket -> upload id -> upload
        self._faults: list[tuple[str | None, str, int]] = []  # (op or None, code, status)
        self._hangs: list[str | None] = []  # op or None
        self._held: list[Seen] = []
        self._held_cond = threading.Condition(self._lock)
        self._gate: list[asyncio.Future[bool]] = []  # held requests wait here; result: drop them?
        self._serving: LoopThread[web.AppRunner] = LoopThread("fake-oss", "FakeOss")
        self._url: str | None = None
        self.requests: list[Seen] = []
        """Every answered request, oldest first."""

    # -- test hooks -------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``; only after :meth:`start`."""
        if self._url is None:
            raise RuntimeError("FakeOss is not started; call start() first")
        return self._url

    def create_bucket(self, name: str) -> None:
        with self._lock:
            self._buckets.setdefault(name, {})
            self._uploads.setdefault(name, {})

    def objects(self, bucket: str) -> dict[str, bytes]:
        """The committed objects of ``bucket``: key -> bytes."""
        with self._lock:
            return {k: b.data for k, b in self._buckets[bucket].items()}

    def uploads(self, bucket: str) -> dict[str, tuple[str, list[int]]]:
        """Multipart uploads in progress: upload id -> (key, part numbers uploaded)."""
        with self._lock:
            return {uid: (u.key, sorted(u.parts)) for uid, u in self._uploads[bucket].items()}

    def ops(self, op: str) -> list[Seen]:
        """The answered requests of operation ``op`` (e.g. ``"UploadPart"``), oldest first."""
        with self._lock:
            return [s for s in self.requests if s.op == op]

    def fail_next(self, n: int = 1, status: int = 500, *, op: str | None = None, code: str | None = None) -> None:
        """Answer the next ``n`` signed requests (of operation ``op``; None: any) with an OSS
        error: ``code`` (default by status: 500 ``InternalError``, 503 ``ServiceUnavailable``)."""
        if n < 1 or not 400 <= status <= 599:
            raise ValueError(f"need n >= 1 and an error status, got n={n} status={status}")
        code = code or {503: "ServiceUnavailable", 403: "AccessDenied"}.get(status, "InternalError")
        with self._lock:
            self._faults.extend([(op, code, status)] * n)

    def hang_next(self, n: int = 1, *, op: str | None = None) -> None:
        """Hold the next ``n`` signed requests (of ``op``) before they take effect, until :meth:`release`."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        with self._lock:
            self._hangs.extend([op] * n)

    def wait_hanging(self, timeout_s: float = 10.0) -> Seen:
        """Block until a request is held by :meth:`hang_next`; returns it. Raises TimeoutError."""
        with self._held_cond:
            if not self._held_cond.wait_for(lambda: self._held, timeout=timeout_s):
                raise TimeoutError(f"no request held within {timeout_s} s")
            return self._held[0]

    def release(self, *, drop: bool = False) -> None:
        """Let held requests through (``drop``: close their connections unanswered instead)."""
        loop = self._serving.loop
        if loop is not None:
            loop.call_soon_threadsafe(self._open_gate, drop)

    def reset_faults(self) -> None:
        """Forget armed faults and hangs (held requests stay held until :meth:`release`)."""
        with self._lock:
            self._faults.clear()
            self._hangs.clear()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> str:
        """Serve on 127.0.0.1 (random port) in a background thread; returns :attr:`endpoint`."""
        self._serving.start(self._astart, self._astop)
        return self.endpoint

    def close(self) -> None:
        """Stop serving; held requests are dropped. Idempotent."""
        if self._serving.close():
            self._url = None

    def __enter__(self) -> FakeOss:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def _astart(self) -> web.AppRunner:
        app = web.Application(client_max_size=5 * 1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return runner

    async def _astop(self, runner: web.AppRunner) -> None:
        self._open_gate(True)
        await runner.cleanup()

    def _open_gate(self, drop: bool) -> None:
        waiters, self._gate = self._gate, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(drop)

    # -- every request ----------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rid = uuid.uuid4().hex[:24].upper()
        raw_path, _, raw_query = request.raw_path.partition("?")
        bucket, _, raw_key = raw_path.lstrip("/").partition("/")
        bucket, key = unquote(bucket), unquote(raw_key)
        params = dict(parse_qsl(raw_query, keep_blank_values=True))
        op = _operation(request.method, key, params)
        fault = None
        try:
            self._authenticate(request, bucket, key, params)
            with self._lock:
                hang = next((i for i, o in enumerate(self._hangs) if o in (None, op)), None)
                failure = next((f for f in self._faults if f[0] in (None, op)), None)
                if hang is not None:
                    del self._hangs[hang]
                    fault = "hang"
                elif failure is not None:
                    self._faults.remove(failure)
                    fault = "fail"
            if fault == "hang":
                if await self._hold(Seen(op, bucket, key, 0, "hang")):
                    request.transport.close()  # the client sees its connection dropped
                    self._log(Seen(op, bucket, key, 0, "dropped"))
                    raise web.HTTPInternalServerError()  # unanswerable: the transport is gone
            if fault == "fail":
                raise _OssError(failure[1], f"injected {failure[1]} (spotvisor test fault)", failure[2])
            if bucket not in self._buckets:
                raise _OssError("NoSuchBucket", "The specified bucket does not exist.", 404, BucketName=bucket)
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise _OssError("NotImplemented", f"{op} is not implemented by this fake", 501)
            resp = await handler(request, bucket, key, params)
        except _OssError as err:
            resp = self._error(request, err, rid)
        resp.headers["x-oss-request-id"] = rid
        resp.headers["Server"] = "AliyunOSS"
        self._log(Seen(op, bucket, key, resp.status, fault))
        return resp

    async def _hold(self, seen: Seen) -> bool:
        """Wait at the gate; True if the request is to be dropped."""
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._gate.append(waiter)
        with self._held_cond:
            self._held.append(seen)
            self._held_cond.notify_all()
        try:
            return await waiter
        finally:
            with self._lock:
                self._held.remove(seen)

    def _log(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def _error(self, request: web.Request, err: _OssError, rid: str) -> web.Response:
        root = ET.Element("Error")
        for tag, text in (("Code", err.code), ("Message", err.message), ("RequestId", rid),
                          ("HostId", request.host), *err.extra.items()):
            _sub(root, tag, text)
        body = _xml(root)
        if request.method == "HEAD":
            return web.Response(status=err.status, headers={"x-oss-err": base64.b64encode(body).decode()})
        return web.Response(status=err.status, body=body, content_type="application/xml")

    def _authenticate(self, request: web.Request, bucket: str, key: str, params: dict[str, str]) -> None:
        header = request.headers.get("Authorization")
        if not header:
            raise _OssError("AccessDenied", "You have no right to access this object because of bucket acl.", 403)
        algo, _, rest = header.partition(" ")
        if algo != "OSS4-HMAC-SHA256":
            raise _OssError("AccessDenied", f"this fake verifies signature V4 only, got {algo!r}", 403)
        fields = dict(part.strip().partition("=")[::2] for part in rest.split(","))
        credential, signature = fields.get("Credential", ""), fields.get("Signature", "")
        scope_parts = credential.split("/")
        if len(scope_parts) != 5 or not signature:
            raise _OssError("InvalidArgument", "Authorization header is invalid.", 400)
        access_key_id, date, region, product, terminator = scope_parts
        if access_key_id != self.access_key_id:
            raise _OssError("InvalidAccessKeyId", "The OSS Access Key Id you provided does not exist in our records.",
                            403, OSSAccessKeyId=access_key_id)
        stamp = request.headers.get("x-oss-date", "")
        try:
            when = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            raise _OssError("AccessDenied", "x-oss-date is missing or malformed.", 403) from None
        if abs(when - self._clock()) > _SKEW_S:
            raise _OssError("RequestTimeTooSkewed", "The difference between the request time and the current "
                            "time is too large.", 403)
        additional = sorted(h.strip().lower() for h in fields.get("AdditionalHeaders", "").split(";") if h.strip())
        headers = sorted(
            (name.lower(), value.strip()) for name, value in request.headers.items()
            if name.lower().startswith("x-oss-") or name.lower() in ("content-type", "content-md5", *additional)
        )
        query = sorted((_v4_encode(k, keep_slash=False), _v4_encode(v, keep_slash=False)) for k, v in params.items())
        canonical = "\n".join([
            request.method,
            _v4_encode(f"/{bucket}/{key}" if bucket else "/", keep_slash=True),
            "&".join(f"{k}={v}" if v else k for k, v in query),
            "".join(f"{k}:{v}\n" for k, v in headers),
            ";".join(additional),
            request.headers.get("x-oss-content-sha256", "UNSIGNED-PAYLOAD"),
        ])
        scope = f"{date}/{self.region}/oss/aliyun_v4_request"
        to_sign = "\n".join(["OSS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        signing_key = b"aliyun_v4" + self.access_key_secret.encode()
        for part in (date, self.region, "oss", "aliyun_v4_request"):
            signing_key = _hmac(signing_key, part)
        expected = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
        if (region, product, terminator) != (self.region, "oss", "aliyun_v4_request") or not hmac.compare_digest(
            expected, signature
        ):
            raise _OssError("SignatureDoesNotMatch", "The request signature we calculated does not match the "
                            "signature you provided.", 403, OSSAccessKeyId=access_key_id, StringToSign=to_sign,
                            CanonicalRequest=canonical)

    # -- operations ---------------------------------------------------------------------

    def _object(self, bucket: str, key: str) -> _Blob:
        with self._lock:
            blob = self._buckets[bucket].get(key)
        if blob is None:
            raise _OssError("NoSuchKey", "The specified key does not exist.", 404, Key=key)
        return blob

    def _upload(self, bucket: str, key: str, params: dict[str, str]) -> _Upload:
        upload_id = params.get("uploadId", "")
        with self._lock:
            upload = self._uploads[bucket].get(upload_id)
        if upload is None or upload.key != key:
            raise _OssError("NoSuchUpload", "The specified upload does not exist.", 404, UploadId=upload_id)
        return upload

    async def _body(self, request: web.Request) -> bytes:
        data = await request.read()
        md5 = request.headers.get("Content-MD5")
        if md5 is not None and base64.b64encode(hashlib.md5(data).digest()).decode() != md5:
            raise _OssError("InvalidDigest", "The Content-MD5 you specified was invalid.", 400)
        return data

    @staticmethod
    def _written(blob: _Blob) -> web.Response:
        return web.Response(headers={"ETag": blob.etag, "x-oss-hash-crc64ecma": str(blob.crc),
                                     "Content-MD5": base64.b64encode(hashlib.md5(blob.data).digest()).decode()})

    async def _op_PutObject(self, request, bucket, key, params) -> web.Response:
        data = await self._body(request)
        blob = _Blob(data, _md5_etag(data), self._clock(),
                     content_type=request.headers.get("Content-Type", "application/octet-stream"))
        with self._lock:
            self._buckets[bucket][key] = blob
        return self._written(blob)

    async def _op_GetObject(self, request, bucket, key, params) -> web.Response:
        blob = self._object(bucket, key)
        if_match = request.headers.get("If-Match")
        if if_match is not None and if_match.strip('"') != blob.etag.strip('"'):
            raise _OssError("PreconditionFailed", "At least one of the pre-conditions you specified did not hold.",
                            412, Condition="If-Match")
        since = request.headers.get("If-Unmodified-Since")
        if since is not None and int(blob.mtime) > parsedate_to_datetime(since).timestamp():
            raise _OssError("PreconditionFailed", "At least one of the pre-conditions you specified did not hold.",
                            412, Condition="If-Unmodified-Since")
        headers = {"ETag": blob.etag, "Last-Modified": formatdate(int(blob.mtime), usegmt=True),
                   "Content-Type": blob.content_type, "Accept-Ranges": "bytes", "x-oss-object-type": blob.kind,
                   "x-oss-storage-class": "Standard", "x-oss-hash-crc64ecma": str(blob.crc)}
        span = _byte_range(request.headers.get("Range"), len(blob.data))
        if span is None:
            if request.method == "HEAD":  # the size of the object, as OSS sends it (0 for an empty one too)
                headers["Content-Length"] = str(len(blob.data))
            return web.Response(body=blob.data, headers=headers)
        start, end = span
        headers["Content-Range"] = f"bytes {start}-{end}/{len(blob.data)}"
        return web.Response(status=206, body=blob.data[start : end + 1], headers=headers)

    _op_HeadObject = _op_GetObject  # aiohttp sends the headers of a HEAD answer, not its body

    async def _op_DeleteObject(self, request, bucket, key, params) -> web.Response:
        with self._lock:
            self._buckets[bucket].pop(key, None)
        return web.Response(status=204)

    async def _op_ListObjectsV2(self, request, bucket, key, params) -> web.Response:
        prefix, delimiter = params.get("prefix", ""), params.get("delimiter", "")
        encode = params.get("encoding-type", "")
        if encode not in ("", "url"):
            raise _OssError("InvalidArgument", "The encoding-type must be url.", 400)
        try:
            max_keys = int(params.get("max-keys", "100"))
        except ValueError:
            max_keys = 0
        if not 1 <= max_keys <= 1000:
            raise _OssError("InvalidArgument", "max-keys must be in 1..1000.", 400)
        token = params.get("continuation-token", "")
        after = max(params.get("start-after", ""), _untoken(token) if token else "")
        with self._lock:
            items = sorted((k, b) for k, b in self._buckets[bucket].items() if k.startswith(prefix) and k > after)
        # Entries in key order: an object, or a common prefix standing for every key under it.
        entries: list[tuple[str, _Blob | None, str]] = []  # (key or prefix, blob or None, last key covered)
        for k, blob in items:
            cut = k.find(delimiter, len(prefix)) if delimiter else -1
            if cut < 0:
                entries.append((k, blob, k))
            elif entries and entries[-1][1] is None and entries[-1][0] == k[: cut + 1]:
                entries[-1] = (entries[-1][0], None, k)
            else:
                entries.append((k[: cut + 1], None, k))
        page, truncated = entries[:max_keys], len(entries) > max_keys
        contents = [(k, blob) for k, blob, _ in page if blob is not None]
        prefixes = [k for k, blob, _ in page if blob is None]
        last = page[-1][2] if page else ""
        enc = (lambda s: quote(s, safe="")) if encode else (lambda s: s)
        root = ET.Element("ListBucketResult")
        for tag, text in (("Name", bucket), ("Prefix", enc(prefix)), ("MaxKeys", max_keys),
                          ("Delimiter", enc(delimiter)), ("EncodingType", encode or None),
                          ("ContinuationToken", enc(token) if token else None),
                          ("IsTruncated", str(truncated).lower()),
                          ("NextContinuationToken", enc(_token(last)) if truncated else None),
                          ("KeyCount", len(contents) + len(prefixes))):
            if text is not None:
                _sub(root, tag, text)
        for k, blob in contents:
            node = ET.SubElement(root, "Contents")
            for tag, text in (("Key", enc(k)), ("LastModified", _iso(blob.mtime)), ("ETag", blob.etag),
                              ("Type", blob.kind), ("Size", len(blob.data)), ("StorageClass", "Standard")):
                _sub(node, tag, text)
        for p in prefixes:
            _sub(ET.SubElement(root, "CommonPrefixes"), "Prefix", enc(p))
        return web.Response(body=_xml(root), content_type="application/xml")

    async def _op_DeleteMultipleObjects(self, request, bucket, key, params) -> web.Response:
        if "Content-MD5" not in request.headers:
            raise _OssError("InvalidDigest", "Content-MD5 is required for DeleteMultipleObjects.", 400)
        body = await self._body(request)
        try:
            doc = ET.fromstring(body)
            keys = [node.findtext("Key", "") for node in doc.findall("Object")]
        except ET.ParseError:
            raise _OssError("MalformedXML", "The XML you provided was not well-formed.", 400) from None
        if doc.tag != "Delete" or not keys or len(keys) > 1000:
            raise _OssError("MalformedXML", "A delete names 1..1000 objects.", 400)
        with self._lock:
            for k in keys:
                self._buckets[bucket].pop(k, None)
        encode = params.get("encoding-type") == "url"
        root = ET.Element("DeleteResult")
        if encode:
            _sub(root, "EncodingType", "url")
        if (doc.findtext("Quiet") or "false").lower() != "true":
            for k in keys:
                _sub(ET.SubElement(root, "Deleted"), "Key", quote(k, safe="") if encode else k)
        return web.Response(body=_xml(root), content_type="application/xml")

    async def _op_InitiateMultipartUpload(self, request, bucket, key, params) -> web.Response:
        upload_id = uuid.uuid4().hex.upper()
        with self._lock:
            self._uploads[bucket][upload_id] = _Upload(key, request.headers.get("Content-Type",
                                                                                 "application/octet-stream"))
        root = ET.Element("InitiateMultipartUploadResult")
        for tag, text in (("Bucket", bucket), ("Key", key), ("UploadId", upload_id)):
            _sub(root, tag, text)
        return web.Response(body=_xml(root), content_type="application/xml")

    async def _op_UploadPart(self, request, bucket, key, params) -> web.Response:
        upload = self._upload(bucket, key, params)
        number = int(params.get("partNumber", "")) if params.get("partNumber", "").isdigit() else 0
        if not 1 <= number <= 10000:
            raise _OssError("InvalidArgument", "Part number must be an integer between 1 and 10000.", 400)
        data = await self._body(request)
        part = _Blob(data, _md5_etag(data), self._clock())
        with self._lock:
            upload.parts[number] = part
        return self._written(part)

    async def _op_CompleteMultipartUpload(self, request, bucket, key, params) -> web.Response:
        upload = self._upload(bucket, key, params)
        try:
            doc = ET.fromstring(await self._body(request))
            listed = [(int(p.findtext("PartNumber", "")), p.findtext("ETag", "").strip('"'))
                      for p in doc.findall("Part")]
        except (ET.ParseError, ValueError):
            raise _OssError("MalformedXML", "The XML you provided was not well-formed.", 400) from None
        if not listed:
            raise _OssError("MalformedXML", "CompleteMultipartUpload names no part.", 400)
        numbers = [n for n, _ in listed]
        if numbers != sorted(set(numbers)):
            raise _OssError("InvalidPartOrder", "The list of parts was not in ascending order.", 400)
        with self._lock:
            parts = [upload.parts.get(n) for n in numbers]
        for (n, etag), part in zip(listed, parts):
            if part is None or part.etag.strip('"') != etag:
                raise _OssError("InvalidPart", "One or more of the specified parts could not be found or the "
                                "specified entity tag might not have matched the part's entity tag.", 400,
                                PartNumber=str(n), UploadId=params["uploadId"])
        if any(len(p.data) < _MIN_PART for p in parts[:-1]):
            raise _OssError("EntityTooSmall", "Your proposed upload is smaller than the minimum allowed size.", 400)
        digest = hashlib.md5(b"".join(hashlib.md5(p.data).digest() for p in parts)).hexdigest().upper()
        blob = _Blob(b"".join(p.data for p in parts), f'"{digest}-{len(parts)}"', self._clock(), "Multipart",
                     upload.content_type)
        with self._lock:
            if self._uploads[bucket].pop(params["uploadId"], None) is None:
                raise _OssError("NoSuchUpload", "The specified upload does not exist.", 404)
            self._buckets[bucket][key] = blob
        root = ET.Element("CompleteMultipartUploadResult")
        for tag, text in (("Location", f"{request.host}/{bucket}/{key}"), ("Bucket", bucket), ("Key", key),
                          ("ETag", blob.etag)):
            _sub(root, tag, text)
        return web.Response(body=_xml(root), content_type="application/xml",
                            headers={"ETag": blob.etag, "x-oss-hash-crc64ecma": str(blob.crc)})

    async def _op_AbortMultipartUpload(self, request, bucket, key, params) -> web.Response:
        self._upload(bucket, key, params)
        with self._lock:
            self._uploads[bucket].pop(params["uploadId"], None)
        return web.Response(status=204)

    async def _op_ListParts(self, request, bucket, key, params) -> web.Response:
        upload = self._upload(bucket, key, params)
        marker_text, max_text = params.get("part-number-marker") or "0", params.get("max-parts") or "1000"
        if not (marker_text.isdigit() and max_text.isdigit() and 1 <= int(max_text) <= 1000):
            raise _OssError("InvalidArgument", "part-number-marker or max-parts is invalid.", 400)
        marker, max_parts = int(marker_text), int(max_text)
        with self._lock:
            numbers = sorted(n for n in upload.parts if n > marker)
            parts = [(n, upload.parts[n]) for n in numbers[:max_parts]]
        root = ET.Element("ListPartsResult")
        truncated = len(numbers) > max_parts
        for tag, text in (("Bucket", bucket), ("Key", key), ("UploadId", params["uploadId"]),
                          ("PartNumberMarker", marker), ("NextPartNumberMarker", parts[-1][0] if parts else marker),
                          ("MaxParts", max_parts), ("IsTruncated", str(truncated).lower())):
            _sub(root, tag, text)
        for n, part in parts:
            node = ET.SubElement(root, "Part")
            for tag, text in (("PartNumber", n), ("LastModified", _iso(part.mtime)), ("ETag", part.etag),
                              ("HashCrc64ecma", part.crc), ("Size", len(part.data))):
                _sub(node, tag, text)
        return web.Response(body=_xml(root), content_type="application/xml")


def _operation(method: str, key: str, params: dict[str, str]) -> str:
    """The OSS API operation a request is (by method, object or bucket, sub-resource)."""
    if not key:
        if method == "GET":
            return "ListObjectsV2" if params.get("list-type") == "2" else "ListObjects"
        return "DeleteMultipleObjects" if method == "POST" and "delete" in params else f"{method}Bucket"
    multipart = {("POST", "uploads"): "InitiateMultipartUpload", ("PUT", "uploadId"): "UploadPart",
                 ("POST", "uploadId"): "CompleteMultipartUpload", ("DELETE", "uploadId"): "AbortMultipartUpload",
                 ("GET", "uploadId"): "ListParts"}
    for (m, param), op in multipart.items():
        if method == m and param in params:
            return op
    return {"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(
        method, f"{method}Object")


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``a-`` / ``-n`` -> inclusive (start, end); None = the whole object
    (no header, or one OSS ignores: malformed or unsatisfiable)."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[6:].partition("-")
    try:
        if first == "":
            start, end = max(size - int(last), 0), size - 1
        else:
            start, end = int(first), min(int(last), size - 1) if last else size - 1
    except ValueError:
        return None
    return (start, end) if 0 <= start <= end < size else None


def _token(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode()


def _untoken(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, UnicodeDecodeError):
        raise _OssError("InvalidArgument", "The continuation-token is invalid.", 400) from None
