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

import json
import time as _time
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from daemon.gpunode.metadata.aws import KNOWN_ACTIONS, TOKEN_PROTOCOL
from daemon.providers.local_metadata.endpoint import TokenMetadataEndpoint, utc_stamp as _fmt

__all__ = ["FakeImds", "INTERRUPTION_LEAD"]

#: Lead time of a spot interruption notice (hibernate: none).
INTERRUPTION_LEAD = timedelta(minutes=2)


class FakeImds(TokenMetadataEndpoint):
    """An aiohttp server on ``host`` speaking IMDSv2.

    Lifecycle and test hooks: see :class:`~daemon.providers.local_metadata.endpoint.FakeEndpoint`.

    Args:
        instance_id, instance_type, availability_zone: values of the
            ``instance-id``, ``instance-type`` and ``placement/availability-zone`` items.
        host, port: where to listen; port 0 = ephemeral.
        clock: monotonic seconds, used for token expiry; tests pass a settable one.
        http_tokens: ``"required"`` (IMDSv2 only: a read without a token is 401) or
            ``"optional"`` (a read without a token is served; an invalid one is 401).

    ``request_log`` holds ``(method, path, status)`` of every answered request.
    """

    PROTOCOL = TOKEN_PROTOCOL
    REFUSE_FORWARDED_TOKEN_PUT = True
    ECHO_TTL = True

    def __init__(
        self,
        *,
        instance_id: str = "i-0123456789abcdef0",
        instance_type: str = "p4d.24xlarge",
        availability_zone: str = "us-east-1a",
        http_tokens: Literal["required", "optional"] = "required",
        **endpoint: Any,
    ) -> None:
        if http_tokens not in ("required", "optional"):
            raise ValueError(f"http_tokens must be 'required' or 'optional', got {http_tokens!r}")
        static = {
            "instance-id": instance_id,
            "instance-type": instance_type,
            "placement/availability-zone": availability_zone,
        }
        super().__init__(static=static, **endpoint)
        self._http_tokens = http_tokens

    def _token_required(self) -> bool:
        return self._http_tokens == "required"

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
