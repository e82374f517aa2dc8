"""The feed's sinks: which ones a config names, and how one batch of events reaches one.

:func:`resolve_sinks` reads each sink's URL and signing key from the environment into a
:class:`Target`; a sender per sink type sends one batch and raises
:class:`DeliveryError` unless the sink answered 2xx (the delivery loop,
:mod:`daemon.feed.notify`, retries it). What an event says is
:mod:`daemon.feed.feed_messages`; the signature is :mod:`daemon.feed.signing`.

**Generic webhook** (``type: webhook``): ``POST url`` with ``Content-Type:
application/json`` and the UTF-8 JSON body
(:func:`~daemon.feed.feed_messages.webhook_batch_body`)
``{"pool": ..., "events": [{"seq", "time", "kind", "node", "data", "text"}, ...]}``:
one to ``max_batch`` (default 100) events, oldest first (``time``: unix seconds the
event was recorded; ``text``: the sink's template or the default line), signed anew at
each attempt (``X-Spotvisor-Timestamp``, ``X-Spotvisor-Signature``).

**Slack** (``type: slack``): an incoming webhook through slack-sdk's
``AsyncWebhookClient``; messages are Block Kit built from ``slack_sdk.models.blocks``
(valid by construction, checked on serialisation). Slack takes about one message a
second per hook (short bursts allowed, then 429 with ``Retry-After``), so the sender
sends at most one message per :data:`SLACK_MIN_INTERVAL_S` and what arrives meanwhile
joins the next message (:meth:`Sender.pace`).

Secret URLs: a URL from ``url_env`` and every Slack hook URL is registered with the
caller's :class:`~daemon.feed.redaction.Redactor`; a delivery error (aiohttp's quotes
the URL) is redacted by it before it is raised or logged.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import aiohttp
import structlog
from slack_sdk.errors import SlackObjectFormationError
from slack_sdk.webhook.async_client import AsyncWebhookClient

from daemon.config import ConfigError, SinkSpec
from daemon.feed.feed_messages import (SLACK_TEXT_MAX_CHARS, SlackMessage, clip, fallback_text, render_text,
                                       slack_digest, slack_escape, webhook_batch_body)
from daemon.feed.redaction import SLACK_SDK_LOGGER, Redactor
from daemon.feed.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from daemon.model import Event, Node

__all__ = ["Target", "resolve_sinks", "DeliveryError", "retry_after_s", "Sender", "SENDERS", "render_failed",
           "RETRY_AFTER_MAX_S", "SLACK_MIN_INTERVAL_S"]

log = structlog.get_logger("spotvisor.notify")

RETRY_AFTER_MAX_S = 3600.0  # a Retry-After longer than this is taken as this
# Slack's incoming webhooks: about one message a second per hook (docs.slack.dev, "Rate
# limits": posting messages 1 per second, short bursts allowed, then HTTP 429 + Retry-After)
SLACK_MIN_INTERVAL_S = 1.0


class DeliveryError(Exception):
    """A sink did not answer 2xx, or could not be reached in ``timeout_s``; retried.

    The message is redacted by the raiser (its sender's redactor). ``retry_after_s``:
    the wait the sink asked for (a 429's ``Retry-After``), or None."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
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


def resolve_sinks(specs: Sequence[SinkSpec], environ: Mapping[str, str] | None = None, *,
                  redactor: Redactor) -> list[Target]:
    """Read each sink's ``url_env`` / ``secret_env`` from ``environ`` (default ``os.environ``).

    Every URL read from ``url_env``, and every Slack hook URL, is registered with
    ``redactor`` (:meth:`Redactor.add_url`): what it redacts shows it as ``scheme://host/…``.

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
                redactor.add_url(url)
            out.append(Target(spec, url, secret))
    if problems:
        raise ConfigError(problems)
    return out


def render_failed(sink: str, events: Sequence[Event], exc: BaseException, redactor: Redactor) -> None:
    """Log once that rendering ``events`` for ``sink`` raised (a bug): they go as fallback lines."""
    log.error("notify_render_failed", sink=sink, seq=events[0].seq, last_seq=events[-1].seq,
              kinds=sorted({str(ev.kind) for ev in events}), error=redactor.redact(clip(repr(exc), 500)),
              sent="a fallback line per event")


class Sender:
    """Sends one batch of events to one sink; raises :class:`DeliveryError` unless it answered 2xx."""

    def __init__(self, target: Target, session: aiohttp.ClientSession, *, pool: str,
                 clock: Callable[[], float], redactor: Redactor) -> None:
        self.target = target
        self.session = session
        self.pool = pool
        self.clock = clock
        self.redactor = redactor

    async def pace(self) -> None:
        """Return when the sink takes the next request (a rate-limited one: its next slot).
        The worker reads the next batch after this, so what arrives meanwhile joins it."""

    def prepare(self, batch: Sequence[tuple[Event, Node | None]]) -> Any:
        raise NotImplementedError

    def prepare_fallback(self, batch: Sequence[tuple[Event, Node | None]]) -> Any:
        """What is sent when :meth:`prepare` raised (a bug): each event's kind and ``seq``."""
        raise NotImplementedError

    async def send(self, prepared: Any) -> None:
        raise NotImplementedError

    def _text(self, ev: Event, node: Node | None, *, log_failure: bool = True) -> str:
        """The event's line for this sink; its fallback line if rendering raised (logged
        once, unless ``log_failure`` is False: the caller has logged it)."""
        try:
            return render_text(ev, pool=self.pool, node=node, template=self.target.template_for(ev.kind))
        except Exception as exc:  # noqa: BLE001 - one event must not stop the sink
            if log_failure:
                render_failed(self.target.name, [ev], exc, self.redactor)
            return fallback_text(ev)

    def _error(self, message: str, *, retry_after: float | None = None) -> DeliveryError:
        return DeliveryError(self.redactor.redact(message), retry_after_s=retry_after)


class WebhookSender(Sender):
    """``type: webhook``: a signed JSON batch (the module docstring)."""

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
                    raise self._error(f"HTTP {r.status}: {clip((await r.text()).strip(), 200)}",
                                      retry_after=retry_after_s(r.status, r.headers))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._error(f"{type(exc).__name__}: {exc}") from None  # its URL: not kept on the chain


class SlackSender(Sender):
    """``type: slack``: Block Kit through slack-sdk, one message per :data:`SLACK_MIN_INTERVAL_S`."""

    def __init__(self, target: Target, session: aiohttp.ClientSession, *, pool: str,
                 clock: Callable[[], float], redactor: Redactor) -> None:
        super().__init__(target, session, pool=pool, clock=clock, redactor=redactor)
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
                      last_seq=batch[-1][0].seq, error=self.redactor.redact(str(exc)))
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
            raise self._error(f"{type(exc).__name__}: {exc}") from None  # its URL: not kept on the chain
        finally:
            # the next slot counts from the answer: Slack saw this message by then, so the
            # next one reaches it at least the interval later however slow the way there
            self._next_at = asyncio.get_running_loop().time() + SLACK_MIN_INTERVAL_S
        if not 200 <= resp.status_code < 300:
            raise self._error(f"HTTP {resp.status_code}: {clip(str(resp.body).strip(), 200)}",
                              retry_after=retry_after_s(resp.status_code, resp.headers or {}))


SENDERS: dict[str, type[Sender]] = {"webhook": WebhookSender, "slack": SlackSender}
