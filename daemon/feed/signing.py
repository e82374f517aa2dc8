"""How a webhook request is signed, and how a receiver checks it.

A generic webhook sink's request (:mod:`daemon.feed.sinks`) carries two headers:

- ``X-Spotvisor-Timestamp``: unix seconds (an integer) when this attempt was sent;
- ``X-Spotvisor-Signature``: ``sha256=`` + lowercase hex of
  ``HMAC-SHA256(key, timestamp + "." + body)``, where ``key`` is the UTF-8 bytes of
  the sink's ``secret_env`` variable's value, ``timestamp`` the header's decimal string
  and ``body`` the exact request body bytes (the scheme of Stripe's and Slack's signing).

Each attempt is signed anew, so a delivery retried for hours still verifies. A receiver
checks with :func:`verify_signature` (constant-time compare; replay protection: a
timestamp more than ``tolerance_s`` away from its clock is refused).
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = ["TIMESTAMP_HEADER", "SIGNATURE_HEADER", "sign", "verify_signature"]

TIMESTAMP_HEADER = "X-Spotvisor-Timestamp"
SIGNATURE_HEADER = "X-Spotvisor-Signature"


def sign(secret: str | bytes, timestamp: int | str, body: bytes) -> str:
    """The ``X-Spotvisor-Signature`` value: ``sha256=<hex HMAC-SHA256(secret, f"{timestamp}." + body)>``."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def verify_signature(secret: str | bytes, timestamp: str | int, body: bytes | str, signature: str,
                     tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """For receivers: is this request signed with ``secret`` and fresh?

    Args:
        secret: the shared key (the value of the sink's ``secret_env``).
        timestamp: the ``X-Spotvisor-Timestamp`` header (unix seconds).
        body: the raw request body, exactly as received (bytes; a str is UTF-8 encoded).
        signature: the ``X-Spotvisor-Signature`` header (``sha256=<hex>``).
        tolerance_s: largest accepted distance between ``timestamp`` and ``now``, in
            seconds, either way (replay protection; 300 as Stripe and Slack use).
        now: the receiver's clock (unix seconds); default ``time.time()``.

    Returns:
        True only if the timestamp is an integer within ``tolerance_s`` of ``now`` and
        the signature matches (constant-time compare). Then parse the body
        (``{"pool", "events": [...]}``, see :func:`daemon.feed.feed_messages.webhook_batch_body`)
        and handle its events in order, dropping each ``seq`` already handled (at least once).
    """
    try:
        ts = int(str(timestamp).strip())
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    raw = body.encode() if isinstance(body, str) else bytes(body)
    return hmac.compare_digest(sign(secret, ts, raw), signature.strip())
