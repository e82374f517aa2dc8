"""The node agent's channel to the daemon's agent port (:mod:`daemon.gpunode.agent`).

One :class:`DaemonLink` per agent owns:

- the HTTP session: the node's bearer token on every request, a connection kept between
  heartbeats however far apart the daemon sets them (:data:`KEEPALIVE_S`), and TLS. With
  an ``https://`` daemon URL and a CA file (the daemon's CA, which it hands to each node
  it launches: :mod:`daemon.controlnode.tls`) the agent trusts that CA only
  (:func:`daemon_ssl_context`) and checks the daemon's name against its certificate;
  with none, the system's store. A plain ``http://`` URL is taken only for a loopback
  host (:func:`check_daemon_url`): the token never crosses the network in clear.
- registration, retried while the daemon is unreachable (0.2 s, 0.4 s, ... at most 5 s
  apart, for good). A daemon whose certificate does not verify never sees a request (the
  handshake fails first): ``daemon_certificate_untrusted`` is logged and the call retried.
- the outbox: reports (``interruption_notice``, ``trainer_status``, ...) delivered in
  order, in requests the daemon takes (:data:`~daemon.control.bounds.MAX_REPORTS_PER_POST`
  reports and :data:`~daemon.control.bounds.MAX_AGENT_BODY_BYTES` each), retried while
  the daemon is unreachable (each report numbered, so a batch sent again after a lost
  answer is applied once); a retry waits no longer once another call finds the daemon
  back (a restarted daemon gets the queue at once, not up to 5 s after its first
  heartbeat). :attr:`DaemonLink.reports_pending` (each heartbeat says it) counts the
  reports not yet answered: the daemon releases a drained node only once it is 0, so a
  node's last reports (the commit that answers its notice) never die with it.
- the command long-poll: one ``POST /v1/agent/commands`` outstanding, so a command
  reaches the node at once however long the heartbeat interval is. A daemon without the
  route (404/405: an older one) ends it: commands then come with the heartbeat replies.

Lifecycle: the constructor does no I/O; ``await open()`` makes the session (reads the CA
file in a thread); ``await aclose()`` closes it (idempotent).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from tenacity import (AsyncRetrying, retry_if_exception, retry_if_exception_type,
                      wait_exponential, wait_exponential_jitter)

from daemon.control.bounds import MAX_AGENT_BODY_BYTES, MAX_REPORTS_PER_POST
from daemon.gpunode.outage import Line, Outage
from daemon.hosts import is_loopback

__all__ = ["COMMAND_WAIT_S", "KEEPALIVE_S", "MAX_HEARTBEAT_INTERVAL_S", "DaemonLink", "check_daemon_url", "daemon_urls",
           "daemon_ssl_context"]

log = structlog.get_logger("spotvisor.agent")

# the command long-poll: how long the agent asks the daemon to hold it (the daemon holds
# it a random share of its agent.command_wait_s, at most), and how long
# past that the agent waits for the answer before it gives up on the request
COMMAND_WAIT_S = 600.0
_COMMAND_SLACK_S = 10.0
# a told heartbeat interval outside (0, this] is not used (seconds)
MAX_HEARTBEAT_INTERVAL_S = 600.0
# an idle connection to the daemon is kept this long (seconds): longer than any heartbeat
# interval used, shorter than aiohttp's server keep-alive (3630 s)
KEEPALIVE_S = MAX_HEARTBEAT_INTERVAL_S + 60.0
_ENVELOPE_BYTES = 512  # {"node_id": ..., "events": []} around the reports, with room to spare


def daemon_ssl_context(ca_file: str | os.PathLike[str] | None) -> ssl.SSLContext | None:
    """The TLS client context for the daemon: trusting the CA certificate(s) in
    ``ca_file`` only (``create_default_context`` with a ``cafile`` loads no system
    store), names checked, TLS 1.2 or later; None without a file (aiohttp then uses
    the system's store for an https URL). Blocking (reads the file).

    Raises:
        OSError: the file cannot be read; ``ssl.SSLError`` (an OSError): not PEM.
    """
    if ca_file is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.fspath(ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def daemon_urls(value: str) -> list[str]:
    """The daemon URLs in ``--daemon-url``: one, or an HA pool's control nodes
    comma-separated (``ha.agent_urls``), each checked by :func:`check_daemon_url`.

    Raises:
        ValueError: one line naming the URL and the fix; also for an empty or repeated one.
    """
    given = [u.strip() for u in value.split(",")]
    if not all(given):
        raise ValueError(f"--daemon-url {value!r} has an empty item (give URLs separated by single commas)")
    for url in given:
        check_daemon_url(url)
    urls = [u.rstrip("/") for u in given]
    if len(set(urls)) != len(urls):
        raise ValueError(f"--daemon-url {value!r} names a URL twice (give each control node once)")
    return urls


def check_daemon_url(url: str) -> None:
    """Refuse a daemon URL that would carry this node's token in clear beyond the machine:
    ``https://`` anywhere, ``http://`` only to a loopback host (localhost, 127.0.0.0/8, ::1).

    Raises:
        ValueError: one line naming the URL and the fix.
    """
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    if scheme == "https" and host:
        return
    if scheme == "http" and host and is_loopback(host):
        return
    if scheme not in ("http", "https") or not host:
        raise ValueError(f"--daemon-url {url!r} is not an http(s) URL with a host (e.g. https://10.0.0.10:7480)")
    raise ValueError(f"--daemon-url {url} is plain http to a host that is not loopback: the node's token would "
                     "cross the network in clear; use the https URL the daemon serves (daemon.agent_tls: auto, "
                     "with --ca-file), or a loopback address")


def _until_daemon_answers(sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncRetrying:
    """Retry a call to the daemon while it is unreachable: 0.2 s, 0.4 s, ... at most 5 s apart, for good.
    An untrusted certificate is retried too: from here it is a network fault. The failures
    are logged by :meth:`DaemonLink.post` (:class:`~daemon.gpunode.outage.Outage`).
    ``sleep(seconds)``: the wait between tries (one that may end early)."""
    return AsyncRetrying(
        retry=retry_if_exception_type((aiohttp.ClientError, asyncio.TimeoutError)),
        wait=wait_exponential(multiplier=0.1, min=0.2, max=5.0),
        sleep=sleep,
        reraise=True,
    )


def failure_reason(exc: BaseException) -> str | None:
    """The kind of a failed call to the daemon, for :class:`~daemon.gpunode.outage.Outage`:
    ``certificate_untrusted``, ``unreachable`` (no connection), ``timeout``, ``http_5xx``
    (it answered that it cannot serve: a restart, a standby, not durable yet) or
    ``disconnected``; None when the daemon answered (a 4xx: it is there)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "certificate_untrusted"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "unreachable"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"http_{exc.status}" if exc.status >= 500 else None
    return "disconnected" if isinstance(exc, aiohttp.ClientError) else None


def _next_batch(pending: list[tuple[dict[str, Any], int]]) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], int]]]:
    """The oldest reports of ``pending`` that fit one request (count and bytes), and the
    rest. A report that could never fit is dropped with one log line (the daemon would
    answer 413 to it for ever, holding back every report after it)."""
    batch: list[dict[str, Any]] = []
    size = _ENVELOPE_BYTES
    i = 0
    while i < len(pending) and len(batch) < MAX_REPORTS_PER_POST:
        report, n = pending[i]
        if _ENVELOPE_BYTES + n > MAX_AGENT_BODY_BYTES:
            log.error("report_too_large", kind=str(report.get("kind"))[:40], bytes=n, limit=MAX_AGENT_BODY_BYTES)
            i += 1
            continue
        if size + n > MAX_AGENT_BODY_BYTES:
            break
        batch.append(report)
        size += n
        i += 1
    return batch, pending[i:]


def _no_command_route(exc: BaseException) -> bool:
    """The daemon has no command long-poll (an older one): heartbeats carry the commands."""
    return isinstance(exc, aiohttp.ClientResponseError) and exc.status in (404, 405)


def _command_poll_retryable(exc: BaseException) -> bool:
    return isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)) and not _no_command_route(exc)


class DaemonLink:
    """One node's channel to the daemon (see the module docstring).

    Args:
        daemon_url: the daemon's agent port, e.g. ``https://10.0.0.2:7480``; or, for an HA
            pool, every control node's, comma-separated (:func:`daemon_urls`): the link
            uses one at a time and moves to the next when a call finds no daemon serving
            there (no connection, a timeout, a 5xx: a standby binds nothing and a deposed
            leader answers 503), so it follows the leader without a floating address.
        token: this node's bearer token (issued by the daemon at launch).
        node_id: this node's id in the pool (sent in every request body).
        ca_file: the daemon's CA certificate (PEM) or None (the system's store).
        command_wait_s: how long each command long-poll may be held (seconds).

    Raises:
        ValueError: a URL is plain http to a host that is not loopback, or the list is malformed.
    """

    def __init__(self, *, daemon_url: str, token: str, node_id: str,
                 ca_file: str | os.PathLike[str] | None = None, command_wait_s: float = COMMAND_WAIT_S) -> None:
        self.urls = daemon_urls(daemon_url)
        self._at = 0  # the URL calls go to now
        self.token = token
        self.node_id = node_id
        self.ca_file = ca_file
        self.command_wait_s = command_wait_s
        self.session: aiohttp.ClientSession | None = None
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._unanswered = 0  # reports queued and not yet answered by a daemon
        # this agent process's id and its reports' numbers: a batch sent again after a lost
        # answer is applied once (daemon.control.reports.fresh)
        self.incarnation = secrets.token_hex(8)
        self._numbered = 0
        self._back = asyncio.Event()  # set when a call is answered after an outage
        self.outage = Outage()  # what is said while the daemon is out of reach

    async def open(self) -> None:
        """Make the session. Raises OSError (``ssl.SSLError``): the CA file cannot be used."""
        tls = await asyncio.to_thread(daemon_ssl_context, self.ca_file)
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=10),
            # keep the connection between heartbeats however far apart the daemon sets them
            # (aiohttp's default, 15 s, would open a new one for each heartbeat of a big pool).
            # ssl=True: verify against the system's store (an https URL without a CA file)
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, ssl=True if tls is None else tls),
        )

    @property
    def daemon_url(self) -> str:
        """The URL calls go to now."""
        return self.urls[self._at]

    def _move_on(self, failed_at: int) -> None:
        """The daemon at ``urls[failed_at]`` did not serve: the next call goes to the next
        URL, unless a concurrent call has moved on already (calls fail together)."""
        if len(self.urls) > 1 and self._at == failed_at:
            self._at = (failed_at + 1) % len(self.urls)
            log.info("daemon_url_next", tried=self.urls[failed_at], next=self.urls[self._at])

    async def aclose(self) -> None:
        """Close the session (idempotent)."""
        if self.session is not None:
            await self.session.close()

    async def post(self, path: str, body: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` (with this node's id) to ``path``; the JSON reply.

        Raises:
            PermissionError: the daemon refused this node's token (401).
            aiohttp.ClientError, asyncio.TimeoutError: any other failure.
            RuntimeError: before :meth:`open`.
        """
        if self.session is None:
            raise RuntimeError("DaemonLink is not open; call 'await link.open()' first")
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        at = self._at
        try:
            async with self.session.post(f"{self.urls[at]}{path}", json={"node_id": self.node_id, **body},
                                         timeout=timeout) as r:
                if r.status == 401:
                    raise PermissionError("the daemon refused this node's token")
                r.raise_for_status()
                reply = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._back.clear()  # a retry waits its time again
            call, reason = path.rsplit("/", 1)[-1], failure_reason(exc)
            if reason is not None:
                _say(self.outage.failed(time.monotonic(), call, reason, str(exc) or repr(exc)))
                self._move_on(at)
                raise
            self._answered()  # with a refusal: said each time
            if not _no_command_route(exc):  # an older daemon without the long-poll: said by poll_commands
                log.warning("daemon_refused", call=call, status=getattr(exc, "status", None), error=str(exc)[:300])
            raise
        self._answered()
        return reply

    def _answered(self) -> None:
        """A call was answered: an outage ends (said once), and a retry waiting on it goes now."""
        line = self.outage.answered(time.monotonic())
        if line is not None:
            _say(line)
            self._back.set()

    async def _retry_wait(self, seconds: float) -> None:
        """The report retry's wait: ``seconds``, or less if a call has found the daemon back
        since the last one failed."""
        try:
            async with asyncio.timeout(seconds):
                await self._back.wait()
        except TimeoutError:
            pass

    @property
    def reports_pending(self) -> int:
        """Reports queued by :meth:`report` that no daemon has answered yet (each heartbeat says it)."""
        return self._unanswered

    async def register(self) -> dict[str, Any]:
        """Register until the daemon answers (retried 0.2 s, 0.4 s, ... up to 5 s apart); its reply."""
        async for attempt in _until_daemon_answers():
            with attempt:
                # "prewarm": this agent starts a torchrun job's process at once and says
                # in its heartbeats when it is warm (the daemon waits for that to admit it)
                reply = await self.post("/v1/agent/register", {"pid": os.getpid(), "prewarm": True})
        return reply

    def report(self, kind: str, **data: Any) -> None:
        """Queue one report (``kind``, now, ``data``, and its number ``seq``: 1, 2, ... in this
        process) for :meth:`deliver_reports`. Never blocks."""
        self._numbered += 1
        self._outbox.put_nowait({"kind": kind, "time": time.time(), **data, "seq": self._numbered})
        self._unanswered += 1

    async def deliver_reports(self) -> None:
        """Deliver reports in order, for good, retrying while the daemon is unreachable (0.2 s
        up to 5 s apart), in requests the daemon takes: at most ``MAX_REPORTS_PER_POST`` reports
        and ``MAX_AGENT_BODY_BYTES`` (:mod:`daemon.control.bounds`) each."""
        pending: list[tuple[dict[str, Any], int]] = []  # report, its JSON size (bytes)
        while True:
            if not pending:
                pending.append(_sized(await self._outbox.get()))
            while not self._outbox.empty():
                pending.append(_sized(self._outbox.get_nowait()))
            batch, pending = _next_batch(pending)
            if not batch:
                continue
            async for attempt in _until_daemon_answers(self._retry_wait):
                with attempt:
                    await self.post("/v1/agent/events", {"events": batch, "agent": self.incarnation})
            self._unanswered -= len(batch)

    async def poll_commands(self, apply: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Keep one command long-poll outstanding and ``apply`` each answer. Errors back off
        (tenacity, up to 5 s); a daemon without the route (404) ends this loop: the
        heartbeat replies carry the commands then."""
        while True:
            retrying = AsyncRetrying(
                retry=retry_if_exception(_command_poll_retryable),
                wait=wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2),
                reraise=True,
            )
            try:
                async for attempt in retrying:
                    with attempt:
                        reply = await self.post("/v1/agent/commands", {"wait_s": self.command_wait_s},
                                                timeout_s=self.command_wait_s + _COMMAND_SLACK_S)
            except aiohttp.ClientResponseError as exc:
                if not _no_command_route(exc):
                    raise
                log.info("command_channel_unavailable", node_id=self.node_id, status=exc.status,
                         note="the daemon has no command long-poll; commands come with heartbeats")
                return
            await apply(reply)


def _say(line: Line | None) -> None:
    if line is not None:
        getattr(log, line.level)(line.event, **line.fields)


def _sized(report: dict[str, Any]) -> tuple[dict[str, Any], int]:
    return report, len(json.dumps(report).encode()) + 2  # and the ", " between reports
