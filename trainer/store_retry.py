"""Reaching the rendezvous store again after it was lost: a bounded connect probe and a backoff.

The job's rendezvous store (a c10d ``TCPStore`` on the control node) can be restarted
under a running job, empty (issue 29). A c10d client never reconnects, and a new client
retries its connect for its whole timeout, so whoever needs the store back (rank 0's
join check, the loss watch, a joiner: :mod:`trainer.membership`) probes the port first
(:func:`store_reachable`, at most :data:`PROBE_S`) and tries again on a schedule
(:class:`StoreRetry`), never in a loop that spins or blocks a step boundary.

The store can also move: with an HA control plane (``ha:``) a new leader serves it from
its own control node. The agent keeps the address the leading daemon gives in a
node-local file (``$SPOTVISOR_RDZV_ENDPOINT_FILE``, :mod:`trainer.contract`), and every
new client asks :func:`current_endpoint` where the store is now.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from trainer.contract import RDZV_ENDPOINT_FILE_ENV

__all__ = ["PROBE_S", "MAX_RETRY_S", "WAIT_POLL_S", "StoreRetry", "store_reachable", "parse_endpoint",
           "current_endpoint", "wait_for_store"]

log = logging.getLogger("trainer.membership")

#: A connect probe's bound before a new store client is built (seconds).
PROBE_S = 1.0
#: The longest wait between two tries to reach the store while it is down (seconds).
MAX_RETRY_S = 4.0
#: How often :func:`wait_for_store` probes (seconds): on a fixed beat, not a backoff, so
#: the survivors of one loss reach their round within about one beat of each other once
#: the store is back, well inside ``--loss-settle-s`` (1 s by default).
WAIT_POLL_S = 0.5


def parse_endpoint(raw: str) -> tuple[str, int] | None:
    """``(host, port)`` from ``host:port`` (``[v6]:port`` too); None when malformed."""
    host, _, port = raw.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def current_endpoint(default: tuple[str, int] | None) -> tuple[str, int] | None:
    """Where the rendezvous store is now: the endpoint in the agent's file
    (``$SPOTVISOR_RDZV_ENDPOINT_FILE``: the leading daemon's word) when it holds one,
    else ``default`` (the address the process was started with). A small local read,
    made before each new store client."""
    path = os.environ.get(RDZV_ENDPOINT_FILE_ENV)
    if not path:
        return default
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read(512)
    except OSError:  # not written yet: the daemon that started the job is the one that leads
        return default
    return parse_endpoint(raw) or default


def store_reachable(endpoint: tuple[str, int], timeout_s: float = PROBE_S) -> bool:
    """Whether the store at ``endpoint`` accepts a TCP connection within ``timeout_s``
    seconds: checked before a new client is built (a ``TCPStore`` client retries its
    connect for its whole timeout, and every store call would wait that long)."""
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_store(default: tuple[str, int], wait_s: float, *, what: str,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   probe: Callable[[tuple[str, int]], bool] = store_reachable,
                   poll_s: float = WAIT_POLL_S) -> tuple[str, int] | None:
    """Block until the store accepts a connection, where it is now (:func:`current_endpoint`
    of ``default``, read again at each probe: an HA takeover moves it), for at most
    ``wait_s`` seconds; a probe every ``poll_s`` seconds (each at most :data:`PROBE_S`).
    Returns the endpoint that answered, or None once ``wait_s`` has passed. ``what``:
    who waits, for its two log lines (one when the store is out of reach, one when it is
    back). For a membership change that cannot be made without the store (the
    survivors' round after a loss): waiting costs nothing the store's absence does not,
    and every rank that waits the same way arrives together once it is back."""
    start = clock()
    announced = False
    while True:
        endpoint = current_endpoint(default) or default
        if probe(endpoint):
            if announced:
                log.warning("rendezvous store back after %.1f s: %s goes on", clock() - start, what)
            return endpoint
        if not announced:
            announced = True
            log.warning("rendezvous store %s:%d out of reach: %s waits for it (at most %.0f s)", endpoint[0],
                        endpoint[1], what, wait_s)
        left = wait_s - (clock() - start)
        if left <= 0:
            return None
        sleep(min(poll_s, left))


class StoreRetry:
    """When to try the store again while it is out of reach: after 0.5 s, then twice as
    late each time, at most :data:`MAX_RETRY_S`; one log line when it goes, one when it is
    back. ``clock``: monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.down_since: float | None = None
        self._at = 0.0
        self._wait = 0.5

    @property
    def failed_before(self) -> bool:
        """The store was out of reach at the last try."""
        return self.down_since is not None

    def due(self) -> bool:
        """Time to try again (always, while the store answers)."""
        return self._clock() >= self._at

    def wait_s(self) -> float:
        """Seconds until the next try is due."""
        return max(0.0, self._at - self._clock())

    def failed(self, exc: BaseException, *, what: str) -> None:
        now = self._clock()
        if self.down_since is None:
            self.down_since = now
            log.warning("rendezvous store out of reach (%s): %s retries with backoff",
                        (str(exc).splitlines() or ["no answer"])[0][:200], what)
        self._at = now + self._wait
        self._wait = min(self._wait * 2, MAX_RETRY_S)

    def ok(self) -> None:
        if self.down_since is not None:
            log.warning("rendezvous store back after %.1f s", self._clock() - self.down_since)
        self.down_since, self._at, self._wait = None, 0.0, 0.5
