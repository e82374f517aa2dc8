"""What the local metadata fakes (``aws``, ``aliyun``, ``gcp``, ``azure`` of this
package) share: the aiohttp server lifecycle, the test hooks for fault injection
(:meth:`FakeEndpoint.fail_next`, :meth:`FakeEndpoint.hang_next`,
:meth:`FakeEndpoint.wait_hanging`) applied to every request before its handler runs,
``request_log`` and ``published_at``; and, for the two IMDS-style fakes (AWS and
Alibaba Cloud ECS, which both hand out session tokens from ``PUT /latest/api/token``),
:class:`TokenStore` and :class:`TokenMetadataEndpoint`.

The protocols themselves, and the documents they follow, are described in each fake's
module.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any, ClassVar, Self

from aiohttp import web

from daemon.gpunode.metadata.http import META_DATA_PREFIX, TokenProtocol

__all__ = ["FakeEndpoint", "TokenMetadataEndpoint", "TokenStore", "utc_stamp"]

_TEXT = "text/plain"


def utc_stamp(when: datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SSZ`` (UTC, whole seconds), the time format of the AWS and
    ECS metadata items."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"time must be timezone-aware (UTC), got {when!r}")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeEndpoint:
    """An aiohttp server on ``host`` with the test hooks every fake offers.

    Lifecycle: the constructor does no I/O; ``await start()`` binds (``port=0`` picks
    a free port) and sets :attr:`url`; ``await aclose()`` stops it (releasing requests
    held by :meth:`hang_next` first) and is idempotent and safe after a failed start.
    Also an async context manager.

    ``sock``: serve on this listening socket instead of binding ``host:port``;
    ``extra_routes(app)``: adds routes of its own to the app (called after :meth:`_setup`).

    Subclasses add their routes in :meth:`_setup` and may override :meth:`_answer`
    (how a response is built and logged), :meth:`_error_body` (the body of an injected
    fault) and :meth:`_intercept` (checks every request passes before its handler).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, clock: Callable[[], float] = time.monotonic,
                 sock: socket.socket | None = None,
                 extra_routes: Callable[[web.Application], None] | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._host = host
        self._port = port
        self._clock = clock
        self._sock = sock  # a listening socket to serve on instead of host:port (an instance's own endpoint)
        self._extra_routes = extra_routes  # more routes on the same app (the local instance's admin route)
        self._faults: list[tuple[int, str | None]] = []  # (status, path or None=any), in order
        self._hangs: list[str | None] = []  # path or None=any, in order
        self._release = asyncio.Event()
        self._hung = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self.request_log: list[tuple[Any, ...]] = []
        """Every answered request, oldest first (the tuple's form is each fake's)."""
        self.published_at: float | None = None
        """``time.time()`` of the current notice's publish; None if none."""

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``. Only after :meth:`start`."""
        if self._url is None:
            raise RuntimeError(f"{type(self).__name__} is not started; call 'await fake.start()' first")
        return self._url

    async def start(self) -> Self:
        """Bind and serve. Raises RuntimeError if already started."""
        if self._runner is not None:
            raise RuntimeError(f"{type(self).__name__} is already started")
        app = web.Application(middlewares=[self._middleware])
        self._release = asyncio.Event()
        self._hung = asyncio.Event()
        self._setup(app)
        if self._extra_routes is not None:
            self._extra_routes(app)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        self._runner = runner
        try:
            await runner.setup()
            site = (web.TCPSite(runner, self._host, self._port) if self._sock is None
                    else web.SockSite(runner, self._sock))
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

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _setup(self, app: web.Application) -> None:
        """Add the routes (and reset per-run state); called by :meth:`start`."""
        raise NotImplementedError

    # -- fault injection ---------------------------------------------------------------

    def fail_next(self, n: int = 1, status: int = 500, *, path: str | None = None) -> None:
        """Answer the next ``n`` requests with ``status``.

        Args:
            n: how many requests.
            status: an HTTP error status, 400..599.
            path: only requests for this exact path (e.g. the notice item's); None =
                any request.
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

    # -- every request ---------------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        refused = await self._intercept(request)
        if refused is not None:
            return refused
        return await handler(request)

    async def _intercept(self, request: web.Request) -> web.Response | None:
        """A held (:meth:`hang_next`) or failed (:meth:`fail_next`) answer, or None."""
        for i, path in enumerate(self._hangs):
            if path is None or path == request.path:
                del self._hangs[i]
                self._hung.set()
                await self._release.wait()
                return self._answer(request, 503, self._error_body("shutting down"))
        for i, (status, path) in enumerate(self._faults):
            if path is None or path == request.path:
                del self._faults[i]
                return self._answer(request, status, self._error_body(f"injected fault {status}"))
        return None

    def _error_body(self, message: str) -> Any:
        return message

    def _answer(self, request: web.Request, status: int, body: Any) -> web.Response:
        self.request_log.append((request.method, request.path, status))
        return web.Response(status=status, text=body, content_type=_TEXT)


class TokenStore:
    """Session tokens, each valid until its expiry on ``clock`` (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tokens: dict[str, float] = {}  # token -> expiry (clock seconds)

    def issue(self, ttl: int) -> str:
        """A new token valid for ``ttl`` seconds (expired ones are dropped)."""
        now = self._clock()
        self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
        token = secrets.token_urlsafe(42)
        self._tokens[token] = now + ttl
        return token

    def valid(self, token: str) -> bool:
        expiry = self._tokens.get(token)
        if expiry is None:
            return False
        if self._clock() >= expiry:
            del self._tokens[token]
            return False
        return True

    def clear(self) -> None:
        self._tokens.clear()


class TokenMetadataEndpoint(FakeEndpoint):
    """An IMDS-style metadata server: ``PUT`` on the token path with a TTL header in
    ``min_ttl_s..max_ttl_s`` (the client's :class:`~daemon.gpunode.metadata.http.TokenProtocol`)
    issues a token (else 400; another method there is 405); ``GET /latest/meta-data/<item>``
    serves published items, then ``static`` ones, as text (unknown: 404). A read with an
    invalid or expired token is 401, and so is one without a token when
    :meth:`_token_required`. Text answers throughout.

    Subclasses set :attr:`PROTOCOL` and :meth:`_token_required`, and may set
    :attr:`REFUSE_FORWARDED_TOKEN_PUT` (answer 403 to a token PUT carrying
    ``X-Forwarded-For``) and :attr:`ECHO_TTL` (echo the TTL header in the token's answer).
    """

    PROTOCOL: ClassVar[TokenProtocol]
    REFUSE_FORWARDED_TOKEN_PUT: ClassVar[bool] = False
    ECHO_TTL: ClassVar[bool] = False

    def __init__(self, *, static: dict[str, str], **endpoint: Any) -> None:
        super().__init__(**endpoint)
        self._static = static
        self._items: dict[str, str] = {}  # published items, by meta-data path
        self._tokens = TokenStore(self._clock)
        self.token_puts = 0
        """Successful token PUTs served so far."""

    def _token_required(self) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        """Remove every published item (the notice included)."""
        self._items.clear()
        self.published_at = None

    def forget_tokens(self) -> None:
        """Invalidate every issued token, as a restarted metadata server would."""
        self._tokens.clear()

    def _setup(self, app: web.Application) -> None:
        app.router.add_route("PUT", self.PROTOCOL.path, self._handle_token)
        app.router.add_route("GET", META_DATA_PREFIX + "{item:.*}", self._handle_get)
        app.router.add_route("*", "/{tail:.*}", self._handle_other)

    async def _handle_token(self, request: web.Request) -> web.Response:
        if self.REFUSE_FORWARDED_TOKEN_PUT and "X-Forwarded-For" in request.headers:
            return self._answer(request, 403, "Forbidden")
        raw_ttl = request.headers.get(self.PROTOCOL.ttl_header)
        ttl = int(raw_ttl) if raw_ttl is not None and raw_ttl.strip().isdecimal() else -1
        if not self.PROTOCOL.min_ttl_s <= ttl <= self.PROTOCOL.max_ttl_s:
            return self._answer(request, 400, "Bad Request")
        token = self._tokens.issue(ttl)
        self.token_puts += 1
        resp = self._answer(request, 200, token)
        if self.ECHO_TTL:
            resp.headers[self.PROTOCOL.ttl_header] = str(ttl)
        return resp

    def _token_ok(self, request: web.Request) -> bool:
        token = request.headers.get(self.PROTOCOL.token_header)
        if token is None:
            return not self._token_required()
        return self._tokens.valid(token)

    async def _handle_get(self, request: web.Request) -> web.Response:
        if not self._token_ok(request):
            return self._answer(request, 401, "Unauthorized")
        item = request.match_info["item"].strip("/")
        value = self._items.get(item, self._static.get(item))
        if value is None:
            return self._answer(request, 404, "Not Found")
        return self._answer(request, 200, value)

    async def _handle_other(self, request: web.Request) -> web.Response:
        if request.path == self.PROTOCOL.path:
            return self._answer(request, 405, "Method Not Allowed")
        if request.method == "GET" and not self._token_ok(request):
            return self._answer(request, 401, "Unauthorized")
        return self._answer(request, 404, "Not Found")
