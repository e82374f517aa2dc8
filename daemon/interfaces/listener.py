"""The agent port's listener: bounded connections, an accept loop that survives EMFILE.

The agent port is reachable by anyone on the nodes' network and unauthenticated
until a request's token is read, so what a connection costs the daemon (one file
descriptor, one aiohttp handler) is bounded here, before aiohttp sees it:

- **an accept loop of its own** (``loop.sock_accept``, then
  ``loop.connect_accepted_socket`` with the TLS context): a connection is counted from
  the moment it is accepted, TLS handshake included (asyncio's own server counts
  nothing, and on Python 3.11 logs a traceback per ``accept()`` that fails with EMFILE,
  ~2,700 a second, and retries each of them: issue 25);
- **caps** (:func:`daemon.control.bounds.connection_caps`): at most ``total``
  connections open, sized from ``RLIMIT_NOFILE`` at start (:func:`nofile_limit`), and
  at most ``per_peer`` from one address. A connection over a cap is closed at once
  (``refused``, counted per reason);
- **first request in** ``first_request_s`` (10 s): a connection whose TLS handshake
  and first request's head have not arrived by then is closed (slowloris, or a
  connection opened and left idle). The body has its own bound (the handler reads it
  within :data:`BODY_READ_S`), and between requests aiohttp's ``keepalive_timeout``
  closes an idle connection (:data:`KEEPALIVE_S`);
- **accept failures** for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS,
  ENOMEM) are counted and logged at most once per :data:`LOG_EVERY_S` with the count
  since the last line; the loop then waits for a connection to close (or 1 s) before
  it accepts again, instead of spinning on a socket that stays readable.

 The metrics port (``daemon.metrics_host``: loopback or a private address, no
authentication) runs the same listener with small caps (:data:`METRICS_CAPS`), so
a scraper's connections are bounded as an agent's are.

:class:`LoopAcceptErrors` does the same for the daemon's other listener (the control
socket), which stays asyncio's: it rate-limits the loop's
``socket.accept() out of system resource`` reports. Counts are exported by
:meth:`AgentListener.collect` (``/metrics``).
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
import ssl
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from daemon.control.bounds import ConnectionCaps, connection_caps
from daemon.controlnode.core import wait_event
from daemon.hosts import bind_fix

__all__ = ["AgentListener", "ListenError", "LoopAcceptErrors", "nofile_limit", "agent_connection_caps",
           "FIRST_REQUEST_S", "BODY_READ_S", "KEEPALIVE_S", "LOG_EVERY_S", "METRICS_CAPS", "SHUTDOWN_S"]

log = structlog.get_logger("spotvisor.daemon")

FIRST_REQUEST_S = 10.0  # TLS handshake + the first request's line and headers (seconds)
BODY_READ_S = 30.0  # a request's body, once its head is in (seconds; read by the handler)
# an idle connection between requests (seconds): longer than the agents' own keep-alive
# (daemon.gpunode.daemon_link.KEEPALIVE_S, 660 s), so the agent closes first and never sends on a
# connection the daemon is closing; aiohttp's default is 3,630 s
KEEPALIVE_S = 720.0
# a stopping daemon's wait for a request still in flight on any of its listeners (seconds),
# then the handler is cancelled: aiohttp's default is 60 s, and a peer stalled in its body
# would hold the stop (and the unit's TimeoutStopSec=) for BODY_READ_S; an agent whose
# request is cut off sends it again, to this daemon's successor
SHUTDOWN_S = 1.0
LOG_EVERY_S = 10.0  # at most one line per kind of trouble this often (seconds)
_ACCEPT_RETRY_S = 1.0  # after EMFILE, accept again once a connection closes, or after this long
_BACKLOG = 1024  # the listen queue (the kernel caps it at net.core.somaxconn)
#: the metrics port's caps: a Prometheus server keeps one connection; a few scrapers, a few each
METRICS_CAPS = ConnectionCaps(total=64, per_peer=8)
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def nofile_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` (unlimited is taken as 2**20)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**20 if soft == resource.RLIM_INFINITY else int(soft)


def agent_connection_caps(max_nodes: int) -> ConnectionCaps:
    """The agent port's caps for this process's open-file limit and a pool of ``max_nodes``.

    Raises:
        ValueError: the limit is too low (one line saying how to raise it).
    """
    return connection_caps(nofile_limit(), max_nodes=max_nodes)


class _RateLimitedLog:
    """One warning per ``every_s`` for one kind of trouble, carrying the count since the last."""

    __slots__ = ("event", "every_s", "_last", "_pending")

    def __init__(self, event: str, every_s: float = LOG_EVERY_S) -> None:
        self.event, self.every_s = event, every_s
        self._last: float | None = None
        self._pending = 0

    def __call__(self, now: float, **fields: Any) -> None:
        self._pending += 1
        if self._last is not None and 0 <= now - self._last < self.every_s:
            return
        self._last = now
        log.warning(self.event, count=self._pending, per_s=self.every_s, **fields)
        self._pending = 0


class _Guarded(asyncio.Protocol):
    """The protocol asyncio drives for one counted connection: it starts the first-request
    timer, then hands everything to aiohttp's handler (``inner``) and releases the
    connection's place when it is lost."""

    __slots__ = ("_listener", "peer", "inner", "_timer", "_transport", "released")

    def __init__(self, listener: "AgentListener", peer: str) -> None:
        self._listener = listener
        self.peer = peer
        self.inner: asyncio.Protocol | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.BaseTransport | None = None
        self.released = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self.inner = self._listener.protocol_factory()
        self.inner.connection_made(transport)

    def arm(self, delay_s: float) -> None:
        """Close the connection in ``delay_s`` seconds unless a request has come in by then."""
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._overdue)

    def request_started(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _overdue(self) -> None:
        self._timer = None
        self._listener.timed_out += 1
        if self._transport is not None:  # (before it, the TLS handshake's own timeout ends the connection)
            self._transport.abort()  # nothing of ours is buffered: no request was answered

    def data_received(self, data: bytes) -> None:
        assert self.inner is not None
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.request_started()  # the timer goes
        self._listener.release(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)


class ListenError(OSError):
    """A listener that cannot bind, said in one line naming its config fields and the fix
    (``daemon.agent_host``/``agent_port``, or ``daemon.metrics_host``/``metrics_port``);
    ``errno`` is the bind's own (a takeover waits out ``EADDRINUSE``)."""

    def __init__(self, name: str, host: str, port: int, cause: OSError) -> None:
        fields = "daemon.metrics_host and metrics_port" if name == "metrics" else "daemon.agent_host and agent_port"
        why = cause.strerror or str(cause)
        fix = bind_fix(cause.errno)
        super().__init__(cause.errno, f"cannot listen on {host}:{port} ({fields}): {why}; {fix}")

    def __str__(self) -> str:
        return str(self.strerror)


class AgentListener:
    """The agent port's sockets and accept loops (module docstring). Constructor does no I/O.

    Lifecycle: ``await start(host, port)`` binds and returns the port; ``await aclose()``
    (idempotent) stops accepting and aborts the connections it holds (aiohttp's
    runner cleanup then finishes their handlers).

    Args:
        protocol_factory: makes the protocol for an admitted connection (aiohttp's
            ``web.Server``, called as asyncio would).
        caps: the connection caps (:func:`agent_connection_caps`).
        ssl_context: TLS for every connection, or None.
        first_request_s: seconds a connection has for its TLS handshake and first request head.
        name: the listener's name in its log lines and task names (``agent``, ``metrics``).
    """

    def __init__(self, protocol_factory: Callable[[], asyncio.Protocol], *, caps: ConnectionCaps,
                 ssl_context: ssl.SSLContext | None = None, first_request_s: float = FIRST_REQUEST_S,
                 name: str = "agent") -> None:
        if first_request_s <= 0:
            raise ValueError(f"first_request_s must be > 0 seconds, got {first_request_s}")
        self.protocol_factory = protocol_factory
        self.caps = caps
        self.ssl_context = ssl_context
        self.first_request_s = first_request_s
        self.open = 0
        self.per_peer: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # reason (total, per_peer) -> connections
        self.accept_errors: Counter[str] = Counter()  # errno name -> failed accept() calls
        self.timed_out = 0  # connections closed without a first request in time
        self.handshakes_failed = 0
        self._sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._guards: set[_Guarded] = set()
        self._freed = asyncio.Event()
        self._closed = False
        self.name = name
        self._log_refused = _RateLimitedLog(f"{name}_connection_refused")
        self._log_accept = _RateLimitedLog(f"{name}_accept_failed")

    async def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (every address ``host`` resolves to; port 0: a free one, the
        same for all) and start accepting. Returns the port.

        Raises:
            ListenError: the address cannot be bound (taken, not local), one line naming the fields.
        """
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as exc:
            raise ListenError(self.name, host, port, exc) from None
        seen: set[tuple[Any, ...]] = set()
        try:
            for family, type_, proto, _, addr in infos:
                if (family, addr) in seen:
                    continue
                seen.add((family, addr))
                sock = socket.socket(family, type_, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(self._sockets) > 1:  # the others on the first one's port
                    addr = (addr[0], self._sockets[0].getsockname()[1], *addr[2:])
                sock.bind(addr)
                sock.listen(_BACKLOG)
                sock.setblocking(False)
        except OSError as exc:
            self._close_sockets()
            raise ListenError(self.name, host, port, exc) from None
        for sock in self._sockets:
            self._spawn(self._accept_loop(sock), f"{self.name}-accept:{sock.getsockname()[1]}")
        return int(self._sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_sockets()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for g in list(self._guards):
            if g.inner is None:  # not yet handed to aiohttp: aiohttp's cleanup does not know it
                self.release(g)

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("task_crashed", task=t.get_name(), error=repr(t.exception()))

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                    self.accept_errors[name] += 1
                    self._log_accept(loop.time(), error=name, open=self.open, limit_nofile=nofile_limit(),
                                     note="accept() waits for a connection to close")
                    self._freed.clear()
                    await wait_event(self._freed, _ACCEPT_RETRY_S)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # the client gave up before accept(), or a firewall said no
                raise
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        peer = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
        reason = "total" if self.open >= self.caps.total else \
            "per_peer" if self.per_peer[peer] >= self.caps.per_peer else None
        if reason is not None:
            conn.close()
            self.refused[reason] += 1
            self._log_refused(asyncio.get_running_loop().time(), reason=reason, peer=peer, open=self.open,
                              cap=self.caps.total if reason == "total" else self.caps.per_peer)
            return
        self.open += 1
        self.per_peer[peer] += 1
        guard = _Guarded(self, peer)
        self._guards.add(guard)
        guard.arm(self.first_request_s)  # from accept: the TLS handshake counts too
        self._spawn(self._connect(conn, guard), f"{self.name}-connection")

    async def _connect(self, conn: socket.socket, guard: _Guarded) -> None:
        """Hand ``conn`` to asyncio (and its TLS handshake); a failed handshake frees its place."""
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            await loop.connect_accepted_socket(lambda: guard, conn, ssl=self.ssl_context,
                                               ssl_handshake_timeout=self.first_request_s if self.ssl_context else None)
        except asyncio.CancelledError:
            conn.close()
            self.release(guard)
            raise
        except (OSError, ssl.SSLError, TimeoutError) as exc:  # a TLS handshake that failed or took too long
            self.handshakes_failed += 1
            log.debug("agent_handshake_failed", peer=guard.peer, error=repr(exc)[:200])
            conn.close()
            self.release(guard)

    def release(self, guard: _Guarded) -> None:
        """``guard``'s connection is gone: free its place (once)."""
        if guard.released:
            return
        guard.released = True
        self._guards.discard(guard)
        self.open -= 1
        self.per_peer[guard.peer] -= 1
        if self.per_peer[guard.peer] <= 0:
            del self.per_peer[guard.peer]
        self._freed.set()

    @staticmethod
    def request_started(transport: asyncio.BaseTransport | None) -> None:
        """A request's head has arrived on ``transport``: its first-request timer stops
        (the aiohttp middleware of the agent app calls this)."""
        guard = transport.get_protocol() if transport is not None else None
        if isinstance(guard, _Guarded):
            guard.request_started()

    def collect(self) -> Iterable[Metric]:
        """The listener's counts as Prometheus metrics (a prometheus_client custom collector)."""
        yield GaugeMetricFamily("spotvisor_agent_connections", "Connections open on the agent port.", value=self.open)
        limit = GaugeMetricFamily("spotvisor_agent_connections_limit", "The agent port's connection caps "
                                  "(daemon/control/bounds.py), by scope.", labels=["scope"])
        limit.add_metric(["total"], self.caps.total)
        limit.add_metric(["per_peer"], self.caps.per_peer)
        yield limit
        refused = CounterMetricFamily("spotvisor_agent_connections_refused", "Connections closed at accept: "
                                      "over the total or the per-address cap.", labels=["reason"])
        for reason in ("total", "per_peer"):
            refused.add_metric([reason], self.refused[reason])
        yield refused
        yield CounterMetricFamily("spotvisor_agent_connections_timed_out", "Connections closed for sending no "
                                  "request head within the first-request timeout.", value=self.timed_out)
        yield CounterMetricFamily("spotvisor_agent_tls_handshakes_failed", "TLS handshakes on the agent port "
                                  "that failed or timed out.", value=self.handshakes_failed)
        errors = CounterMetricFamily("spotvisor_accept_errors", "accept() calls that failed for want of "
                                     "descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), by errno and "
                                     "listener.", labels=["errno", "listener"])
        for name, n in sorted(self.accept_errors.items()):
            errors.add_metric([name, "agent"], n)
        for name, n in sorted(LoopAcceptErrors.counts.items()):
            errors.add_metric([name, "other"], n)
        yield errors


class LoopAcceptErrors:
    """An asyncio exception handler that turns the loop's per-attempt ``socket.accept()
    out of system resource`` reports (its own servers: the control socket, the metrics
    port) into one line per :data:`LOG_EVERY_S` and a count; every other context goes
    to the handler that was there before. ``install()`` / ``uninstall()`` on the running loop."""

    counts: Counter[str] = Counter()  # errno name -> reports, for the process (one loop per daemon)

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: Any = None
        self._log = _RateLimitedLog("accept_failed")

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._previous = self._loop.get_exception_handler()
        self._loop.set_exception_handler(self._handle)

    def uninstall(self) -> None:
        if self._loop is not None and self._loop.get_exception_handler() == self._handle:
            self._loop.set_exception_handler(self._previous)
        self._loop = None

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == "socket.accept() out of system resource" and isinstance(exc, OSError):
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            LoopAcceptErrors.counts[name] += 1
            self._log(loop.time(), error=name, listener="control")
            return
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)
