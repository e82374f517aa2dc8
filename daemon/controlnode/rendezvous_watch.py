"""The edge of the rendezvous store's health (:mod:`daemon.control.rendezvous_health`):
a TCP connect to the job's store every few seconds while the pool wants nodes.

The store is the job's domain's (``rendezvous.host:port``, or ``domains.N.rendezvous``),
the one its nodes' torchruns are given (:func:`daemon.controlnode.jobspec.job_spec`).
The control node reaches it already: it wakes a loss's survivors through it
(:meth:`daemon.controlnode.actuator.Actuator.wake_survivors`). A connect that is
accepted is an answer (c10d's server takes a bare connect and its close, as
``spotvisord demo``'s wait for its own store does); a refusal, a timeout or a name
that does not resolve is a failure. The probe sends nothing.

Nothing is probed while the pool wants no node (paused, the job over): no alarm is
raised then, and one that held is dropped without an event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from daemon.control.rendezvous_health import PROBE_INTERVAL_S, PROBE_TIMEOUT_S, StoreHealth, alarm, observe
from daemon.controlnode.core import Core
from daemon.model import EventKind

__all__ = ["RendezvousWatch", "probe", "store_sentence"]

log = structlog.get_logger("spotvisor.daemon")


async def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Connect to ``host:port`` and close: None when accepted within ``timeout_s`` seconds,
    else why not (one line: the OS's error, or the timeout)."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    writer.close()
    try:
        async with asyncio.timeout(timeout_s):
            await writer.wait_closed()
    except (OSError, TimeoutError):
        pass  # it answered; how the close went is not the question
    return None


class RendezvousWatch:
    """Probes the job's rendezvous store (see the module docstring). Constructor does no I/O."""

    def __init__(self, core: Core, *, interval_s: float = PROBE_INTERVAL_S) -> None:
        self.core = core
        self.interval_s = interval_s
        self.health: StoreHealth | None = None

    async def probe_once(self) -> None:
        """One probe, when the pool wants nodes; records the event :func:`observe` says."""
        core = self.core
        if core.desired_nodes <= 0:
            self.health = None
            return
        d = core.config.domain(core.domain)
        domain, host, port = d.name, d.rendezvous.host, d.rendezvous.port
        error = await probe(host, port)
        endpoint = f"{host}:{port}"
        self.health, verdict = observe(self.health, domain=domain, endpoint=endpoint, error=error, now=core.clock())
        if verdict == "rendezvous_unreachable":
            h = self.health
            status = self.status()
            log.warning("rendezvous_unreachable", domain=domain, endpoint=endpoint, error=h.error)
            core.record(EventKind.RENDEZVOUS_UNREACHABLE, None, domain=domain, endpoint=endpoint,
                        failures=h.failures, down_s=round(core.clock() - (h.since or core.clock()), 1),
                        error=h.error, fix=status["fix"])
        elif verdict == "rendezvous_recovered":
            log.info("rendezvous_recovered", domain=domain, endpoint=endpoint)
            core.record(EventKind.RENDEZVOUS_RECOVERED, None, domain=domain, endpoint=endpoint)

    async def run(self) -> None:
        """Probe every ``interval_s`` seconds until cancelled."""
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict[str, Any]:
        """``spotctl status``'s ``rendezvous``: the alarm that holds, or ``{}``
        (:func:`daemon.control.rendezvous_health.alarm`)."""
        h = self.health
        try:
            local = h is not None and self.core.config.domain(h.domain).provider == "local"
        except KeyError:  # a domain this config no longer has: its fix is the cloud's
            local = False
        return alarm(h, local=local)


def store_sentence(shown: dict[str, Any]) -> str:
    """The alarm of :func:`alarm` as one clause for another message (a ``job_stalled``'s):
    the endpoint, its domain, since when (UTC), the error and the fix."""
    try:
        since = time.strftime("%H:%M:%S UTC", time.gmtime(float(shown["since"])))
    except (TypeError, ValueError, OverflowError, KeyError):
        since = "?"
    return (f"the rendezvous store at {shown.get('endpoint')} (domain {shown.get('domain')}) has not answered "
            f"since {since}: {shown.get('error')} ({shown.get('fix')})")
