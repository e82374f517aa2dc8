"""Alibaba Cloud ECS instance metadata dialect: preemptible (spot) instance interruption
notices, read by the node agent.

Protocol, from the ECS documentation:

- https://www.alibabacloud.com/help/en/ecs/user-guide/best-practices-for-preemptible-instances
  and https://www.alibabacloud.com/help/en/ecs/use-cases/query-the-interruption-events-of-preemptible-instances:
  ``/latest/meta-data/instance/spot/termination-time`` is ``404`` while the instance
  is usable; once it is to be recycled the item is the plain-text UTC time
  ``yyyy-MM-ddTHH:mm:ssZ`` (e.g. ``2015-01-05T18:02:00Z``) at which ECS releases it,
  set about 5 minutes ahead. There is no action field: the instance is released.
- https://www.alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata
  (security hardening mode): ``PUT http://100.100.100.200/latest/api/token`` with
  ``X-aliyun-ecs-metadata-token-ttl-seconds: 1..21600``; the token is the body; reads
  send ``X-aliyun-ecs-metadata-token: <token>``. A token is usable until it expires.
  Instances created with ``HttpTokens=required`` accept only this mode
  (https://www.alibabacloud.com/help/en/ecs/user-guide/access-instance-metadata-using-hardened-only-mode).
- UNCONFIRMED (no authoritative source found): the status codes of a rejected token.
  We assume IMDSv2-like behaviour: ``401`` for a missing/expired/invalid token, ``403``
  possibly for a refused one, ``400`` for a bad TTL. Because it is unconfirmed, a
  hardened client treats *both* 401 and 403 as "token rejected": drop it, fetch a
  new one, retry the read once.

Token handling (hardened mode) follows :mod:`daemon.metadata.aws`: refresh shortly
before expiry (same margin), re-fetch once on rejection; an expired token is routine.
In normal mode (``hardened=False``) reads carry no token and a 401/403 is
:class:`MetadataUnavailable` (the instance may require hardened mode).

Example::

    async with AliyunMetadata(hardened=True) as md:   # http://100.100.100.200
        notice = await md.poll()   # None, or Notice(kind=INTERRUPTION, action="terminate")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from daemon.metadata.aws import TOKEN_REFRESH_FRACTION, TOKEN_REFRESH_MARGIN_S
from daemon.metadata.base import MetadataUnavailable, Notice, NoticeKind, parse_utc

__all__ = [
    "AliyunMetadata",
    "DEFAULT_BASE_URL",
    "TOKEN_PATH",
    "META_DATA_PREFIX",
    "TERMINATION_TIME_PATH",
    "TTL_HEADER",
    "TOKEN_HEADER",
    "MIN_TOKEN_TTL_S",
    "MAX_TOKEN_TTL_S",
    "TERMINATE_ACTION",
]

DEFAULT_BASE_URL = "http://100.100.100.200"
TOKEN_PATH = "/latest/api/token"
META_DATA_PREFIX = "/latest/meta-data/"
TERMINATION_TIME_PATH = META_DATA_PREFIX + "instance/spot/termination-time"
TTL_HEADER = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aliyun-ecs-metadata-token"
MIN_TOKEN_TTL_S = 1
MAX_TOKEN_TTL_S = 21600
#: ECS publishes no action: a recycled preemptible instance is released.
TERMINATE_ACTION = "terminate"

#: Statuses taken to mean "token rejected" in hardened mode (UNCONFIRMED; see module doc).
_TOKEN_REJECTED = frozenset({401, 403})


class AliyunMetadata:
    """ECS metadata client implementing the metadata dialect (``provider = "aliyun"``).

    The constructor does no I/O. An HTTP session is created on first use unless one
    is passed in; :meth:`aclose` closes only a session this object created. Every
    request is bounded by ``timeout_s``. Concurrent calls share one token (one ``PUT``
    at a time).

    Args:
        base_url: endpoint root, default ``http://100.100.100.200``; tests pass a
            :class:`daemon.metadata.fake_aliyun.FakeAliyunMetadata` URL.
        hardened: use security hardening mode (token ``PUT``, token on every read).
        token_ttl_s: TTL requested for tokens, seconds, 1..21600 (hardened mode).
        timeout_s: bound on each HTTP request (token PUT or read), seconds, > 0.
        session: an existing ``aiohttp.ClientSession`` to use (not closed by us).
        clock: monotonic clock in seconds deciding when to refresh the token;
            injectable for tests.

    Raises:
        ValueError: ``token_ttl_s`` outside 1..21600, ``timeout_s`` <= 0, or an
            empty ``base_url``.
    """

    __slots__ = (
        "_base_url",
        "_hardened",
        "_token_ttl_s",
        "_timeout",
        "_session",
        "_owns_session",
        "_clock",
        "_token",
        "_token_refresh_at",
        "_token_lock",
        "_closed",
    )

    provider = "aliyun"

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        hardened: bool = False,
        token_ttl_s: int = MAX_TOKEN_TTL_S,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not base_url:
            raise ValueError("base_url must be a non-empty URL, e.g. 'http://100.100.100.200'")
        if isinstance(token_ttl_s, bool) or not isinstance(token_ttl_s, int):
            raise ValueError(f"token_ttl_s must be an int in 1..21600, got {token_ttl_s!r}")
        if not MIN_TOKEN_TTL_S <= token_ttl_s <= MAX_TOKEN_TTL_S:
            raise ValueError(f"token_ttl_s must be in 1..21600 seconds, got {token_ttl_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self._base_url = base_url.rstrip("/")
        self._hardened = bool(hardened)
        self._token_ttl_s = token_ttl_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None
        self._clock = clock
        self._token: str | None = None
        self._token_refresh_at = 0.0
        self._token_lock = asyncio.Lock()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> AliyunMetadata:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drop the token and close the session if this object created it. Idempotent."""
        self._closed = True
        self._token = None
        session, self._session = self._session, None
        if session is not None and self._owns_session and not session.closed:
            await session.close()

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def hardened(self) -> bool:
        return self._hardened

    # -- the dialect ---------------------------------------------------------------

    async def poll(self) -> Notice | None:
        """Read ``instance/spot/termination-time`` once.

        Returns:
            ``None`` while the instance is usable (404); else an interruption
            :class:`Notice` with ``action="terminate"``, ``deadline`` the served
            time and ``raw`` the body as served. Repeated polls of the same body
            give equal notices (same ``id``).

        Raises:
            MetadataUnavailable: transport error, timeout, 5xx, any other unexpected
                status, a token rejected again after one re-fetch (hardened), a
                401/403 in normal mode, or a body that is not a UTC timestamp.
            RuntimeError: called after :meth:`aclose`.
        """
        raw = await self._read(TERMINATION_TIME_PATH)
        if raw is None:
            return None
        return _parse_termination_time(raw)

    async def get_metadata(self, item: str) -> str | None:
        """Read one item under ``/latest/meta-data/`` (e.g. ``"instance-id"``,
        ``"instance/instance-type"``, ``"region-id"``, ``"zone-id"``).

        Returns:
            The text value, or ``None`` if the item does not exist (404).

        Raises:
            MetadataUnavailable: as :meth:`poll`.
            RuntimeError: called after :meth:`aclose`.
        """
        return await self._read(META_DATA_PREFIX + item.lstrip("/"))

    # -- HTTP ----------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("AliyunMetadata is closed; create a new one")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _read(self, path: str) -> str | None:
        """GET ``path``: body on 200, None on 404.

        Hardened mode: a 401/403 means the token expired or was forgotten: drop it,
        fetch a new one and retry once. A second rejection is an error.
        """
        if not self._hardened:
            status, body = await self._request("GET", path, headers={})
            if status in _TOKEN_REJECTED:
                raise MetadataUnavailable(
                    f"GET {path}: HTTP {status} in normal mode "
                    "(does the instance require security hardening mode?)"
                )
            return _result(path, status, body)
        for attempt in (1, 2):
            token = await self._ensure_token()
            status, body = await self._request("GET", path, headers={TOKEN_HEADER: token})
            if status not in _TOKEN_REJECTED:
                return _result(path, status, body)
            self._drop_token(token)
            if attempt == 2:
                raise MetadataUnavailable(f"GET {path}: {status} again after a fresh token")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _ensure_token(self) -> str:
        """Return a token that is not due for refresh, fetching one if needed."""
        token = self._token
        if token is not None and self._clock() < self._token_refresh_at:
            return token
        async with self._token_lock:
            token = self._token  # another task may have refreshed it meanwhile
            if token is not None and self._clock() < self._token_refresh_at:
                return token
            return await self._fetch_token()

    async def _fetch_token(self) -> str:
        ttl = self._token_ttl_s
        requested_at = self._clock()  # before the PUT: the token's life starts no earlier
        status, body = await self._request("PUT", TOKEN_PATH, headers={TTL_HEADER: str(ttl)})
        if status != 200:
            raise MetadataUnavailable(f"PUT {TOKEN_PATH}: HTTP {status}: {body[:200]!r}")
        if not body:
            raise MetadataUnavailable(f"PUT {TOKEN_PATH}: empty token")
        # Same policy as the AWS dialect: the earlier of 90 % of the TTL and 15 s
        # before expiry (short TTLs mean a fresh token per read).
        lifetime = min(TOKEN_REFRESH_FRACTION * ttl, ttl - TOKEN_REFRESH_MARGIN_S)
        self._token = body
        self._token_refresh_at = requested_at + max(0.0, lifetime)
        return body

    def _drop_token(self, token: str) -> None:
        # Only the token the failed request used; a concurrent task may hold a newer one.
        if self._token == token:
            self._token = None

    async def _request(self, method: str, path: str, *, headers: dict[str, str]) -> tuple[int, str]:
        """One HTTP exchange; transport failures become :class:`MetadataUnavailable`."""
        session = self._get_session()
        try:
            async with session.request(
                method,
                self._base_url + path,
                headers=headers,
                timeout=self._timeout,
                allow_redirects=False,
            ) as resp:
                return resp.status, await resp.text(encoding="utf-8", errors="replace")
        except asyncio.TimeoutError as exc:
            raise MetadataUnavailable(f"{method} {path}: timed out") from exc
        except aiohttp.ClientError as exc:
            raise MetadataUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc


def _result(path: str, status: int, body: str) -> str | None:
    if status == 200:
        return body
    if status == 404:
        return None
    raise MetadataUnavailable(f"GET {path}: HTTP {status}: {body[:200]!r}")


def _parse_termination_time(raw: str) -> Notice:
    """``2015-01-05T18:02:00Z`` -> interruption notice (action ``"terminate"``).

    Accepts any ISO-8601 time with an explicit offset (the documents show ``Z``);
    a naive time or anything else is a malformed body.
    """
    try:
        deadline = parse_utc(raw)
    except ValueError as exc:
        raise MetadataUnavailable(
            f"instance/spot/termination-time: not a UTC timestamp: {raw[:200]!r}"
        ) from exc
    return Notice.build(
        provider=AliyunMetadata.provider,
        kind=NoticeKind.INTERRUPTION,
        action=TERMINATE_ACTION,
        deadline=deadline,
        raw=raw,
    )
