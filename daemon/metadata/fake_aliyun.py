"""A local fake of the Alibaba Cloud ECS instance metadata service, for tests and for the
local provider (each local "instance" gets one on 127.0.0.1; the chaos schedule
publishes notices on it).

It follows the documents the real client follows:

- https://www.alibabacloud.com/help/en/ecs/user-guide/best-practices-for-preemptible-instances
  and https://www.alibabacloud.com/help/en/ecs/use-cases/query-the-interruption-events-of-preemptible-instances:
  ``instance/spot/termination-time`` is 404 until :meth:`FakeAliyunMetadata.publish_interruption`,
  then the plain-text UTC time ``yyyy-MM-ddTHH:mm:ssZ``; ECS sets it 5 minutes before
  it releases the instance (the default lead here).
- https://www.alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata
  (items and security hardening mode): ``instance-id``, ``instance/instance-type``,
  ``region-id``, ``zone-id`` are text. ``PUT /latest/api/token`` needs
  ``X-aliyun-ecs-metadata-token-ttl-seconds`` in 1..21600 and answers the token as
  text; the token is reusable until its TTL runs out. With ``hardened=True`` (the
  instance's ``HttpTokens=required``,
  https://www.alibabacloud.com/help/en/ecs/user-guide/access-instance-metadata-using-hardened-only-mode)
  a read must carry ``X-aliyun-ecs-metadata-token``.
- UNCONFIRMED status codes (no authoritative source; assumed IMDSv2-like): a bad or
  missing TTL is 400; a missing (hardened mode), invalid or expired token is 401;
  unknown items are 404; a method other than PUT on the token path is 405.

Test hooks (not part of ECS): an injectable monotonic ``clock`` for token expiry,
:meth:`~FakeAliyunMetadata.fail_next`, :meth:`~FakeAliyunMetadata.hang_next` (with
:meth:`~FakeAliyunMetadata.wait_hanging`), :meth:`~FakeAliyunMetadata.forget_tokens`
(as if the metadata server restarted), :meth:`~FakeAliyunMetadata.publish_raw`, and
``token_puts`` / ``request_log`` / ``published_at``.

Example::

    async with FakeAliyunMetadata(hardened=True) as md:
        md.publish_interruption()                    # now + 5 min
        client = AliyunMetadata(md.url, hardened=True)
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from aiohttp import web

from daemon.metadata.aliyun import (
    MAX_TOKEN_TTL_S,
    MIN_TOKEN_TTL_S,
    TOKEN_HEADER,
    TOKEN_PATH,
    TTL_HEADER,
)

__all__ = ["FakeAliyunMetadata", "INTERRUPTION_LEAD", "TERMINATION_ITEM"]

#: ECS updates ``instance/spot/termination-time`` this long before releasing the instance.
INTERRUPTION_LEAD = timedelta(minutes=5)
TERMINATION_ITEM = "instance/spot/termination-time"

_TEXT = "text/plain"


def _stamp(when: datetime) -> str:
    """ECS time format: ``yyyy-MM-ddTHH:mm:ssZ`` (UTC, whole seconds)."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"time must be timezone-aware (UTC), got {when!r}")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeAliyunMetadata:
    """An aiohttp server on ``host`` speaking the ECS metadata protocol.

    Lifecycle: the constructor does no I/O; ``await start()`` binds (``port=0`` picks
    a free port) and sets :attr:`url`; ``await aclose()`` stops it, is idempotent and
    safe after a failed start. Also an async context manager.

    Args:
        instance_id, instance_type, region_id, zone_id: values of the
            ``instance-id``, ``instance/instance-type``, ``region-id`` and
            ``zone-id`` items.
        hardened: security hardening mode only (a read without a token is 401).
            Otherwise reads without a token are served; one with an invalid token
            is still 401.
        host, port: where to listen; port 0 = ephemeral.
        clock: monotonic seconds, used for token expiry; tests pass a settable one.
    """

    def __init__(
        self,
        *,
        instance_id: str = "i-bp1fakeinstance0001",
        instance_type: str = "ecs.gn7i-c8g1.2xlarge",
        region_id: str = "cn-hangzhou",
        zone_id: str = "cn-hangzhou-h",
        hardened: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._host = host
        self._port = port
        self._clock = clock
        self._hardened = bool(hardened)
        self._static: dict[str, str] = {
            "instance-id": instance_id,
            "instance/instance-type": instance_type,
            "region-id": region_id,
            "zone-id": zone_id,
        }
        self._items: dict[str, str] = {}  # published items, by meta-data path
        self._tokens: dict[str, float] = {}  # token -> expiry (clock seconds)
        self._faults: list[tuple[int, str | None]] = []  # (status, path or None=any)
        self._hangs = 0
        self._release = asyncio.Event()
        self._hung = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self.token_puts = 0
        """Successful token PUTs served so far."""
        self.request_log: list[tuple[str, str, int]] = []
        """``(method, path, status)`` of every answered request, oldest first."""
        self.published_at: float | None = None
        """``time.time()`` when the current interruption notice was published; None if none."""

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``. Only after :meth:`start`."""
        if self._url is None:
            raise RuntimeError("FakeAliyunMetadata is not started; call 'await fake.start()' first")
        return self._url

    @property
    def hardened(self) -> bool:
        return self._hardened

    async def start(self) -> FakeAliyunMetadata:
        """Bind and serve. Raises RuntimeError if already started."""
        if self._runner is not None:
            raise RuntimeError("FakeAliyunMetadata is already started")
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
            await web.TCPSite(runner, self._host, self._port).start()
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

    async def __aenter__(self) -> FakeAliyunMetadata:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- what the "cloud" publishes --------------------------------------------------------

    def publish_interruption(self, action: str = "terminate", time: datetime | None = None) -> None:
        """Make ``instance/spot/termination-time`` appear.

        Args:
            action: ignored: ECS publishes no action (a recycled instance is
                released). Kept so every fake has the same signature.
            time: aware time at which ECS releases the instance; default now + 5 min.

        Raises:
            ValueError: naive ``time``.
        """
        del action  # not part of the ECS item
        when = time if time is not None else datetime.now(timezone.utc) + INTERRUPTION_LEAD
        self._items[TERMINATION_ITEM] = _stamp(when)
        self.published_at = _now()

    def publish_raw(self, item: str, body: str) -> None:
        """Test hook: serve ``body`` verbatim at ``/latest/meta-data/<item>`` (sets
        :attr:`published_at` when ``item`` is the termination-time item)."""
        key = item.strip("/")
        self._items[key] = body
        if key == TERMINATION_ITEM:
            self.published_at = _now()

    def clear(self) -> None:
        """Remove every published item (the notice included)."""
        self._items.clear()
        self.published_at = None

    # -- fault injection ---------------------------------------------------------------

    def fail_next(self, n: int = 1, status: int = 500, *, path: str | None = None) -> None:
        """Answer the next ``n`` requests with ``status``.

        Args:
            n: how many requests.
            status: an HTTP error status, 400..599.
            path: only requests for this exact path (e.g.
                ``"/latest/meta-data/instance/spot/termination-time"``); None = any
                request, token PUTs included.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400..599), got {status}")
        self._faults.extend([(status, path)] * n)

    def hang_next(self, n: int = 1) -> None:
        """Never answer the next ``n`` requests (until :meth:`aclose`): client timeouts."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._hangs += n

    async def wait_hanging(self) -> None:
        """Return once a request held by :meth:`hang_next` has arrived."""
        await self._hung.wait()

    def forget_tokens(self) -> None:
        """Invalidate every issued token, as a restarted metadata server would."""
        self._tokens.clear()

    # -- handlers --------------------------------------------------------------------

    async def _intercept(self, request: web.Request) -> web.Response | None:
        if self._hangs:
            self._hangs -= 1
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
        raw_ttl = request.headers.get(TTL_HEADER)
        ttl = int(raw_ttl) if raw_ttl is not None and raw_ttl.strip().isdecimal() else -1
        if not MIN_TOKEN_TTL_S <= ttl <= MAX_TOKEN_TTL_S:
            return self._answer(request, 400, "Bad Request")
        now = self._clock()
        self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
        token = secrets.token_urlsafe(42)
        self._tokens[token] = now + ttl
        self.token_puts += 1
        return self._answer(request, 200, token)

    def _token_ok(self, request: web.Request) -> bool:
        token = request.headers.get(TOKEN_HEADER)
        if token is None:
            return not self._hardened
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


def _now() -> float:
    return time.time()
