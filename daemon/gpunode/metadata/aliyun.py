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

Token handling (hardened mode) follows :mod:`daemon.gpunode.metadata.aws`: refresh shortly
before expiry (same margin), re-fetch once on rejection; an expired token is routine.
In normal mode (``hardened=False``) reads carry no token and a 401/403 is
:class:`MetadataUnavailable` (the instance may require hardened mode).

Example::

    async with AliyunMetadata(hardened=True) as md:   # http://100.100.100.200
        notice = await md.poll()   # None, or Notice(kind=INTERRUPTION, action="terminate")
"""

from __future__ import annotations

from typing import Any

from daemon.gpunode.metadata.base import MetadataUnavailable, Notice, NoticeKind, parse_utc
from daemon.gpunode.metadata.http import META_DATA_PREFIX, ImdsDialect, TokenProtocol, text_or_none

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
    "TOKEN_PROTOCOL",
]

DEFAULT_BASE_URL = "http://100.100.100.200"
TOKEN_PATH = "/latest/api/token"
TERMINATION_TIME_PATH = META_DATA_PREFIX + "instance/spot/termination-time"
TTL_HEADER = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aliyun-ecs-metadata-token"
MIN_TOKEN_TTL_S = 1
MAX_TOKEN_TTL_S = 21600
#: ECS publishes no action: a recycled preemptible instance is released.
TERMINATE_ACTION = "terminate"

#: Statuses taken to mean "token rejected" in hardened mode (UNCONFIRMED; see module doc).
_TOKEN_REJECTED = frozenset({401, 403})
#: Same refresh policy as the AWS dialect (:class:`daemon.gpunode.metadata.http.MetadataToken`).
TOKEN_PROTOCOL = TokenProtocol(TOKEN_PATH, TTL_HEADER, TOKEN_HEADER, MIN_TOKEN_TTL_S, MAX_TOKEN_TTL_S,
                               rejected=_TOKEN_REJECTED)


class AliyunMetadata(ImdsDialect):
    """ECS metadata client implementing the metadata dialect (``provider = "aliyun"``).

    The constructor does no I/O. An HTTP session is created on first use unless one
    is passed in; :meth:`aclose` closes only a session this object created. Every
    request is bounded by ``timeout_s``. Concurrent calls share one token (one ``PUT``
    at a time).

    Args:
        base_url: endpoint root, default ``http://100.100.100.200``; tests pass a
            :class:`daemon.providers.local_metadata.aliyun.FakeAliyunMetadata` URL.
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

    __slots__ = ("_hardened",)

    provider = "aliyun"
    TOKEN_PROTOCOL = TOKEN_PROTOCOL
    DEFAULT_BASE_URL = DEFAULT_BASE_URL

    def __init__(self, base_url: str | None = None, *, hardened: bool = False, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)  # token_ttl_s, timeout_s, session, clock: ImdsDialect's
        self._hardened = bool(hardened)

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

    async def _read(self, path: str) -> str | None:
        """GET ``path``: body on 200, None on 404.

        Hardened mode: a 401/403 means the token expired or was forgotten: drop it,
        fetch a new one and retry once. A second rejection is an error.
        """
        if self._hardened:
            return await super()._read(path)
        reply = await self._request("GET", path, headers={})
        if reply.status in _TOKEN_REJECTED:
            raise MetadataUnavailable(
                f"GET {path}: HTTP {reply.status} in normal mode "
                "(does the instance require security hardening mode?)"
            )
        return text_or_none(path, reply)


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
    return Notice.build(provider="aliyun", kind=NoticeKind.INTERRUPTION, action=TERMINATE_ACTION, deadline=deadline,
                        raw=raw)
