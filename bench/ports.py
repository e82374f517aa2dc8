"""A free TCP port on 127.0.0.1, for a bench's own servers and process groups."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice; another process may take it
    before the caller binds it, so bind soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
