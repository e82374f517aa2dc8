"""spotvisord as a systemd service: readiness, watchdog, and a clean stop.

``spotvisord run`` (``systemd/spotvisord.service``, ``Type=notify``) goes through
:func:`serve`:

1. the daemon starts (store, control API, reconciler: :func:`daemon.interfaces.cli.running_daemon`);
2. ``READY=1`` (with a ``STATUS=`` line) tells systemd the service is up;
3. every ``WatchdogSec/2`` a task **on the daemon's own event loop** sends
   ``WATCHDOG=1``. A loop blocked by a stuck call runs no task, so the pings stop
   and systemd kills and restarts the daemon (``Restart=on-failure``); so does a
   reconciler that has died (no ping while :meth:`Supervisor.is_healthy` is false);
4. SIGTERM/SIGINT, or the pool released after the job completed → ``STOPPING=1``,
   the daemon closes, exit 0. A stop leaves the job alone: cloud instances and the
   rendezvous store keep running and the next daemon finds them in the store
   (instances of the ``local`` provider are the daemon's children and end with it).

The protocol is sd_notify(3)
(https://www.freedesktop.org/software/systemd/man/latest/sd_notify.html): one
datagram of newline-separated ``VAR=value`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` is the abstract namespace). It is written out
here rather than taken from the ``sdnotify`` package, whose 0.3 API reads the
address only from the environment, blocks on send and swallows every error.
Without ``$NOTIFY_SOCKET`` (not under systemd) every call is a no-op. The
watchdog interval follows sd_watchdog_enabled(3): ``$WATCHDOG_USEC`` microseconds,
ignored when ``$WATCHDOG_PID`` names another process.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import signal
import socket
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from daemon.controlnode.supervisor import Supervisor

__all__ = ["SdNotifier", "watchdog_interval_s", "status_line", "serve"]

log = structlog.get_logger("spotvisor.service")


class SdNotifier:
    """Sends sd_notify messages to the service manager; a no-op without a socket.

    Constructor does no I/O; the socket is made on the first :meth:`send` and
    released by :meth:`close` (idempotent). Each message is one ``sendto`` on a
    non-blocking AF_UNIX datagram socket, as libsystemd's sd_notify does, so a send
    never blocks the event loop and never raises: a message that cannot be sent
    (systemd's queue full, socket gone) is logged and dropped; a lost ping is
    systemd's to judge, not a crash of ours.

    Args:
        address: the ``$NOTIFY_SOCKET`` value: an absolute path, or ``@name`` for the
            abstract namespace. None or "" disables the notifier; any other form
            (e.g. ``vsock:``) is logged once and disables it.
    """

    __slots__ = ("address", "_target", "_sock")

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._target: str | bytes | None = None
        if self.address is not None:
            if self.address.startswith("@"):
                self._target = b"\0" + self.address[1:].encode()
            elif self.address.startswith("/"):
                self._target = self.address
            else:
                log.warning("sd_notify_unsupported_address", address=self.address)
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SdNotifier":
        """The notifier for ``$NOTIFY_SOCKET`` (disabled when it is unset)."""
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self._target is not None

    def send(self, **fields: str | int) -> bool:
        """Send one datagram of ``NAME=value`` lines (e.g. ``READY=1``, ``STATUS=...``).

        Returns True if it was sent (False: disabled, or the send failed).
        """
        if self._target is None:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(msg.encode(), self._target)
        except OSError as exc:  # EAGAIN (queue full), ENOENT/ECONNREFUSED (no listener)
            log.warning("sd_notify_failed", message=msg.split("\n", 1)[0], error=str(exc))
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def watchdog_interval_s(environ: Mapping[str, str] = os.environ, *, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, or None (no watchdog).

    None when ``$WATCHDOG_USEC`` is unset, or ``$WATCHDOG_PID`` is set to a pid
    other than ``pid`` (default: this process), as sd_watchdog_enabled(3) says.

    Raises:
        ValueError: ``$WATCHDOG_USEC`` or ``$WATCHDOG_PID`` is not a positive integer.
    """
    raw = environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    owner = environ.get("WATCHDOG_PID")
    if owner:
        if not owner.isdigit() or int(owner) <= 0:
            raise ValueError(f"WATCHDOG_PID={owner!r} is not a process id")
        if int(owner) != (os.getpid() if pid is None else pid):
            return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"WATCHDOG_USEC={raw!r} is not a positive number of microseconds")
    return int(raw) / 1e6 / 2


def status_line(sup: "Supervisor") -> str:
    """The one-line ``STATUS=`` that ``systemctl status spotvisord`` shows."""
    job = sup.job
    live = sum(1 for n in sup.nodes.values() if not n.state.is_terminal())
    step = "-" if job.step is None else str(job.step)
    return (f"pool {sup.pool}: job {job.state.value} at step {step}/{sup.config.job.target_steps}, "
            f"{live} live node(s), target {sup.desired_nodes}")


def awaiting(coro: object) -> list[str]:
    """``coro``'s await chain, outermost first: ``file:line function`` of each coroutine,
    generator or async generator it waits through (what a task is stuck on)."""
    out = []
    while coro is not None:
        if type(coro).__name__ in ("async_generator_asend", "async_generator_athrow"):  # `async for`, aclose():
            coro = next((g for g in gc.get_referents(coro) if inspect.isasyncgen(g)), None)  # its generator
            continue
        frame = next((f for a in ("cr_frame", "gi_frame", "ag_frame") if (f := getattr(coro, a, None))), None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = next((c for a in ("cr_await", "gi_yieldfrom", "ag_await") if (c := getattr(coro, a, None))), None)
    return out


def dump_tasks() -> None:
    """Log every task of the running loop and what it waits on (``kill -USR1`` on a daemon
    that seems stuck: the line ``tasks_dumped``, one entry per task)."""
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    log.warning("tasks_dumped", count=len(tasks),
                tasks={f"{t.get_name()}#{i}": awaiting(t.get_coro()) for i, t in enumerate(tasks)})


def on_usr1_dump_tasks() -> None:
    """From now on SIGUSR1 logs the running loop's tasks (:func:`dump_tasks`)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)


async def _watchdog(notifier: SdNotifier, interval_s: float, *, healthy: Callable[[], bool],
                    status: Callable[[], str]) -> None:
    """Ping every ``interval_s`` seconds while ``healthy()``; carry ``status()`` when it changes."""
    last_status = ""
    warned = False
    while True:
        if healthy():
            fields: dict[str, str | int] = {"WATCHDOG": 1}
            text = status()
            if text != last_status:
                fields["STATUS"] = last_status = text
            notifier.send(**fields)
            warned = False
        elif not warned:
            log.error("watchdog_withheld", reason="the reconciler is not running; systemd will restart the daemon")
            warned = True
        await asyncio.sleep(interval_s)  # the ping period (systemd's WatchdogSec/2), not synchronisation


async def serve(daemon: AbstractAsyncContextManager["Supervisor"], *, notifier: SdNotifier,
                watchdog_interval_s: float | None) -> int:
    """Run a started daemon until SIGTERM/SIGINT or until its pool is released; returns 0.

    Args:
        daemon: enters to a started :class:`~daemon.controlnode.supervisor.Supervisor` (store,
            APIs, reconciler up) and closes it on exit.
        notifier: where READY/WATCHDOG/STOPPING go (:meth:`SdNotifier.from_env`).
        watchdog_interval_s: seconds between WATCHDOG=1 pings; None: no pings.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        async with daemon as sup:
            notifier.ready(status_line(sup))
            log.info("spotvisord_ready", pool=sup.pool, agent_url=sup.agent_url, notify=notifier.enabled,
                     watchdog_interval_s=watchdog_interval_s)
            tasks = [asyncio.create_task(stop.wait(), name="service:signal"),
                     asyncio.create_task(sup.wait_released(), name="service:released")]
            if watchdog_interval_s is not None:
                tasks.append(asyncio.create_task(
                    _watchdog(notifier, watchdog_interval_s, healthy=sup.is_healthy, status=lambda: status_line(sup)),
                    name="service:watchdog"))
            reason = "error"
            try:
                done, _ = await asyncio.wait(tasks[:2], return_when=asyncio.FIRST_COMPLETED)
                reason = "signal" if tasks[0] in done else "pool_released"
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                log.info("spotvisord_stopping", pool=sup.pool, reason=reason)
                notifier.stopping(f"stopping ({reason}); " + status_line(sup))
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        notifier.close()
    return 0
