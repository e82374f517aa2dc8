"""structlog set-up for the daemon, the agent and the CLIs (never for trainer/).

Logs go to stderr as ``key=value`` lines (``SPOTVISOR_LOG_FORMAT=json`` for JSON,
e.g. under journald); ``SPOTVISOR_LOG_LEVEL`` sets the level (default INFO).

Given a :class:`~daemon.feed.redaction.Redactor` (the daemon's: a job's secret values,
the feed's secret URLs), every line passes it before it is rendered: a registered secret
reads ``***`` (a URL ``scheme://host/…``) in any field, however deep, so a stray log of a
job spec shows no secret; and the stdlib records that reach the root logger's handlers are
redacted too (:meth:`~daemon.feed.redaction.Redactor.install`). Without one (the agent,
which holds no feed URL) lines are left as they are.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from daemon.feed.redaction import Redactor

__all__ = ["configure_logging"]


class _StderrNow:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured:
    an entry point called in-process (a test, an embedding program) may swap it, and a
    stream bound at configure time would outlive it (structlog's PrintLogger then raises
    "I/O operation on closed file" in every later caller)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None, *, stream=None, redactor: Redactor | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process entry point;
    ``redactor``: the secrets no line may show (the module docstring)."""
    name = (level or os.environ.get("SPOTVISOR_LOG_LEVEL", "INFO")).upper()
    lvl = getattr(logging, name, logging.INFO)
    out = stream or _StderrNow()
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
            *([redactor.mask_fields] if redactor is not None else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        # not cached: a module's logger (a lazy proxy) that cached its first configuration kept
        # that processor list for the process's life, so a later configure, or structlog's
        # capture_logs, never reached it (a test that read a module's line after an in-process
        # `check` and a reset saw it printed instead); the daemon logs too little for the cache to pay
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=lvl, stream=out, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if redactor is not None:
        redactor.install()  # the root handler basicConfig added, and the libraries' loggers
    # aliyunsdkcore logs every failed call at ERROR with the signed URL (AccessKeyId,
    # Signature); the provider reports the error itself, without the query string.
    logging.getLogger("aliyunsdkcore").setLevel(logging.CRITICAL)
