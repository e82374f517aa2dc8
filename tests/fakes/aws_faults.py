"""A fault-injecting HTTP proxy in front of moto's EC2 server.

moto never answers with capacity, quota, throttling or auth errors, and never times
out. This proxy forwards every request unchanged (method, path, query, headers,
body) to moto and returns moto's answer, except for requests whose EC2 ``Action``
(from the form body, else the query string) has an armed fault:

- :meth:`AwsFaultProxy.fail_next`: answer with an EC2 error response, the documented
  shape (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html#api-error-response)::

      <?xml version="1.0" encoding="UTF-8"?>
      <Response><Errors><Error><Code>..</Code><Message>..</Message></Error></Errors><RequestID>..</RequestID></Response>

  and the given HTTP status (client errors 4xx, server errors 5xx; e.g.
  InsufficientInstanceCapacity is a server error, RequestLimitExceeded 503).
- :meth:`AwsFaultProxy.delay_next`: forward to moto first (the request takes effect:
  the instance exists), then hold the answer ``seconds`` — past the client's read
  timeout, the "timeout after the request reached EC2" case. ``after_forward=False``
  holds it before forwarding instead.
- :meth:`AwsFaultProxy.reply_next`: answer with a given body and status (e.g. a 200
  CreateFleet response whose ``Errors[]`` lists capacity failures).

Requests with ``DryRun=true`` (the daemon's cloud check) never take an armed fault: the
faults are for the launches a test means; :meth:`AwsFaultProxy.answer` sees them.

- :meth:`AwsFaultProxy.answer`: a responder consulted for every request no armed fault
  took (e.g. Service Quotas, which moto 5 serves for ``vpc`` only, or an S3 ``PUT``
  refused ``AccessDenied``): it returns ``(status, body, content type)`` or None to
  forward. Requests of the JSON protocols (Service Quotas) are named by their
  ``X-Amz-Target`` header (``ServiceQuotasV20190624.GetServiceQuota`` →
  ``GetServiceQuota``) with their JSON body as parameters; the region is the SigV4
  credential scope's (https://docs.aws.amazon.com/IAM/latest/UserGuide/create-signed-request.html).
  Error bodies: the JSON protocol's ``{"__type": code, "message": ...}``
  (https://smithy.io/2.0/aws/protocols/aws-json-1_1-protocol.html#operation-error-serialization),
  S3's ``<Error><Code/><Message/></Error>``
  (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).

RunInstances carries EC2's idempotency, which moto 5 does not implement (it stores the
``ClientToken`` and launches again): a request whose ``ClientToken`` an earlier successful
RunInstances in the same region carried gets that request's answer back, and no new
instance; with the same token but other parameters it gets ``IdempotentParameterMismatch``
(400). Requests with one token are served one at a time (a retry that arrives while the
first is still at moto waits for its answer). EC2's contract, "Ensuring idempotency in
Amazon EC2 API requests" (https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html):
"If you retry a request that has completed successfully using the same client token and
the same parameters, the retry succeeds without performing any further actions. If you
retry a successful request using the same client token, but one or more of the
parameters are different, other than the Region or Availability Zone, the retry fails
with an IdempotentParameterMismatch error." :attr:`AwsFaultProxy.replayed` counts the
answers given back that way.

TerminateInstances is idempotent on EC2 (the same guide: "idempotent by default"; a
terminated instance stays visible for about an hour and terminating it again succeeds),
while moto 5 answers a second termination of an instance as it likes: ``shutting-down``
again, or (an instance whose network interface it deleted with the first, as the HA
trials' are) ``InvalidNetworkInterfaceID.NotFound``. A TerminateInstances whose instances this proxy
already saw terminated is answered as EC2 answers it
(https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_TerminateInstances.html: each
instance's ``currentState`` and ``previousState`` ``terminated``, code 48), not forwarded.

The proxy runs its own event loop in a background thread, so both sync boto3 calls
made by a test and ``asyncio.to_thread`` calls made by a provider can reach it.
Every request's action and form parameters are recorded in :attr:`requests`.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

import aiohttp
from aiohttp import web

from fakes.serving import LoopThread

__all__ = ["AwsFaultProxy", "ec2_error_xml"]

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate"}


def ec2_error_xml(code: str, message: str, request_id: str | None = None) -> str:
    """An EC2 Query API error body (see the module docstring for the doc)."""
    rid = request_id or str(uuid.uuid4())
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Response><Errors><Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
            f"</Error></Errors><RequestID>{rid}</RequestID></Response>")


def _instance_ids(params: dict[str, str]) -> list[str]:
    """A Query API request's ``InstanceId.N`` values, in order."""
    keys = sorted((k for k in params if re.fullmatch(r"InstanceId\.\d+", k)), key=lambda k: int(k.split(".")[1]))
    return [params[k] for k in keys]


@dataclass
class _Fault:
    kind: str  # fail | delay | reply
    remaining: int
    status: int = 200
    body: str = ""
    seconds: float = 0.0
    after_forward: bool = True


@dataclass
class Seen:
    """One request the proxy received: its EC2 action, form parameters, and what it did."""

    action: str
    params: dict[str, str]
    fault: str | None = None  # fail | delay | reply | answer | None (forwarded untouched)
    method: str = "POST"
    path: str = "/"
    region: str = ""  # from the SigV4 credential scope ("" unsigned)
    at: float = field(default_factory=time.monotonic)  # when the proxy received it (monotonic s)
    replayed: bool = False  # a RunInstances answered from an earlier request with its ClientToken


@dataclass
class AwsFaultProxy:
    """See the module docstring. ``start()`` → use ``url`` → ``close()`` (idempotent)."""

    upstream: str
    requests: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._faults: dict[str, list[_Fault]] = {}
        # (region, ClientToken) -> (parameters but the token, moto's answer): EC2 idempotency (module docstring)
        self._tokens: dict[tuple[str, str], tuple[dict[str, str], int, dict[str, str], bytes]] = {}
        self._token_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._terminated: set[tuple[str, str]] = set()  # (region, instance id) a TerminateInstances ended
        self._responder: Callable[[Seen], tuple[int, str, str] | None] | None = None
        self._lock = threading.Lock()
        self._serving: LoopThread[None] = LoopThread("aws-fault-proxy", "AwsFaultProxy")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closing: asyncio.Event | None = None
        self.url: str | None = None

    # -- arming ---------------------------------------------------------------
    def fail_next(self, action: str, code: str, status: int, n: int = 1, message: str | None = None) -> None:
        """Answer the next ``n`` ``action`` requests with an EC2 error ``code`` and HTTP ``status``."""
        body = ec2_error_xml(code, message or f"injected {code} (spotvisor test fault)")
        self._arm(action, _Fault("fail", n, status=status, body=body))

    def delay_next(self, action: str, seconds: float, n: int = 1, after_forward: bool = True) -> None:
        """Hold the next ``n`` ``action`` answers ``seconds`` (after forwarding them, by default)."""
        self._arm(action, _Fault("delay", n, seconds=seconds, after_forward=after_forward))

    def reply_next(self, action: str, body: str, status: int = 200, n: int = 1) -> None:
        """Answer the next ``n`` ``action`` requests with ``body`` (XML) and ``status``, not forwarding."""
        self._arm(action, _Fault("reply", n, status=status, body=body))

    def answer(self, responder: "Callable[[Seen], tuple[int, str, str] | None] | None") -> None:
        """Consult ``responder`` for every request no armed fault takes; it returns
        ``(status, body, content type)`` to answer it, None to forward it. None: forward all."""
        with self._lock:
            self._responder = responder

    def reset(self) -> None:
        with self._lock:
            self._faults.clear()
            self.requests.clear()
            self._responder = None
            self._tokens.clear()

    @property
    def replayed(self) -> int:
        """RunInstances requests answered from an earlier one with the same ClientToken."""
        with self._lock:
            return sum(1 for s in self.requests if s.replayed)

    def actions(self, action: str, *, dry_run: bool = False) -> list[Seen]:
        """The recorded requests for ``action``, oldest first: those a test means (no
        ``DryRun=true``), or with ``dry_run`` the dry runs only (the cloud check's)."""
        with self._lock:
            return [s for s in self.requests
                    if s.action == action and (str(s.params.get("DryRun", "")).lower() == "true") == dry_run]

    def _arm(self, action: str, fault: _Fault) -> None:
        if fault.remaining < 1:
            raise ValueError(f"n must be >= 1, got {fault.remaining}")
        with self._lock:
            self._faults.setdefault(action, []).append(fault)

    def _take(self, action: str) -> _Fault | None:
        with self._lock:
            queue = self._faults.get(action)
            if not queue:
                return None
            fault = queue[0]
            fault.remaining -= 1
            if fault.remaining == 0:
                queue.pop(0)
            return fault

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> str:
        """Start the proxy on 127.0.0.1 (random port) in a background thread; returns its URL."""
        self._serving.start(self._astart, lambda _: self._astop())
        assert self.url is not None
        return self.url

    def close(self) -> None:
        """Stop the proxy: held (delayed) answers are released at once. Idempotent."""
        self._serving.close()

    async def _astart(self) -> None:
        self._closing = asyncio.Event()
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _astop(self) -> None:
        if self._closing is not None:
            self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # -- handling -------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        target = request.headers.get("X-Amz-Target", "")
        if target:  # a JSON protocol: the action is the target's operation, the parameters its body
            params = json.loads(body or b"{}")
            action = target.rsplit(".", 1)[-1]
        else:
            is_form = request.content_type == "application/x-www-form-urlencoded"
            params = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()} \
                if body and is_form else {}
            if "Action" not in params:
                params.update({k: v for k, v in request.query.items()})
            action = params.get("Action", "")
        scope = re.search(r"Credential=[^/]+/[^/]+/([^/]+)/", request.headers.get("Authorization", ""))
        seen = Seen(action, params, None, request.method, request.path, scope.group(1) if scope else "")
        # a dry run (the cloud check's, spotvisord check) is not one of "the next requests" a fault is armed for
        fault = None if str(params.get("DryRun", "")).lower() == "true" else self._take(action)
        with self._lock:
            responder = self._responder
        answered = responder(seen) if fault is None and responder is not None else None
        seen.fault = fault.kind if fault else ("answer" if answered else None)
        with self._lock:
            self.requests.append(seen)
        if answered is not None:
            status, text, ctype = answered
            return web.Response(status=status, body=text.encode(), content_type=ctype)
        if fault is not None and fault.kind in ("fail", "reply"):
            return web.Response(status=fault.status, body=fault.body.encode(), content_type="text/xml")
        if fault is not None and not fault.after_forward:
            await self._hold(fault.seconds)
        if (again := self._terminated_again(seen)) is not None:
            return web.Response(status=200, body=again.encode(), content_type="text/xml")
        status, headers, payload = await self._idempotent(seen, request, body)
        if seen.action == "TerminateInstances" and status == 200:
            with self._lock:
                self._terminated |= {(seen.region, i) for i in _instance_ids(seen.params)}
        if fault is not None and fault.after_forward:
            await self._hold(fault.seconds)
        return web.Response(status=status, headers=headers, body=payload)

    def _terminated_again(self, seen: Seen) -> str | None:
        """EC2's answer to a TerminateInstances of instances all terminated already (module
        docstring); None: forward it."""
        ids = _instance_ids(seen.params)
        if seen.action != "TerminateInstances" or not ids or str(seen.params.get("DryRun", "")).lower() == "true":
            return None
        with self._lock:
            if not all((seen.region, i) in self._terminated for i in ids):
                return None
        gone = "<code>48</code><name>terminated</name>"
        items = "".join(f"<item><instanceId>{escape(i)}</instanceId><currentState>{gone}</currentState>"
                        f"<previousState>{gone}</previousState></item>" for i in ids)
        return ('<?xml version="1.0" encoding="UTF-8"?>\n'
                '<TerminateInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
                f"<requestId>{uuid.uuid4()}</requestId><instancesSet>{items}</instancesSet>"
                "</TerminateInstancesResponse>")

    async def _hold(self, seconds: float) -> None:
        assert self._closing is not None
        try:
            await asyncio.wait_for(self._closing.wait(), timeout=seconds)  # the injected delay itself
        except TimeoutError:
            pass

    async def _idempotent(self, seen: Seen, request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """:meth:`_forward`, with RunInstances' ClientToken honoured (module docstring)."""
        token = seen.params.get("ClientToken")
        if seen.action != "RunInstances" or not token or str(seen.params.get("DryRun", "")).lower() == "true":
            return await self._forward(request, body)
        key = (seen.region, token)
        params = {k: v for k, v in seen.params.items() if k != "ClientToken"}
        async with self._token_locks.setdefault(key, asyncio.Lock()):  # the proxy's loop only: no thread lock
            done = self._tokens.get(key)
            if done is not None:
                with self._lock:
                    seen.replayed = True
                if done[0] != params:
                    return 400, {"Content-Type": "text/xml"}, ec2_error_xml(
                        "IdempotentParameterMismatch", "Arguments on this idempotent request are inconsistent with "
                        "arguments used in previous request(s).").encode()
                return done[1], dict(done[2]), done[3]
            status, headers, payload = await self._forward(request, body)
            if status == 200:
                self._tokens[key] = (params, status, headers, payload)
            return status, headers, payload

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=body, allow_redirects=False) as resp:
            payload = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD" and "Content-Length" in resp.headers:  # the object's size (S3 HeadObject)
                out["Content-Length"] = resp.headers["Content-Length"]
            return resp.status, out, payload
