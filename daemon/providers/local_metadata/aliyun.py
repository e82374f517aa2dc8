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

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from daemon.gpunode.metadata.aliyun import TOKEN_PROTOCOL
from daemon.providers.local_metadata.endpoint import TokenMetadataEndpoint, utc_stamp as _stamp

__all__ = ["FakeAliyunMetadata", "INTERRUPTION_LEAD", "TERMINATION_ITEM"]

#: ECS updates ``instance/spot/termination-time`` this long before releasing the instance.
INTERRUPTION_LEAD = timedelta(minutes=5)
TERMINATION_ITEM = "instance/spot/termination-time"


class FakeAliyunMetadata(TokenMetadataEndpoint):
    """An aiohttp server on ``host`` speaking the ECS metadata protocol.

    Lifecycle and test hooks: see :class:`~daemon.providers.local_metadata.endpoint.FakeEndpoint`.

    Args:
        instance_id, instance_type, region_id, zone_id: values of the
            ``instance-id``, ``instance/instance-type``, ``region-id`` and
            ``zone-id`` items.
        hardened: security hardening mode only (a read without a token is 401).
            Otherwise reads without a token are served; one with an invalid token
            is still 401.
        host, port: where to listen; port 0 = ephemeral.
        clock: monotonic seconds, used for token expiry; tests pass a settable one.

    ``request_log`` holds ``(method, path, status)`` of every answered request.
    """

    PROTOCOL = TOKEN_PROTOCOL

    def __init__(
        self,
        *,
        instance_id: str = "i-bp1fakeinstance0001",
        instance_type: str = "ecs.gn7i-c8g1.2xlarge",
        region_id: str = "cn-hangzhou",
        zone_id: str = "cn-hangzhou-h",
        hardened: bool = False,
        **endpoint: Any,
    ) -> None:
        static = {
            "instance-id": instance_id,
            "instance/instance-type": instance_type,
            "region-id": region_id,
            "zone-id": zone_id,
        }
        super().__init__(static=static, **endpoint)
        self._hardened = bool(hardened)

    @property
    def hardened(self) -> bool:
        return self._hardened

    def _token_required(self) -> bool:
        return self._hardened

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


def _now() -> float:
    return time.time()
