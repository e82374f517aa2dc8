"""A local fake of the AWS EC2 instance metadata service (IMDSv2), for tests and for the
local provider (each local "instance" gets one on 127.0.0.1, and the chaos schedule
publishes notices on it).

It follows the documents the real client follows:

- https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
  and https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html:
  ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` in
  1..21600 (else 400) and answers the token as ``text/plain``; a token expires after
  its TTL. A read without a token (``http_tokens="required"``, the default) or with an
  invalid or expired token gets 401. A token ``PUT`` carrying ``X-Forwarded-For`` is
  refused (403), as the documents say IMDS does. Unknown items are 404. Every value is
  ``text/plain``.
- https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html:
  ``spot/instance-action`` is 404 until :meth:`FakeImds.publish_interruption`, then
  ``{"action": "terminate", "time": "2017-09-18T08:22:00Z"}``. The legacy
  ``spot/termination-time`` serves the bare time; the fake serves it only for
  ``action="terminate"`` (UNCONFIRMED which actions set it on real instances; the
  document keeps it for backward compatibility with terminate-only behaviour).
- https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html:
  ``events/recommendations/rebalance`` is 404 until :meth:`FakeImds.publish_rebalance`,
  then ``{"noticeTime": "2020-10-27T08:22:00Z"}``.

Test hooks (not part of IMDS): an injectable monotonic ``clock`` for token expiry,
:meth:`FakeImds.fail_next` (answer the next requests with an error status),
:meth:`FakeImds.hang_next` (never answer them, to exercise client timeouts),
:meth:`FakeImds.forget_tokens` (as if IMDS restarted), :meth:`FakeImds.publish_raw`
(serve an arbitrary body) and the counters ``token_puts`` / ``request_log``.

Example::

    async with FakeImds(instance_id="i-0abc") as imds:
        imds.publish_interruption(action="terminate")   # time: now + 2 min
        client = AwsImds(imds.url)
"""

from __future__ import annotations

import asyncio
import time as _time
import json
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Literal

from aiohttp import web

from daemon.metadata.aws import (
    KNOWN_ACTIONS,
    MAX_TOKEN_TTL_S,
    MIN_TOKEN_TTL_S,
    TOKEN_HEADER,
    TOKEN_PATH,
    TTL_HEADER,
)

__all__ = ["FakeImds", "INTERRUPTION_LEAD"]

#: Lead time of a spot interruption notice (hibernate: none).
INTERRUPTION_LEAD = timedelta(minutes=2)

_TEXT = "text/plain"


def _fmt(when: datetime) -> str:
    """IMDS time format: ``YYYY-MM-DDTHH:MM:SSZ`` (UTC, whole seconds)."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"time must be timezone-aware (UTC), got {when!r}")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeImds:
    """An aiohttp server on ``host`` speaking IMDSv2.

    Lifecycle: the constructor does no I/O; ``await start()`` binds (``port=0`` picks
    a free port) and sets :attr:`url`; ``await aclose()`` stops it and is idempotent and
    safe after a failed start. Also an async context manager.

    Args:
        instance_id, instance_type, availability_zone: values of the
            ``instance-id``, ``instance-type`` and ``placement/availability-zone`` items.
        host, port: where to listen; port 0 = ephemeral.
        clock: monotonic seconds, used for token expiry; tests pass a settable one.
        http_tokens: ``"required"`` (IMDSv2 only: a read without a token is 401) or
            ``"optional"`` (a read without a token is served; an invalid one is 401).
    """

    def __init__(
        self,
        *,
        instance_id: str = "i-0123456789abcdef0",
        instance_type: str = "p4d.24xlarge",
        availability_zone: str = "us-east-1a",
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        http_tokens: Literal["required", "optional"] = "required",
    ) -> None:
        if http_tokens not in ("required", "optional"):
            raise ValueError(f"http_tokens must be 'required' or 'optional', got {http_tokens!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._host = host
        self._port = port
        self._clock = clock
        self._http_tokens = http_tokens
        self._static: dict[str, str] = {
            "instance-id": instance_id,
            "instance-type": instance_type,
            "placement/availability-zone": availability_zone,
        }
        self._items: dict[str, str] = {}  # published notice items, by meta-data path
        self.published_at: float | None = None  # unix time of the current interruption notice
        self._tokens: dict[str, float] = {}  # token -> expiry (clock seconds)
        self._faults: list[tuple[int, str | None]] = []  # (status, path or None=any), in order
        self._hangs: list[str | None] = []  # path or None=any, in order
        self._release = asyncio.Event()
        self._hung = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self.token_puts = 0
        """Successful token PUTs served so far."""
        self.request_log: list[tuple[str, str, int]] = []
        """``(method, path, status)`` of every answered request, oldest first."""

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``. Only after :meth:`start`."""
        if self._url is None:
            raise RuntimeError("FakeImds is not started; call 'await fake.start()' first")
        return self._url

    async def start(self) -> FakeImds:
        """Bind and serve. Raises RuntimeError if already started."""
        if self._runner is not None:
            raise RuntimeError("FakeImds is already started")
        app = web.Application()
        app.router.add_route("PUT", TOKEN_PATH, self._handle_token)
        app.router.add_route("GET", "/latest/meta-data/{item:.*}", self._handle_get)
        app.router.add_route("*", "/{tail:.*}", self._handle_other)
        self._release = asyncio.Event()
        self._hung = asyncio.Event()
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        self._runner = runner
        try:
            await runner.setup()
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
        except BaseException:
            await self.aclose()
            raise
        host, port = runner.addresses[0][:2]
        self._url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        return self

    async def aclose(self) -> None:
        """Stop serving (releases hung requests first). Idempotent."""
        self._release.set()
        runner, self._runner = self._runner, None
        self._url = None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeImds:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- what the "cloud" publishes --------------------------------------------------------

    def publish_interruption(self, action: str = "terminate", time: datetime | None = None) -> None:
        """Make ``spot/instance-action`` (and, for terminate, ``spot/termination-time``)
        appear.

        Args:
            action: ``"terminate"``, ``"stop"`` or ``"hibernate"``.
            time: aware time at which the cloud acts; default now + 2 min
                (hibernate: now, it has no lead).

        Raises:
            ValueError: unknown action or naive time.
        """
        if action not in KNOWN_ACTIONS:
            raise ValueError(f"action must be one of {sorted(KNOWN_ACTIONS)}, got {action!r}")
        if time is None:
            lead = timedelta(0) if action == "hibernate" else INTERRUPTION_LEAD
            time = datetime.now(timezone.utc) + lead
        stamp = _fmt(time)
        self._items["spot/instance-action"] = json.dumps({"action": action, "time": stamp})
        if action == "terminate":
            self._items["spot/termination-time"] = stamp
        else:
            self._items.pop("spot/termination-time", None)
        self.published_at = _time.time()

    def publish_rebalance(self, notice_time: datetime | None = None) -> None:
        """Make ``events/recommendations/rebalance`` appear (default time: now)."""
        stamp = _fmt(notice_time if notice_time is not None else datetime.now(timezone.utc))
        self._items["events/recommendations/rebalance"] = json.dumps({"noticeTime": stamp})

    def publish_raw(self, item: str, body: str) -> None:
        """Test hook: serve ``body`` verbatim at ``/latest/meta-data/<item>``."""
        self._items[item.strip("/")] = body

    def clear(self) -> None:
        """Remove every published notice (interruption, termination-time, rebalance, raw)."""
        self._items.clear()
        self.published_at = None

    # -- fault injection ---------------------------------------------------------------

    def fail_next(self, n: int = 1, status: int = 500, *, path: str | None = None) -> None:
        """Answer the next ``n`` requests with ``status``.

        Args:
            n: how many requests.
            status: an HTTP error status, 400..599.
            path: only requests for this exact path (e.g.
                ``"/latest/meta-data/spot/instance-action"``); None = any request,
                token PUTs included.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400..599), got {status}")
        self._faults.extend([(status, path)] * n)

    def hang_next(self, n: int = 1, *, path: str | None = None) -> None:
        """Never answer the next ``n`` requests (until :meth:`aclose`): client timeouts.

        ``path``: only requests for this exact path; None = any request.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._hangs.extend([path] * n)

    async def wait_hanging(self) -> None:
        """Return once a request held by :meth:`hang_next` has arrived."""
        await self._hung.wait()

    def forget_tokens(self) -> None:
        """Invalidate every issued token, as a restarted IMDS would."""
        self._tokens.clear()

    # -- handlers --------------------------------------------------------------------

    async def _intercept(self, request: web.Request) -> web.Response | None:
        for i, path in enumerate(self._hangs):
            if path is None or path == request.path:
                del self._hangs[i]
                self._hung.set()
                await self._release.wait()
                return self._answer(request, 503, "shutting down")
        for i, (status, path) in enumerate(self._faults):
            if path is None or path == request.path:
                del self._faults[i]
                return self._answer(request, status, f"injected fault {status}")
        return None

    def _answer(self, request: web.Request, status: int, body: str) -> web.Response:
        self.request_log.append((request.method, request.path, status))
        return web.Response(status=status, text=body, content_type=_TEXT)

    async def _handle_token(self, request: web.Request) -> web.Response:
        fault = await self._intercept(request)
        if fault is not None:
            return fault
        if "X-Forwarded-For" in request.headers:
            return self._answer(request, 403, "Forbidden")
        raw_ttl = request.headers.get(TTL_HEADER)
        ttl = int(raw_ttl) if raw_ttl is not None and raw_ttl.strip().isdecimal() else -1
        if not MIN_TOKEN_TTL_S <= ttl <= MAX_TOKEN_TTL_S:
            return self._answer(request, 400, "Bad Request")
        now = self._clock()
        self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
        token = secrets.token_urlsafe(42)
        self._tokens[token] = now + ttl
        self.token_puts += 1
        resp = self._answer(request, 200, token)
        resp.headers[TTL_HEADER] = str(ttl)
        return resp

    def _token_ok(self, request: web.Request) -> bool:
        token = request.headers.get(TOKEN_HEADER)
        if token is None:
            return self._http_tokens == "optional"
        expiry = self._tokens.get(token)
        if expiry is None:
            return False
        if self._clock() >= expiry:
            del self._tokens[token]
            return False
        return True

    async def _handle_get(self, request: web.Request) -> web.Response:
        fault = await self._intercept(request)
        if fault is not None:
            return fault
        if not self._token_ok(request):
            return self._answer(request, 401, "Unauthorized")
        item = request.match_info["item"].strip("/")
        value = self._items.get(item, self._static.get(item))
        if value is None:
            return self._answer(request, 404, "Not Found")
        return self._answer(request, 200, value)

    async def _handle_other(self, request: web.Request) -> web.Response:
        fault = await self._intercept(request)
        if fault is not None:
            return fault
        if request.path == TOKEN_PATH:
            return self._answer(request, 405, "Method Not Allowed")
        if request.method == "GET" and not self._token_ok(request):
            return self._answer(request, 401, "Unauthorized")
        return self._answer(request, 404, "Not Found")
