"""structlog set-up for the daemon, the agent and the CLIs (never for trainer/).

Logs go to stderr as ``key=value`` lines (``SPOTVISOR_LOG_FORMAT=json`` for JSON,
e.g. under journald); ``SPOTVISOR_LOG_LEVEL`` sets the level (default INFO).

Every line passes :func:`mask_secrets` before it is rendered: a job's secret value (or a
secret URL of the feed) registered with :mod:`daemon.feed.notify` reads ``***`` in any
field, however deep, so a stray log of a job spec shows no secret.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

__all__ = ["configure_logging", "mask_secrets"]

_REDACTION = "daemon.feed.notify"  # the registry of secrets (register_secret_value, register_secret_url)


def mask_secrets(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: every registered secret in the line's fields is masked. A field
    that is not a string is judged by its ``repr`` (what the renderers print) and replaced by
    that, masked, when it held one. Nothing registered (the registry not even imported, as
    in the agent, which never holds a feed URL): the line is left as it is."""
    registry = sys.modules.get(_REDACTION)
    if registry is None or getattr(registry, "_secrets_re", None) is None:
        return event_dict
    redact = registry.redact_secrets
    for key, value in event_dict.items():
        text = value if isinstance(value, str) else repr(value)
        clean = redact(text)
        if clean != text:
            event_dict[key] = clean
    return event_dict


def configure_logging(level: str | None = None, *, stream=None) -> None:
    """Configure structlog and the stdlib root logger once per process entry point."""
    name = (level or os.environ.get("SPOTVISOR_LOG_LEVEL", "INFO")).upper()
    lvl = getattr(logging, name, logging.INFO)
    out = stream or sys.stderr
    renderer = (
        structlog.processors.JSONRenderer()
        if os.environ.get("SPOTVISOR_LOG_FORMAT") == "json"
        else structlog.processors.KeyValueRenderer(key_order=["timestamp", "level", "event"], drop_missing=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            mask_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=lvl, stream=out, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # aliyunsdkcore logs every failed call at ERROR with the signed URL (AccessKeyId,
    # Signature); the provider reports the error itself, without the query string.
    logging.getLogger("aliyunsdkcore").setLevel(logging.CRITICAL)
