"""AWS EC2 instance metadata (IMDSv2) dialect: spot interruption notices and rebalance
recommendations, read by the node agent.

Protocol (IMDSv2, session-oriented), from the EC2 User Guide:

- https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
  (Use IMDSv2) and
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html:
  ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600``;
  the token is the response body. Reads send ``X-aws-ec2-metadata-token: <token>``.
  An expired or invalid token gets ``401`` (so does a missing one when the instance
  requires IMDSv2); ``403`` means the endpoint is disabled or the request is not
  allowed; ``404`` means the item does not exist. Every value is ``text/plain``.
- https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html:
  ``/latest/meta-data/spot/instance-action`` is ``404`` until an interruption is
  pending, then ``{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}``,
  two minutes ahead (hibernate: no lead). AWS recommends checking every 5 s; notices
  are best effort.
- https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html:
  ``/latest/meta-data/events/recommendations/rebalance`` is ``404`` until a
  recommendation is emitted, then ``{"noticeTime": "2020-10-27T08:22:00Z"}``.

Token handling follows field practice (AWS Node Termination Handler): the token is
refreshed shortly before it expires, and a ``401`` drops it, fetches a new one and
retries the read once; an expired token is routine, not an error.

Example::

    async with AwsImds() as imds:          # http://169.254.169.254
        notice = await imds.poll()          # None, or Notice(kind=INTERRUPTION, ...)
"""

from __future__ import annotations

from daemon.gpunode.metadata.base import (
    MetadataUnavailable,
    Notice,
    NoticeKind,
    parse_utc,
)
from daemon.gpunode.metadata.http import META_DATA_PREFIX, ImdsDialect, TokenProtocol, json_object

__all__ = [
    "AwsImds",
    "DEFAULT_BASE_URL",
    "TOKEN_PATH",
    "INSTANCE_ACTION_PATH",
    "REBALANCE_PATH",
    "TTL_HEADER",
    "TOKEN_HEADER",
    "MIN_TOKEN_TTL_S",
    "MAX_TOKEN_TTL_S",
    "KNOWN_ACTIONS",
    "TOKEN_PROTOCOL",
]

DEFAULT_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = META_DATA_PREFIX + "spot/instance-action"
REBALANCE_PATH = META_DATA_PREFIX + "events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MIN_TOKEN_TTL_S = 1
MAX_TOKEN_TTL_S = 21600
TOKEN_PROTOCOL = TokenProtocol(TOKEN_PATH, TTL_HEADER, TOKEN_HEADER, MIN_TOKEN_TTL_S, MAX_TOKEN_TTL_S)

#: Actions the spot interruption document lists. Others are accepted (see ``_parse_instance_action``).
KNOWN_ACTIONS = frozenset({"terminate", "stop", "hibernate"})


class AwsImds(ImdsDialect):
    """IMDSv2 client implementing the metadata dialect (``provider = "aws"``).

    The constructor does no I/O. An HTTP session is created on first use unless one
    is passed in; :meth:`aclose` closes only a session this object created. Every
    request is bounded by ``timeout_s``; nothing blocks the event loop. Concurrent
    calls share one token (one ``PUT`` at a time).

    Args:
        base_url: endpoint root, default ``http://169.254.169.254``; tests pass a
            :class:`daemon.providers.local_metadata.aws.FakeImds` URL.
        token_ttl_s: TTL requested for session tokens, seconds, 1..21600.
        timeout_s: bound on each HTTP request (token PUT or read), seconds, > 0.
        session: an existing ``aiohttp.ClientSession`` to use (not closed by us).
        clock: monotonic clock in seconds, used to decide when to refresh the token;
            injectable for tests.

    Raises:
        ValueError: ``token_ttl_s`` outside 1..21600, ``timeout_s`` <= 0, or an
            empty ``base_url``.
    """

    __slots__ = ()

    provider = "aws"
    has_rebalance = True
    TOKEN_PROTOCOL = TOKEN_PROTOCOL
    DEFAULT_BASE_URL = DEFAULT_BASE_URL

    # -- the dialect ---------------------------------------------------------------

    async def poll(self) -> Notice | None:
        """Read ``spot/instance-action`` once.

        Returns:
            ``None`` while nothing is pending (404); else an interruption
            :class:`Notice` whose ``action`` is the document's action and whose
            ``deadline`` is its ``time``. Repeated polls of the same document give
            equal notices (same ``id``).

        Raises:
            MetadataUnavailable: transport error, timeout, 5xx, 403, a second 401
                after a token refresh, or a body that is not the documented JSON.
            RuntimeError: called after :meth:`aclose`.
        """
        raw = await self._read(INSTANCE_ACTION_PATH)
        if raw is None:
            return None
        return _parse_instance_action(raw)

    async def poll_rebalance(self) -> Notice | None:
        """Read ``events/recommendations/rebalance`` once.

        Returns:
            ``None`` while none was emitted (404); else a rebalance :class:`Notice`
            (``action`` and ``deadline`` are ``None``: a recommendation has no
            deadline; its ``noticeTime`` is validated and kept in ``raw``).

        Raises:
            MetadataUnavailable: as :meth:`poll`.
            RuntimeError: called after :meth:`aclose`.
        """
        raw = await self._read(REBALANCE_PATH)
        if raw is None:
            return None
        return _parse_rebalance(raw)


def _parse_instance_action(raw: str) -> Notice:
    """``{"action": ..., "time": ...}`` -> interruption notice.

    An action outside terminate/stop/hibernate but otherwise well formed is still an
    interruption: the item only exists when one is pending, and missing a real notice
    costs a job far more than a needless checkpoint.
    """
    doc = json_object(raw, "spot/instance-action")
    action = doc.get("action")
    if not isinstance(action, str) or not action:
        raise MetadataUnavailable(f"spot/instance-action: no 'action' string: {raw[:200]!r}")
    try:
        deadline = parse_utc(doc.get("time"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise MetadataUnavailable(f"spot/instance-action: bad 'time': {raw[:200]!r}") from exc
    return Notice.build(provider="aws", kind=NoticeKind.INTERRUPTION, action=action, deadline=deadline, raw=raw)


def _parse_rebalance(raw: str) -> Notice:
    """``{"noticeTime": ...}`` -> rebalance notice (no action, no deadline)."""
    doc = json_object(raw, "events/recommendations/rebalance")
    try:
        parse_utc(doc.get("noticeTime"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise MetadataUnavailable(
            f"events/recommendations/rebalance: bad 'noticeTime': {raw[:200]!r}"
        ) from exc
    return Notice.build(provider="aws", kind=NoticeKind.REBALANCE, action=None, deadline=None, raw=raw)
