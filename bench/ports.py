"""A free TCP port on 127.0.0.1, for a bench's or a test's own servers and process groups.

A port the kernel picks (bind to 0) comes from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range it also
gives every outgoing connection: between the moment the port is read and the moment a
server binds it, any client socket on the machine may take it (``EADDRINUSE``; under
``make test``'s parallel workers, several times a run). :func:`free_port` therefore
picks below that range, in a slice of its own for each pytest-xdist worker
(``$PYTEST_XDIST_WORKER``: gw0, gw1, ...), never twice in one process, and only a port
it could bind just now.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOW = 10_000  # above the well-known and most registered services' ports
_SLICES = 8  # xdist workers each get one slice of [_LOW, the ephemeral range's start)
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    top = max(_ephemeral_start(), _LOW + 2 * _SLICES * 64)
    width = (top - _LOW) // _SLICES
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % _SLICES if worker[2:].isdigit() else 0
    return range(_LOW + index * width, _LOW + (index + 1) * width)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listened on just now and that this process has
    not handed out before, outside the kernel's ephemeral range (the module docstring);
    bind it soon.

    Raises:
        RuntimeError: no port in this worker's slice could be bound (200 tries).
    """
    ports = _slice()
    for _ in range(200):
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} on 127.0.0.1")
