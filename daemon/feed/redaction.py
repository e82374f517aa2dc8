"""Secrets kept out of what the daemon shows: log lines, node logs, error messages.

A :class:`Redactor` holds the secrets one owner registered: the feed's secret URLs (a
sink URL from ``url_env``, every Slack hook URL: the URL is the credential) and a job's
secret values (:mod:`daemon.controlnode.job_secrets`). There is no registry at module
level: whoever holds secrets holds the redactor and hands it to what shows text. In
``spotvisord`` that is the entry point (:mod:`daemon.interfaces.cli`), which creates one
per process and gives it to the logging set-up (:func:`daemon.logs.configure_logging`),
the feed (:class:`daemon.feed.notify.Notifier`) and the supervisor (its node logs).

What a secret is shown as:

- a URL: :func:`redact_url`'s ``scheme://host/…``, whole or as its path alone, as written
  or as aiohttp/yarl prints it (percent-encoded);
- a value: :data:`MASK`, also as JSON or ``repr`` escape it.

Where: :meth:`Redactor.redact` on any text; a stdlib record passing a handler of the root
logger or one of slack-sdk's, aiohttp's or asyncio's loggers (:meth:`Redactor.install`,
:class:`SecretRedactingFilter`); a structlog line's fields (:meth:`Redactor.mask_fields`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any, Iterable

import yarl

__all__ = ["Redactor", "SecretRedactingFilter", "redact_url", "MASK", "MIN_MASKED_CHARS", "SLACK_SDK_LOGGER"]

MASK = "***"  # what a registered secret value is shown as
MIN_MASKED_CHARS = 4  # a shorter value is not looked for (masking every "1" would garble every log line)
SLACK_SDK_LOGGER = "spotvisor.notify.slack_sdk"  # the logger slack-sdk's client is given
# loggers whose records can carry a sink's URL (filters on a logger see only its own records)
REDACTED_LOGGERS = ("slack_sdk", "slack_sdk.webhook.async_client", "slack_sdk.webhook.client",
                    "slack_sdk.http_retry", "aiohttp", "aiohttp.client", "aiohttp.access", "aiohttp.server",
                    "aiohttp.web", "aiohttp.internal", "asyncio", SLACK_SDK_LOGGER)

_URL_HEAD = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*)://([^/?#\s]*)")
_MIN_SECRET_PATH = 6  # a path shorter than this ("/hook") is not looked for on its own


def redact_url(url: str) -> str:
    """``url`` without what may be secret: ``scheme://host[:port]/…`` (no user info, path,
    query or fragment), also for a malformed URL; ``<redacted URL>`` when not even a
    scheme and host can be read."""
    m = _URL_HEAD.match(url)
    if m is None:
        return "<redacted URL>"
    host = m.group(2).rpartition("@")[2]  # user:password@ is a secret too
    return f"{m.group(1)}://{host}/…"


class Redactor:
    """The secrets one owner knows, and the text they are shown as.

    Registering is thread-safe and idempotent; :meth:`redact` may run on any thread (the
    feed's included) while another registers. What is registered stays for the
    redactor's life (the secrets of one daemon run: a few URLs and values).
    """

    __slots__ = ("_state", "_lock", "_filter", "_handlers")

    def __init__(self) -> None:
        # (secret text -> what is shown instead, every key longest first as one pattern); replaced whole
        self._state: tuple[dict[str, str], re.Pattern[str] | None] = ({}, None)
        self._lock = threading.Lock()
        self._filter = SecretRedactingFilter(self)
        self._handlers: list[logging.Handler] = []  # the root handlers install() gave the filter

    @property
    def holds_any(self) -> bool:
        """True once anything is registered."""
        return self._state[1] is not None

    def add_url(self, url: str) -> str:
        """Register ``url`` as a secret: from now on it reads as :func:`redact_url` shows it.
        Returns that redacted form."""
        shown = redact_url(url)
        forms = {url: shown, url.strip(): shown}
        try:
            u = yarl.URL(url.strip())
            forms.update({str(u): shown, u.human_repr(): shown})
        except Exception:  # noqa: BLE001 - a malformed URL: its raw form is what gets logged
            pass
        for full in list(forms):
            m = _URL_HEAD.match(full)
            rest = full[m.end():] if m else ""
            if len(rest) >= _MIN_SECRET_PATH:
                forms[rest] = "/…"
        self._add({k: v for k, v in forms.items() if k})
        return shown

    def add_value(self, value: str) -> bool:
        """Register ``value`` (a job's secret) as a secret: from now on it reads ``***``,
        also as JSON or ``repr`` escape it (a value with a quote, backslash or newline).
        A value of fewer than :data:`MIN_MASKED_CHARS` characters is not registered
        (returns False)."""
        if len(value) < MIN_MASKED_CHARS:
            return False
        forms = {value, json.dumps(value)[1:-1], repr(value)[1:-1], value.strip()}
        self._add(dict.fromkeys((f for f in forms if len(f) >= MIN_MASKED_CHARS), MASK))
        return True

    def add_values(self, values: Iterable[str]) -> None:
        """:meth:`add_value` for each of ``values``."""
        for value in values:
            self.add_value(value)

    def redact(self, text: str) -> str:
        """``text`` with every registered secret replaced by what it is shown as."""
        shown, pattern = self._state
        if pattern is None or not text:
            return text
        return pattern.sub(lambda m: shown.get(m.group(0), "…"), text)

    def mask_fields(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        """structlog processor: every registered secret in the line's fields is masked. A
        field that is not a string is judged by its ``repr`` (what the renderers print)
        and replaced by that, masked, when it held one."""
        if self._state[1] is None:
            return event_dict
        for key, value in event_dict.items():
            text = value if isinstance(value, str) else repr(value)
            clean = self.redact(text)
            if clean != text:
                event_dict[key] = clean
        return event_dict

    def install(self) -> None:
        """Give this redactor's :class:`SecretRedactingFilter` to the handlers the root
        logger has now and to the loggers that can log a sink's URL (slack-sdk's,
        aiohttp's, asyncio's, ours). Idempotent; call again after a later ``logging``
        set-up added handlers. Undone by :meth:`uninstall`."""
        for name in REDACTED_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)  # addFilter adds a filter once
        for h in logging.getLogger().handlers:
            h.addFilter(self._filter)
            if h not in self._handlers:
                self._handlers.append(h)

    def uninstall(self) -> None:
        """Take the filter :meth:`install` gave back (idempotent)."""
        for name in REDACTED_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)
        for h in self._handlers:
            h.removeFilter(self._filter)
        self._handlers.clear()

    def _add(self, forms: dict[str, str]) -> None:
        with self._lock:
            shown = self._state[0]
            if all(k in shown for k in forms):
                return
            shown = {**shown, **forms}
            self._state = (shown, re.compile("|".join(re.escape(k) for k in sorted(shown, key=len, reverse=True))))


class SecretRedactingFilter(logging.Filter):
    """A :class:`logging.Filter` that redacts a :class:`Redactor`'s secrets from a record's
    message, arguments, exception and stack text (it changes the record, and never drops one)."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        redact = self.redactor.redact
        if not self.redactor.holds_any:
            return True
        try:
            msg = record.getMessage()
            clean = redact(msg)
            if clean != msg:
                record.msg, record.args = clean, None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                clean = redact(record.exc_text)
                if clean != record.exc_text:  # a handler that formats exc_info itself would show it whole
                    record.exc_text, record.exc_info = clean, None
            if record.stack_info:
                record.stack_info = redact(record.stack_info)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted: left to logging's own handling
            pass
        return True
