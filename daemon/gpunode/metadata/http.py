"""HTTP plumbing shared by the metadata dialects (``aws``, ``aliyun``, ``gcp``, ``azure``).

- :class:`HttpDialect`: base of every client. It owns the endpoint root, the request
  timeout, the ``aiohttp`` session (created on first use unless one is passed in;
  :meth:`HttpDialect.aclose` closes only a session it created), the injectable clock,
  the async context manager, and one request helper that turns transport errors and
  timeouts into :class:`~daemon.gpunode.metadata.base.MetadataUnavailable`.
- :class:`MetadataToken`: the IMDS-style session token of AWS IMDSv2
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html)
  and Alibaba ECS security hardening mode
  (https://www.alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata):
  ``PUT <token path>`` with a TTL header, the body is the token, every read sends it in
  a token header. Refreshed shortly before it expires; a rejected token is dropped,
  re-fetched and the read retried once (field practice: AWS Node Termination Handler).
  Each cloud's constants are one :class:`TokenProtocol` (the local fakes serve the same).
- :class:`ImdsDialect`: base of those two clients: a token, and text items under
  ``/latest/meta-data/`` (200: the value, 404: None).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

import aiohttp

from daemon.gpunode.metadata.base import MetadataUnavailable, Notice

__all__ = [
    "HttpDialect",
    "ImdsDialect",
    "META_DATA_PREFIX",
    "MetadataToken",
    "TokenProtocol",
    "Reply",
    "TOKEN_REFRESH_FRACTION",
    "TOKEN_REFRESH_MARGIN_S",
    "json_object",
    "text_or_none",
]

#: Refresh the token this long before it expires, or at 90 % of its TTL, whichever is earlier.
TOKEN_REFRESH_MARGIN_S = 15.0
TOKEN_REFRESH_FRACTION = 0.9
#: Where the IMDS-style endpoints (AWS, Alibaba) serve their items.
META_DATA_PREFIX = "/latest/meta-data/"


class Reply(NamedTuple):
    """One HTTP answer: status, body (UTF-8, undecodable bytes replaced) and headers."""

    status: int
    body: str
    headers: Mapping[str, str]


class HttpDialect:
    """Base of the metadata clients: endpoint, timeout, session ownership, clock, close.

    The constructor does no I/O. Subclasses set ``provider`` and pass ``example_url``
    (their default endpoint, quoted in the ``base_url`` error).

    Args:
        base_url: endpoint root (a trailing ``/`` is dropped).
        example_url: shown in the error for an empty ``base_url``.
        timeout_s: bound on each HTTP request, seconds, > 0.
        session: an existing ``aiohttp.ClientSession`` to use (not closed by us).
        clock: monotonic clock in seconds.
        validate: the subclass's own argument checks, run after the ``base_url`` check
            and before the ``timeout_s`` check.

    Raises:
        ValueError: empty ``base_url`` or ``timeout_s`` <= 0 (or what ``validate`` raises).
    """

    __slots__ = ("_base_url", "_timeout", "_session", "_owns_session", "_clock", "_closed")

    provider: str
    has_rebalance = False  # AwsImds: True

    def __init__(
        self,
        base_url: str,
        *,
        example_url: str,
        timeout_s: float,
        session: aiohttp.ClientSession | None,
        clock: Callable[[], float],
        validate: Callable[[], object] | None = None,
    ) -> None:
        if not base_url:
            raise ValueError(f"base_url must be a non-empty URL, e.g. {example_url!r}")
        if validate is not None:
            validate()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self._base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None
        self._clock = clock
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def poll_rebalance(self) -> Notice | None:
        """No rebalance recommendations on this cloud (:class:`~daemon.gpunode.metadata.aws.AwsImds` overrides)."""
        return None

    async def acknowledge(self, notice: Notice) -> None:
        """Nothing to approve on this cloud (:class:`~daemon.gpunode.metadata.azure.AzureScheduledEvents` overrides)."""

    async def aclose(self) -> None:
        """Close the session if this object created it. Idempotent."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None and self._owns_session and not session.closed:
            await session.close()

    @property
    def base_url(self) -> str:
        return self._base_url

    # -- HTTP ----------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; create a new one")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        params: dict[str, str] | None = None,
        data: str | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """One HTTP exchange, no redirects; transport failures become :class:`MetadataUnavailable`.

        ``timeout_s`` overrides the client's timeout for this request (and is then
        named in the timeout error).

        Raises:
            MetadataUnavailable: transport error or timeout (``from`` the cause).
            RuntimeError: called after :meth:`aclose`.
        """
        session = self._get_session()
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.request(
                method,
                self._base_url + path,
                params=params,
                headers=headers,
                data=data,
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                body = await resp.text(encoding="utf-8", errors="replace")
                return Reply(resp.status, body, resp.headers)
        except asyncio.TimeoutError as exc:
            after = "" if timeout_s is None else f" after {timeout_s:g} s"
            raise MetadataUnavailable(f"{method} {path}: timed out{after}") from exc
        except aiohttp.ClientError as exc:
            raise MetadataUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc


def json_object(body: str, what: str) -> dict[str, Any]:
    """``body`` parsed as a JSON object; else :class:`MetadataUnavailable` naming ``what``."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise MetadataUnavailable(f"{what}: body is not JSON: {body[:200]!r}") from exc
    if not isinstance(doc, dict):
        raise MetadataUnavailable(f"{what}: body is not a JSON object: {body[:200]!r}")
    return doc


def text_or_none(path: str, reply: Reply) -> str | None:
    """A read's result: the body on 200, None on 404, else :class:`MetadataUnavailable`."""
    if reply.status == 200:
        return reply.body
    if reply.status == 404:
        return None
    raise MetadataUnavailable(f"GET {path}: HTTP {reply.status}: {reply.body[:200]!r}")


@dataclass(frozen=True, slots=True)
class TokenProtocol:
    """The constants of one cloud's IMDS-style session token (see the module doc).

    Attributes:
        path: the token endpoint (``PUT``).
        ttl_header: request header carrying the TTL on the ``PUT``.
        token_header: request header carrying the token on reads.
        min_ttl_s, max_ttl_s: the TTLs the endpoint accepts, seconds (inclusive).
        rejected: read statuses that mean "token rejected" (drop, re-fetch, retry once).
    """

    path: str
    ttl_header: str
    token_header: str
    min_ttl_s: int
    max_ttl_s: int
    rejected: frozenset[int] = frozenset({401})

    def check_ttl(self, ttl_s: int) -> None:
        """Raise ValueError unless ``ttl_s`` is an int (not a bool) in ``min_ttl_s..max_ttl_s``."""
        lo, hi = self.min_ttl_s, self.max_ttl_s
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int):
            raise ValueError(f"token_ttl_s must be an int in {lo}..{hi}, got {ttl_s!r}")
        if not lo <= ttl_s <= hi:
            raise ValueError(f"token_ttl_s must be in {lo}..{hi} seconds, got {ttl_s}")


class MetadataToken:
    """An IMDS-style session token used by one :class:`HttpDialect` (see module doc).

    Concurrent reads share one token (one ``PUT`` at a time, under a lock). It is
    refreshed at the earlier of 90 % of the TTL and 15 s before expiry (for TTLs under
    ~15 s that means a fresh token for every read), counted from before the ``PUT``.

    Args:
        http: the client whose session, clock and request helper are used.
        protocol: the cloud's token constants.
        ttl_s: TTL requested, seconds (validated by the caller, :meth:`TokenProtocol.check_ttl`).
    """

    __slots__ = ("_http", "_protocol", "_ttl_s", "_value", "_refresh_at", "_lock")

    def __init__(self, http: HttpDialect, *, protocol: TokenProtocol, ttl_s: int) -> None:
        self._http = http
        self._protocol = protocol
        self._ttl_s = ttl_s
        self._value: str | None = None
        self._refresh_at = 0.0
        self._lock = asyncio.Lock()

    def clear(self) -> None:
        """Forget the token (on close)."""
        self._value = None

    async def get(self, path: str) -> Reply:
        """GET ``path`` with a valid token; the reply, whatever its status, unless rejected.

        A rejected token (expired, or forgotten by a restarted endpoint) is dropped, a
        new one fetched and the read retried once.

        Raises:
            MetadataUnavailable: the token ``PUT`` failed, the token was rejected again
                after a fresh one, or as :meth:`HttpDialect._request`.
        """
        for attempt in (1, 2):
            token = await self._ensure()
            reply = await self._http._request("GET", path, headers={self._protocol.token_header: token})
            if reply.status not in self._protocol.rejected:
                return reply
            self._drop(token)
            if attempt == 2:
                raise MetadataUnavailable(f"GET {path}: {reply.status} again after a fresh token")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _ensure(self) -> str:
        """Return a token that is not due for refresh, fetching one if needed."""
        token = self._value
        if token is not None and self._http._clock() < self._refresh_at:
            return token
        async with self._lock:
            # Another task may have refreshed it while we waited for the lock.
            token = self._value
            if token is not None and self._http._clock() < self._refresh_at:
                return token
            return await self._fetch()

    async def _fetch(self) -> str:
        ttl = self._ttl_s
        requested_at = self._http._clock()  # before the PUT: the token's life starts no earlier
        path = self._protocol.path
        status, body, _ = await self._http._request("PUT", path, headers={self._protocol.ttl_header: str(ttl)})
        if status != 200:
            raise MetadataUnavailable(f"PUT {path}: HTTP {status}: {body[:200]!r}")
        if not body:
            raise MetadataUnavailable(f"PUT {path}: empty token")
        lifetime = min(TOKEN_REFRESH_FRACTION * ttl, ttl - TOKEN_REFRESH_MARGIN_S)
        self._value = body
        self._refresh_at = requested_at + max(0.0, lifetime)
        return body

    def _drop(self, token: str) -> None:
        # Only drop the token the failed request used; a concurrent task may already
        # hold a newer one.
        if self._value == token:
            self._value = None


class ImdsDialect(HttpDialect):
    """Base of the IMDS-style clients (AWS IMDSv2, Alibaba ECS): a :class:`MetadataToken`
    of the subclass's :attr:`TOKEN_PROTOCOL`, and text items under ``/latest/meta-data/``.
    The constructor does no I/O.

    Args:
        base_url: endpoint root; default the subclass's :attr:`DEFAULT_BASE_URL`.
        token_ttl_s: TTL requested for tokens, seconds, within the protocol's bounds
            (default its maximum).
        timeout_s: bound on each HTTP request (token PUT or read), seconds, > 0.
        session: an existing ``aiohttp.ClientSession`` to use (not closed by us).
        clock: monotonic clock in seconds deciding when to refresh the token;
            injectable for tests.

    Raises:
        ValueError: empty ``base_url``, ``token_ttl_s`` out of bounds, or ``timeout_s`` <= 0.
    """

    __slots__ = ("_token",)

    TOKEN_PROTOCOL: ClassVar[TokenProtocol]
    DEFAULT_BASE_URL: ClassVar[str]

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token_ttl_s: int | None = None,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        protocol = self.TOKEN_PROTOCOL
        ttl_s = protocol.max_ttl_s if token_ttl_s is None else token_ttl_s
        super().__init__(self.DEFAULT_BASE_URL if base_url is None else base_url, example_url=self.DEFAULT_BASE_URL,
                         timeout_s=timeout_s, session=session, clock=clock, validate=lambda: protocol.check_ttl(ttl_s))
        self._token = MetadataToken(self, protocol=protocol, ttl_s=ttl_s)

    async def aclose(self) -> None:
        """Drop the token and close the session if this object created it. Idempotent."""
        self._token.clear()
        await super().aclose()

    async def get_metadata(self, item: str) -> str | None:
        """Read one item under ``/latest/meta-data/`` (e.g. ``"instance-id"``).

        Returns:
            The text value, or ``None`` if the item does not exist (404).

        Raises:
            MetadataUnavailable: as the subclass's ``poll``.
            RuntimeError: called after :meth:`aclose`.
        """
        return await self._read(META_DATA_PREFIX + item.lstrip("/"))

    async def _read(self, path: str) -> str | None:
        """GET ``path`` with a valid token: body on 200, None on 404.

        A rejected token (expired, or forgotten by a restarted endpoint) is dropped, a
        new one fetched and the read retried once; a second rejection is an error.
        """
        return text_or_none(path, await self._token.get(path))
