"""The feed: every event, routed to Slack and to signed webhooks, at least once and in order.

Where it sits: events are already durable (the store's ``events`` table, ``seq``
persisted and monotonic). The **outbox** is one cursor per sink in the store's
``kv`` table, ``notify.cursor.<sink>`` = the last ``seq`` that sink is done with;
no event is copied. One worker task per sink reads the events after its cursor,
oldest first, and sends **every pending event the sink wants, up to its
``max_batch``, in one request** (a batch); it advances the cursor past the whole
batch only after the sink answered 2xx. A burst (1,000 nodes registering: ~4,000
events in 10 s) thus costs a few requests, not one round trip per event queued
behind the others.

**Where the workers run**: on a thread of their own (:data:`FEED_THREAD`) with its
own asyncio loop, which also holds their HTTP sessions, tenacity's retries and
Slack's pacing, and its own SQLite connection to the store's file
(:meth:`Store.open_sibling`; WAL lets it read while the daemon writes, and its cursor
writes wait out the daemon's). On the daemon's loop, a worker woken in a burst (1,000
agents reporting a commit or a restart within 100 ms) waited behind hundreds of
queued HTTP handlers of ~250 µs each (the loop stalled 100–340 ms), so event →
webhook p99 was 400 ms with 1,000 nodes (bench/scale.py); batching does not help with
that. The daemon's loop now only appends the event and hands the wake over
(``call_soon_threadsafe``); the workers read events and node rows through the feed's
connection and never touch Supervisor objects, and their progress comes back to
:meth:`Notifier.wait_until` on the daemon's loop the same way. So:

- **at least once, in order per sink**: a batch is re-sent, the same events, until
  a 2xx, and the next batch waits for it; events within a batch and batches are
  oldest first. A daemon restart resumes at the first event not yet acknowledged;
  only the batch in flight when the daemon stopped can arrive twice (then possibly
  with more events after it), so receivers de-duplicate by ``seq`` (in every event);
- **never blocking the supervisor**: ``Supervisor.record()`` only wakes the workers
  (:meth:`Notifier.wake` is a listener; it never waits for the feed's thread). A
  sink that is down is retried with exponential backoff and jitter (tenacity), capped
  at the sink's ``max_backoff_s``, for as long as it is down; other sinks are not held
  up (each has its own worker task on the feed's loop). A 429 with a
  ``Retry-After`` (seconds or an HTTP date) waits at least that long (at most
  :data:`RETRY_AFTER_MAX_S`). Every failed attempt is logged
  (``notify_attempt_failed``: sink, first and last seq of the batch, status or error,
  next wait). A sink that answers 4xx is retried too: the queue waits until the
  operator fixes it;
- a sink seen for the first time starts after the newest event already stored (a
  sink added to a long-lived pool does not replay its history);
- **a backlog stays bounded**: a sink more than :data:`FEED_BACKLOG_BOUND` events behind
  (a flood of reports, a sink down for hours) reads :data:`FEED_SHED_WINDOW` events at a
  time and, of the low-value kinds (:data:`daemon.control.bounds.SHEDDABLE_KINDS`: a
  ``job_resumed``, an alarm), sends only the newest per kind and node of the window; the
  others are skipped (the cursor moves past them), counted in ``SinkStats.shed`` and
  ``spotvisor_feed_events_shed_total{sink}``, and logged at most every 10 s
  (``notify_backlog_shed``). Notices, commits, losses and the job's end are always sent.

**Generic webhook** (``type: webhook``): ``POST url`` with ``Content-Type:
application/json`` and the UTF-8 JSON body (:func:`webhook_batch_body`)
``{"pool": ..., "events": [{"seq", "time", "kind", "node", "data", "text"}, ...]}``:
one to ``max_batch`` (default 100) events, oldest first (``time``: unix seconds the
event was recorded; ``text``: the sink's template or the default line). Headers:

- ``X-Spotvisor-Timestamp``: unix seconds (an integer) when this attempt was sent;
- ``X-Spotvisor-Signature``: ``sha256=`` + lowercase hex of
  ``HMAC-SHA256(key, timestamp + "." + body)``, where ``key`` is the UTF-8 bytes of
  the ``secret_env`` variable's value, ``timestamp`` the header's decimal string and
  ``body`` the exact request body bytes (the scheme of Stripe's and Slack's signing).

Each attempt is signed anew, so a delivery retried for hours still verifies. A
receiver checks with :func:`verify_signature` (constant-time compare; replay
protection: a timestamp more than ``tolerance_s`` away from its clock is refused),
then handles each event of ``events`` in order, dropping a ``seq`` it has already
handled.

What an event says (its text line, the webhook body, the Slack blocks) is
:mod:`daemon.feed.feed_messages`; this module delivers it.

**Slack** (``type: slack``): an incoming webhook through slack-sdk's
``AsyncWebhookClient``; messages are Block Kit built from ``slack_sdk.models.blocks``
(valid by construction, checked on serialisation). Slack takes about one message a
second per hook (short bursts allowed, then 429 with ``Retry-After``), so the worker
sends at most one message per :data:`SLACK_MIN_INTERVAL_S` and what arrives
meanwhile joins the next message. A batch of one event is :func:`slack_message`: a
header with an emoji per kind, the key numbers as a two-column field grid that reads
well on a phone, a context line with pool, ``seq`` and time, and ``text`` as the
notification fallback. Several events (up to ``max_batch``, default and most 24) are
one :func:`slack_digest`: a header with the count, then per event its line and a
context with ``seq`` and time, within Slack's 50 blocks.

**A bad event never stops a sink**: rendering is total (:mod:`daemon.feed.feed_messages`:
any data an older daemon stored renders, the webhook body is strict JSON), and should
rendering an event still raise (a bug), the worker logs it once
(``notify_render_failed``, error level), sends that event as a fallback line (kind and
``seq``) and goes on; the cursor still moves in order.

**Secret URLs stay out of the logs**: a sink's URL from ``url_env`` (and every Slack
hook URL: the URL is the credential) is registered as a secret when the sinks are
resolved; wherever it could reach a log it is shown as ``scheme://host/…``: our own
lines (a delivery error quotes aiohttp's exception, which holds the URL), slack-sdk's
DEBUG lines (it logs each request's URL; its client logs through
``spotvisor.notify.slack_sdk``), and any stdlib record that passes a handler of the
root logger or one of slack-sdk's, aiohttp's or asyncio's loggers
(:class:`SecretRedactingFilter`). A job's secret values
(:func:`register_secret_value`, :mod:`daemon.controlnode.job_secrets`) are masked the
same way, as ``***``, and in structlog's lines too (:mod:`daemon.logs`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import aiohttp
import structlog
import yarl
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from slack_sdk.errors import SlackObjectFormationError
from slack_sdk.webhook.async_client import AsyncWebhookClient
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter
from tenacity.wait import wait_base

from daemon.config import ConfigError, SinkSpec
from daemon.control.bounds import shed
from daemon.feed.feed_messages import (  # what an event says; re-exported here
    EMOJI,
    SLACK_DIGEST_LINE_MAX_CHARS,
    SLACK_FIELD_MAX_CHARS,
    SLACK_HEADER_MAX_CHARS,
    SLACK_MAX_BLOCKS,
    SLACK_MAX_FIELDS,
    SLACK_SECTION_MAX_CHARS,
    SLACK_TEXT_MAX_CHARS,
    SlackMessage,
    clip,
    fallback_text,
    key_fields,
    render_text,
    slack_digest,
    slack_escape,
    slack_message,
    title,
    webhook_batch_body,
)
from daemon.model import Event, Node
from daemon.controlnode.store import Store

__all__ = [
    "Notifier",
    "FEED_THREAD",
    "DeliveryError",
    "Target",
    "resolve_sinks",
    "sign",
    "verify_signature",
    "webhook_batch_body",
    "render_text",
    "key_fields",
    "slack_message",
    "slack_digest",
    "SlackMessage",
    "SinkStats",
    "EMOJI",
    "TIMESTAMP_HEADER",
    "SIGNATURE_HEADER",
    "SecretRedactingFilter",
    "redact_secrets",
    "redact_url",
    "register_secret_url",
    "register_secret_value",
    "MASK",
    # re-exported from daemon.feed.feed_messages
    "slack_escape",
    "title",
    "SLACK_DIGEST_LINE_MAX_CHARS",
    "SLACK_FIELD_MAX_CHARS",
    "SLACK_HEADER_MAX_CHARS",
    "SLACK_MAX_BLOCKS",
    "SLACK_MAX_FIELDS",
    "SLACK_SECTION_MAX_CHARS",
    "SLACK_TEXT_MAX_CHARS",
]

log = structlog.get_logger("spotvisor.notify")

TIMESTAMP_HEADER = "X-Spotvisor-Timestamp"
SIGNATURE_HEADER = "X-Spotvisor-Signature"
CURSOR_KEY = "notify.cursor.{}"
_READ = 500  # events read at a time by a sink that filters kinds (at least its max_batch)
FEED_BACKLOG_BOUND = 1000  # a sink further behind than this many events sheds low-value ones
FEED_SHED_WINDOW = 2000  # events read at a time while shedding (the span a kind and node coalesce over)
_SHED_LOG_EVERY_S = 10.0
RETRY_AFTER_MAX_S = 3600.0  # a Retry-After longer than this is taken as this
FEED_THREAD = "spotvisor-feed"  # the thread the workers run on, with their own event loop
_JOIN_TIMEOUT_S = 10.0  # aclose waits this long for the feed's thread (its workers get 5 s to stop)

# Slack's incoming webhooks: about one message a second per hook (docs.slack.dev, "Rate
# limits": posting messages 1 per second, short bursts allowed, then HTTP 429 + Retry-After)
SLACK_MIN_INTERVAL_S = 1.0

# -- secret URLs ----------------------------------------------------------------------------------
_URL_HEAD = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*)://([^/?#\s]*)")
_MIN_SECRET_PATH = 6  # a path shorter than this ("/hook") is not looked for on its own
_secrets: dict[str, str] = {}  # secret text -> what is shown instead
_secrets_re: re.Pattern[str] | None = None  # every key of _secrets, longest first
_secrets_lock = threading.Lock()
# loggers whose records can carry a sink's URL (filters on a logger see only its own records)
_REDACTED_LOGGERS = ("slack_sdk", "slack_sdk.webhook.async_client", "slack_sdk.webhook.client",
                     "slack_sdk.http_retry", "aiohttp", "aiohttp.client", "aiohttp.access", "aiohttp.server",
                     "aiohttp.web", "aiohttp.internal", "asyncio")
SLACK_SDK_LOGGER = "spotvisor.notify.slack_sdk"  # the logger slack-sdk's client is given


def redact_url(url: str) -> str:
    """``url`` without what may be secret: ``scheme://host[:port]/…`` (no user info, path,
    query or fragment), also for a malformed URL; ``<redacted URL>`` when not even a
    scheme and host can be read."""
    m = _URL_HEAD.match(url)
    if m is None:
        return "<redacted URL>"
    host = m.group(2).rpartition("@")[2]  # user:password@ is a secret too
    return f"{m.group(1)}://{host}/…"


def register_secret_url(url: str) -> str:
    """Remember ``url`` as a secret: from now on :func:`redact_secrets` (and so
    :class:`SecretRedactingFilter`) shows it as :func:`redact_url` does, whole or as the
    path alone, as written or as aiohttp/yarl prints it (percent-encoded). Returns the
    redacted form. Thread-safe; idempotent."""
    global _secrets_re
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
    forms = {k: v for k, v in forms.items() if k}
    with _secrets_lock:
        if all(k in _secrets for k in forms):
            return shown
        _secrets.update(forms)
        _secrets_re = re.compile("|".join(re.escape(k) for k in sorted(_secrets, key=len, reverse=True)))
    install_log_redaction()
    return shown


MASK = "***"  # what a registered secret value is shown as
MIN_MASKED_CHARS = 4  # a shorter value is not looked for (masking every "1" would garble every log line)


def register_secret_value(value: str) -> bool:
    """Remember ``value`` (a job's secret, :mod:`daemon.controlnode.job_secrets`) as a
    secret: from now on :func:`redact_secrets`, :class:`SecretRedactingFilter` and the
    structlog processor of :mod:`daemon.logs` show it as ``***``, also as JSON or ``repr``
    escape it (a value with a quote, backslash or newline). A value of fewer than
    :data:`MIN_MASKED_CHARS` characters is not registered (returns False). Thread-safe; idempotent."""
    global _secrets_re
    if len(value) < MIN_MASKED_CHARS:
        return False
    forms = {value, json.dumps(value)[1:-1], repr(value)[1:-1], value.strip()}
    forms = {f for f in forms if len(f) >= MIN_MASKED_CHARS}
    with _secrets_lock:
        if all(k in _secrets for k in forms):
            return True
        _secrets.update(dict.fromkeys(forms, MASK))
        _secrets_re = re.compile("|".join(re.escape(k) for k in sorted(_secrets, key=len, reverse=True)))
    install_log_redaction()
    return True


def redact_secrets(text: str) -> str:
    """``text`` with every registered secret URL (or its path) replaced by its redacted form."""
    pattern = _secrets_re
    if pattern is None or not text:
        return text
    return pattern.sub(lambda m: _secrets.get(m.group(0), "…"), text)


class SecretRedactingFilter(logging.Filter):
    """A :class:`logging.Filter` that redacts the registered secret URLs from a record's
    message, arguments and exception text (it changes the record, and never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _secrets_re is None:
            return True
        try:
            msg = record.getMessage()
            clean = redact_secrets(msg)
            if clean != msg:
                record.msg, record.args = clean, None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                clean = redact_secrets(record.exc_text)
                if clean != record.exc_text:  # a handler that formats exc_info itself would show it whole
                    record.exc_text, record.exc_info = clean, None
            if record.stack_info:
                record.stack_info = redact_secrets(record.stack_info)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted: left to logging's own handling
            pass
        return True


_FILTER = SecretRedactingFilter()


def install_log_redaction() -> None:
    """Attach :class:`SecretRedactingFilter` to the handlers of the root logger and to the
    loggers that can log a sink's URL (slack-sdk's, aiohttp's, asyncio's, ours). Idempotent;
    called on each :func:`register_secret_url` and at :meth:`Notifier.start` (handlers
    added later, by a later ``logging`` set-up, get it then)."""
    for name in (*_REDACTED_LOGGERS, SLACK_SDK_LOGGER):
        logging.getLogger(name).addFilter(_FILTER)  # addFilter adds a filter once
    for h in logging.getLogger().handlers:
        h.addFilter(_FILTER)


class DeliveryError(Exception):
    """A sink did not answer 2xx, or could not be reached in ``timeout_s``; retried.

    The message has the registered secret URLs redacted (:func:`redact_secrets`).
    ``retry_after_s``: the wait the sink asked for (a 429's ``Retry-After``), or None."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(redact_secrets(message))
        self.retry_after_s = retry_after_s


def retry_after_s(status: int, headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """The wait a 429 asks for: ``Retry-After`` as seconds or an HTTP date, in seconds,
    at most :data:`RETRY_AFTER_MAX_S`; None for another status or no usable header."""
    if status != 429:
        return None
    raw = (headers.get("Retry-After") or "").strip()
    if not raw:
        return None
    try:
        wait = float(raw)
    except ValueError:
        try:
            wait = email.utils.parsedate_to_datetime(raw).timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError):
            return None
    if not math.isfinite(wait):
        return None
    return min(max(0.0, wait), RETRY_AFTER_MAX_S)


# -- signing -----------------------------------------------------------------------------------
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
        (``{"pool", "events": [...]}``, see :func:`webhook_batch_body`) and handle its
        events in order, dropping each ``seq`` already handled (at least once).
    """
    try:
        ts = int(str(timestamp).strip())
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    raw = body.encode() if isinstance(body, str) else bytes(body)
    return hmac.compare_digest(sign(secret, ts, raw), signature.strip())


# -- sinks ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Target:
    """A sink with its URL and key read from the environment."""

    spec: SinkSpec
    url: str = field(repr=False)  # a Slack hook URL is itself a secret
    secret: bytes | None = field(repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def wants(self, kind: str) -> bool:
        return ("*" in self.spec.kinds or kind in self.spec.kinds) and kind not in self.spec.exclude_kinds

    @property
    def wants_all(self) -> bool:
        return "*" in self.spec.kinds and not self.spec.exclude_kinds

    def template_for(self, kind: str) -> str | None:
        return self.spec.template.get(kind, self.spec.template.get("*"))


def resolve_sinks(specs: Sequence[SinkSpec], environ: Mapping[str, str] | None = None) -> list[Target]:
    """Read each sink's ``url_env`` / ``secret_env`` from ``environ`` (default ``os.environ``).

    Every URL read from ``url_env``, and every Slack hook URL, is registered as a secret
    (:func:`register_secret_url`): logs show it as ``scheme://host/…``.

    Raises:
        ConfigError: a named variable is unset or empty; one line per problem, naming
            the field (``notify.<i>.url_env``) and the variable (never the URL).
    """
    env = os.environ if environ is None else environ
    out: list[Target] = []
    problems: list[str] = []
    for i, spec in enumerate(specs):
        url = spec.url
        if spec.url_env is not None:
            url = env.get(spec.url_env) or None
            if url is None:
                problems.append(f"notify.{i}.url_env: ${spec.url_env} is not set (sink {spec.name!r}: export it "
                                "in the daemon's environment, e.g. systemd EnvironmentFile=)")
            elif not url.startswith(("http://", "https://")):
                problems.append(f"notify.{i}.url_env: ${spec.url_env} is not an http(s) URL (sink {spec.name!r})")
        secret: bytes | None = None
        if spec.secret_env is not None:
            value = env.get(spec.secret_env)
            if not value:
                problems.append(f"notify.{i}.secret_env: ${spec.secret_env} is not set (sink {spec.name!r}: "
                                "export the signing key in the daemon's environment)")
            else:
                secret = value.encode()
        if url is not None:
            if spec.url_env is not None or spec.type == "slack":
                register_secret_url(url)
            out.append(Target(spec, url, secret))
    if problems:
        raise ConfigError(problems)
    return out


class _Sender:
    """Sends one batch of events to one sink; raises :class:`DeliveryError` unless it answered 2xx."""

    def __init__(self, target: Target, session: aiohttp.ClientSession, pool: str,
                 clock: Callable[[], float]) -> None:
        self.target = target
        self.session = session
        self.pool = pool
        self.clock = clock

    async def pace(self) -> None:
        """Return when the sink takes the next request (a rate-limited one: its next slot).
        The worker reads the next batch after this, so what arrives meanwhile joins it."""

    def prepare(self, batch: Sequence[tuple[Event, Node | None]]) -> Any:
        raise NotImplementedError

    def prepare_fallback(self, batch: Sequence[tuple[Event, Node | None]]) -> Any:
        """What is sent when :meth:`prepare` raised (a bug): each event's kind and ``seq``."""
        raise NotImplementedError

    def _text(self, ev: Event, node: Node | None, *, log_failure: bool = True) -> str:
        """The event's line for this sink; its fallback line if rendering raised (logged
        once, unless ``log_failure`` is False: the caller has logged it)."""
        try:
            return render_text(ev, pool=self.pool, node=node, template=self.target.template_for(ev.kind))
        except Exception as exc:  # noqa: BLE001 - one event must not stop the sink
            if log_failure:
                _render_failed(self.target.name, [ev], exc)
            return fallback_text(ev)

    async def send(self, prepared: Any) -> None:
        raise NotImplementedError


def _render_failed(sink: str, events: Sequence[Event], exc: BaseException) -> None:
    log.error("notify_render_failed", sink=sink, seq=events[0].seq, last_seq=events[-1].seq,
              kinds=sorted({str(ev.kind) for ev in events}), error=redact_secrets(clip(repr(exc), 500)),
              sent="a fallback line per event")


class _WebhookSender(_Sender):
    def prepare(self, batch: Sequence[tuple[Event, Node | None]]) -> bytes:
        return webhook_batch_body([(ev, self._text(ev, node)) for ev, node in batch], pool=self.pool)

    def prepare_fallback(self, batch: Sequence[tuple[Event, Node | None]]) -> bytes:
        return webhook_batch_body([(Event(ev.seq, ev.time, ev.kind, ev.node, {}), fallback_text(ev))
                                   for ev, _ in batch], pool=self.pool)

    async def send(self, prepared: bytes) -> None:
        assert self.target.secret is not None  # resolve_sinks requires it for webhooks
        ts = int(self.clock())
        headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: str(ts),
                   SIGNATURE_HEADER: sign(self.target.secret, ts, prepared), "User-Agent": "spotvisord"}
        try:
            async with self.session.post(self.target.url, data=prepared, headers=headers) as r:
                if not 200 <= r.status < 300:
                    raise DeliveryError(f"HTTP {r.status}: {clip((await r.text()).strip(), 200)}",
                                        retry_after_s=retry_after_s(r.status, r.headers))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DeliveryError(f"{type(exc).__name__}: {exc}") from None  # its URL: not kept on the chain


class _SlackSender(_Sender):
    def __init__(self, target: Target, session: aiohttp.ClientSession, pool: str,
                 clock: Callable[[], float]) -> None:
        super().__init__(target, session, pool, clock)
        # tenacity is the one retry layer: slack-sdk's own handlers are off. Its DEBUG lines
        # quote the hook URL: they go through a logger whose filter redacts it
        self.client = AsyncWebhookClient(target.url, session=session, retry_handlers=[],
                                         logger=logging.getLogger(SLACK_SDK_LOGGER))
        self._next_at = 0.0  # loop time of the next slot: one message per SLACK_MIN_INTERVAL_S

    async def pace(self) -> None:
        wait = self._next_at - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)

    def prepare(self, batch: Sequence[tuple[Event, Node | None]]) -> SlackMessage:
        msg = slack_digest([(ev, node, self.target.template_for(ev.kind)) for ev, node in batch], pool=self.pool)
        try:
            msg.to_dict()
        except SlackObjectFormationError as exc:  # a bug here must not stop the feed: send the text alone
            log.error("notify_blocks_invalid", sink=self.target.name, seq=batch[0][0].seq,
                      last_seq=batch[-1][0].seq, error=redact_secrets(str(exc)))
            return SlackMessage(text=msg.text, blocks=[])
        return msg

    def prepare_fallback(self, batch: Sequence[tuple[Event, Node | None]]) -> SlackMessage:
        lines = [slack_escape(self._text(ev, node, log_failure=False)) for ev, node in batch]
        return SlackMessage(text=clip("\n".join(lines), SLACK_TEXT_MAX_CHARS), blocks=[])

    async def send(self, prepared: SlackMessage) -> None:
        await self.pace()  # a retry counts against the rate limit too
        try:
            resp = await self.client.send(text=prepared.text, blocks=prepared.blocks or None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DeliveryError(f"{type(exc).__name__}: {exc}") from None  # its URL: not kept on the chain
        finally:
            # the next slot counts from the answer: Slack saw this message by then, so the
            # next one reaches it at least the interval later however slow the way there
            self._next_at = asyncio.get_running_loop().time() + SLACK_MIN_INTERVAL_S
        if not 200 <= resp.status_code < 300:
            raise DeliveryError(f"HTTP {resp.status_code}: {clip(str(resp.body).strip(), 200)}",
                                retry_after_s=retry_after_s(resp.status_code, resp.headers or {}))


_SENDERS: dict[str, type[_Sender]] = {"webhook": _WebhookSender, "slack": _SlackSender}


class _wait_retry_after(wait_base):
    """``fallback``'s wait, or longer when the sink asked for it (a 429's Retry-After)."""

    def __init__(self, fallback: wait_base) -> None:
        self.fallback = fallback

    def __call__(self, retry_state: RetryCallState) -> float:
        wait = self.fallback(retry_state)
        exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
        asked = exc.retry_after_s if isinstance(exc, DeliveryError) else None
        return wait if asked is None else max(wait, asked)


def _take(events: Sequence[Event], wants: Callable[[int], bool], limit: int) -> tuple[list[Event], int]:
    """The next batch from ``events`` (oldest first, all after the cursor): the first
    ``limit`` events the sink wants (``wants(i)`` for ``events[i]``), and the ``seq`` the
    cursor moves to once they are delivered (past the events it does not want, up to the
    next one it does)."""
    batch: list[Event] = []
    for i, ev in enumerate(events):
        if wants(i):
            if len(batch) == limit:
                return batch, batch[-1].seq
            batch.append(ev)
    return batch, events[-1].seq


@dataclass(frozen=True, slots=True)
class SinkStats:
    """One sink's delivery so far (this process): ``cursor`` = last ``seq`` done with,
    ``delivered`` = events answered 2xx, ``failed_attempts`` = attempts (requests) that
    were not, ``failing`` = the batch in hand has failed and is being retried,
    ``batches`` = requests answered 2xx, ``shed`` = low-value events skipped while it was
    far behind (:data:`FEED_BACKLOG_BOUND`)."""

    cursor: int
    delivered: int
    failed_attempts: int
    failing: bool
    batches: int = 0
    shed: int = 0  # events skipped while the sink was over FEED_BACKLOG_BOUND behind


class _Worker:
    __slots__ = ("target", "sender", "cursor", "wake", "task", "stopped", "failing", "delivered",
                 "failed_attempts", "batches", "shed", "shed_logged_at", "shed_unlogged")

    def __init__(self, target: Target, sender: _Sender, cursor: int) -> None:
        self.target = target
        self.sender = sender
        self.cursor = cursor
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.stopped = False  # its task has ended (set on the feed's thread, read on the daemon's)
        self.failing = False
        self.delivered = 0
        self.failed_attempts = 0
        self.batches = 0
        self.shed = 0
        self.shed_logged_at: float | None = None  # loop time of the last notify_backlog_shed line
        self.shed_unlogged = 0


class Notifier:
    """Delivers the store's events to the configured sinks (see the module docstring).

    Lifecycle: construct (no I/O; reads the sinks' URLs and keys from ``environ``),
    ``await start()`` on the daemon's loop (the thread :data:`FEED_THREAD` with its own
    loop, one worker task per sink named ``notify:<sink>``; no thread without sinks),
    ``wake()`` after each new event (``Supervisor.subscribe(notifier.wake)``), then
    ``await aclose(drain_timeout_s=...)`` (idempotent, safe after a failed start).
    ``wake``, ``stats``, ``wait_until``, ``drain`` and ``aclose`` are called from the
    daemon's loop; only the workers run on the feed's.

    Raises (constructor):
        ConfigError: a sink's ``url_env`` / ``secret_env`` variable is unset.
    """

    def __init__(self, store: Store, sinks: Sequence[SinkSpec], *, pool: str,
                 environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.pool = pool
        self.clock = clock
        self.targets = resolve_sinks(sinks, environ)
        self._workers: dict[str, _Worker] = {}
        # on the daemon's loop: set (and replaced) whenever a worker moved; signalled from the
        # feed's thread through call_soon_threadsafe, at most one signal in flight
        self._progress = asyncio.Event()
        self._progress_pending = False
        self._wake_pending = False  # a wake handed to the feed's loop has not run yet
        self._caller: asyncio.AbstractEventLoop | None = None  # the daemon's loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the feed's loop, while its workers run
        self._stop: asyncio.Event | None = None  # on the feed's loop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ready: concurrent.futures.Future[None] | None = None  # the feed's setup: done or failed
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Start the feed's thread and a worker per sink at its stored cursor (a new sink:
        at the newest event). Blocks the caller's loop only for the cursor reads; returns
        once the workers run.

        Call before the supervisor records anything new, so a new sink misses nothing
        of this run.

        Raises:
            RuntimeError: called twice.
            ValueError: the store is in memory (the feed needs a second connection to it).
            sqlite3.Error, OSError: the feed could not open its connection.
        """
        if self._started:
            raise RuntimeError("Notifier.start() was already called")
        self._started = True
        if not self.targets:
            return
        install_log_redaction()  # the logging set-up is done by now: its handlers get the filter
        if self.store.in_memory:
            raise ValueError("the feed reads the store from its own thread through a second connection: "
                             "it needs a database file, not :memory:")
        self._caller = asyncio.get_running_loop()
        cursors: dict[str, int] = {}
        for t in self.targets:  # here, before start() returns: a new sink starts at the newest event so far
            key = CURSOR_KEY.format(t.name)
            cursor = self.store.get(key)
            if cursor is None:
                cursor = self.store.last_seq()
                self.store.set(key, cursor)
            cursors[t.name] = int(cursor)
        self._ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._thread_main, args=(cursors, self._ready),
                                        name=FEED_THREAD, daemon=True)
        self._thread.start()
        await asyncio.shield(asyncio.wrap_future(self._ready))  # shielded: a cancelled start leaves it to aclose
        log.info("notifier_started", pool=self.pool, sinks=cursors)

    def wake(self, _event: Event | None = None) -> None:
        """New events exist: every worker looks. Never blocks (usable as a listener): it
        hands the wake to the feed's loop, one hand-over at a time however many events."""
        loop = self._loop
        if loop is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._wake_workers)
        except RuntimeError:  # the feed's loop has just closed: the notifier is closing
            pass

    def stats(self, sink: str) -> SinkStats:
        """Where sink ``sink`` stands (for ``/metrics`` and tests)."""
        w = self._workers[sink]
        return SinkStats(w.cursor, w.delivered, w.failed_attempts, w.failing, w.batches, w.shed)

    def collect(self) -> Iterable[Metric]:
        """Per sink: events behind and events shed (a prometheus_client custom collector;
        ``/metrics`` registers it)."""
        shed_total = CounterMetricFamily("spotvisor_feed_events_shed", "Low-value events a sink skipped while it "
                                         "was more than FEED_BACKLOG_BOUND events behind (daemon/feed/notify.py).",
                                         labels=["sink"])
        behind = GaugeMetricFamily("spotvisor_feed_backlog_events", "Events stored that a sink is not done with.",
                                   labels=["sink"])
        last = self.store.last_seq() if self._workers else 0
        for name, w in sorted(self._workers.items()):
            shed_total.add_metric([name], w.shed)
            behind.add_metric([name], max(0, last - w.cursor))
        yield shed_total
        yield behind

    async def wait_until(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``pred()`` holds, re-checked whenever a worker delivers, skips or
        fails an attempt; False after ``timeout_s`` seconds. On the daemon's loop."""
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    await self._progress.wait()
            return True
        except TimeoutError:
            return False

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every sink is done with every stored event; False after ``timeout_s`` seconds."""
        return await self.wait_until(self._caught_up, timeout_s)

    async def aclose(self, *, drain_timeout_s: float = 3.0) -> None:
        """Give the workers up to ``drain_timeout_s`` seconds to deliver what is
        queued (e.g. the final ``pool_released``), then cancel them, close the HTTP
        sessions and the feed's connection, and join its thread (in a worker thread of
        the caller's loop: the loop never blocks on it). What is left stays in the
        outbox for the next start."""
        if self._closed:
            return
        self._closed = True
        thread, ready = self._thread, self._ready
        if thread is None or ready is None:
            return
        try:
            with contextlib.suppress(Exception):  # a failed setup: start() raised it already
                await asyncio.shield(asyncio.wrap_future(ready))  # short: a connection and the sessions
            if self._loop is not None and drain_timeout_s > 0 and not self._caught_up():
                if not await self.drain(drain_timeout_s):
                    log.warning("notify_undelivered_at_close",
                                behind={w.target.name: self.store.last_seq() - w.cursor
                                        for w in self._workers.values()})
        finally:
            # the feed checks _stopping after publishing _loop: one of the two sees the other
            self._stopping = True
            loop, stop = self._loop, self._stop
            if loop is not None and stop is not None:
                with contextlib.suppress(RuntimeError):  # its loop has closed: the feed already ended
                    loop.call_soon_threadsafe(stop.set)
            await asyncio.to_thread(thread.join, _JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.error("notify_thread_not_stopped", thread=thread.name, waited_s=_JOIN_TIMEOUT_S)

    # -- internals: the feed's thread ------------------------------------------------------------
    def _thread_main(self, cursors: dict[str, int], ready: concurrent.futures.Future[None]) -> None:
        try:
            asyncio.run(self._feed(cursors, ready))
        except Exception as exc:  # after the setup (a failed one is start()'s to raise)
            log.error("task_crashed", task=FEED_THREAD, error=redact_secrets(repr(exc)))

    async def _feed(self, cursors: dict[str, int], ready: concurrent.futures.Future[None]) -> None:
        """The feed's loop: open its connection and sessions, run the workers until
        :meth:`aclose` asks, then cancel them and close what it opened, in reverse order."""
        loop = asyncio.get_running_loop()
        store: Store | None = None
        sessions: list[aiohttp.ClientSession] = []
        try:
            store = self.store.open_sibling()  # this thread's own connection (sqlite3: one thread each)
            workers: dict[str, _Worker] = {}
            for t in self.targets:
                session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=t.spec.timeout_s))
                sessions.append(session)
                workers[t.name] = _Worker(t, _SENDERS[t.spec.type](t, session, self.pool, self.clock),
                                          cursors[t.name])
            stop = asyncio.Event()
            for w in workers.values():
                w.task = asyncio.create_task(self._run(w, store), name=f"notify:{w.target.name}")
                w.task.add_done_callback(functools.partial(self._task_done, w))
            self._workers, self._stop = workers, stop
            self._loop = loop  # from here on wake() reaches the workers
        except Exception as exc:
            ready.set_exception(exc)
            await self._close_feed(sessions, store)
            return
        ready.set_result(None)
        try:
            if not self._stopping:
                await stop.wait()
        finally:
            self._loop = None
            tasks = [w.task for w in workers.values() if w.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)
            await self._close_feed(sessions, store)

    @staticmethod
    async def _close_feed(sessions: list[aiohttp.ClientSession], store: Store | None) -> None:
        for s in reversed(sessions):
            await s.close()
        if store is not None:
            store.close()

    def _wake_workers(self) -> None:  # on the feed's loop
        self._wake_pending = False  # before setting: a wake() from now on hands over again
        for w in self._workers.values():
            w.wake.set()

    def _caught_up(self) -> bool:
        last = self.store.last_seq()
        return all(w.cursor >= last or w.stopped for w in self._workers.values())

    def _moved(self) -> None:
        """A worker moved (on the feed's thread): wake the waiters on the daemon's loop."""
        caller = self._caller
        if caller is None or self._progress_pending:
            return
        self._progress_pending = True
        try:
            caller.call_soon_threadsafe(self._progressed)
        except RuntimeError:  # the daemon's loop has closed: nobody waits
            self._progress_pending = False

    def _progressed(self) -> None:  # on the daemon's loop
        self._progress_pending = False  # before setting: a move from now on signals again
        self._progress.set()
        self._progress = asyncio.Event()

    def _task_done(self, w: _Worker, t: asyncio.Task[None]) -> None:
        w.stopped = True
        if not t.cancelled() and t.exception() is not None:
            log.error("task_crashed", task=t.get_name(), error=redact_secrets(repr(t.exception())))
        self._moved()

    async def _run(self, w: _Worker, store: Store) -> None:
        """One sink's worker, on the feed's loop: reads events and node rows from the feed's
        own connection ``store`` and writes its cursor there; it touches no Supervisor object."""
        key = CURSOR_KEY.format(w.target.name)
        limit = w.target.spec.max_batch
        read = limit if w.target.wants_all else max(_READ, limit)  # a filter: look further ahead
        while True:
            await w.sender.pace()
            w.wake.clear()  # before reading: an event recorded from here on sets it again
            behind = store.last_seq() - w.cursor
            shedding = behind > FEED_BACKLOG_BOUND
            pending = store.events(since=w.cursor, limit=max(read, FEED_SHED_WINDOW) if shedding else read)
            if not pending:
                self._moved()
                await w.wake.wait()
                continue
            send = shed([(ev.kind, ev.node) for ev in pending], backlog=behind, bound=FEED_BACKLOG_BOUND)
            batch, upto = _take(pending, lambda i: send[i] and w.target.wants(pending[i].kind), limit)
            if shedding:
                self._count_shed(w, sum(1 for i, ev in enumerate(pending)
                                        if ev.seq <= upto and not send[i] and w.target.wants(ev.kind)), behind)
            if batch:
                # only the nodes this batch names, by key: reading the whole node table per
                # batch stalled the loop ~20 ms per batch with 1,000 nodes (bench/scale.py)
                nodes: dict[str, Node | None] = {}
                for ev in batch:
                    if ev.node and ev.node not in nodes:
                        nodes[ev.node] = store.node(ev.node)
                await self._deliver(w, [(ev, nodes.get(ev.node or "")) for ev in batch])
            # after the 2xx, with no await in between: a cancel during the request
            # leaves the cursor before this batch, which is then sent again
            w.cursor = upto
            store.set(key, upto)  # waits up to busy_timeout_s for the daemon's write
            self._moved()

    def _count_shed(self, w: _Worker, n: int, behind: int) -> None:
        if n <= 0:
            return
        w.shed += n
        w.shed_unlogged += n
        now = asyncio.get_running_loop().time()
        if w.shed_logged_at is None or now - w.shed_logged_at >= _SHED_LOG_EVERY_S:
            w.shed_logged_at = now
            log.warning("notify_backlog_shed", sink=w.target.name, skipped=w.shed_unlogged, behind=behind,
                        bound=FEED_BACKLOG_BOUND, note="low-value events; the newest per kind and node is sent")
            w.shed_unlogged = 0

    async def _deliver(self, w: _Worker, batch: list[tuple[Event, Node | None]]) -> None:
        try:
            prepared = w.sender.prepare(batch)
        except Exception as exc:  # noqa: BLE001 - a rendering bug: the batch goes as fallback lines, in order
            _render_failed(w.target.name, [ev for ev, _ in batch], exc)
            prepared = w.sender.prepare_fallback(batch)
        cap = w.target.spec.max_backoff_s
        first, last = batch[0][0].seq, batch[-1][0].seq
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(DeliveryError),
            wait=_wait_retry_after(wait_exponential_jitter(multiplier=min(0.5, cap), max=cap, jitter=min(0.5, cap))),
            before_sleep=lambda rs: self._attempt_failed(w, first, last, len(batch), rs),
        )  # no stop: retried for as long as the sink is down; the same batch each time
        async for attempt in retrying:
            with attempt:
                await w.sender.send(prepared)
        w.delivered += len(batch)
        w.batches += 1
        if w.failing:
            w.failing = False
            log.info("notify_recovered", sink=w.target.name, seq=first, last_seq=last)

    def _attempt_failed(self, w: _Worker, first: int, last: int, n: int, rs: RetryCallState) -> None:
        w.failing = True
        w.failed_attempts += 1
        self._moved()
        exc = rs.outcome.exception() if rs.outcome is not None else None
        wait = rs.next_action.sleep if rs.next_action is not None else math.nan
        log.warning("notify_attempt_failed", sink=w.target.name, seq=first, last_seq=last, events=n,
                    attempt=rs.attempt_number, error=redact_secrets(str(exc)), retry_in_s=round(wait, 2))
