"""Listening sockets bound to exactly one address, for the c10d stores spotvisor hosts.

A c10d ``TCPStore`` server listens on every interface of its machine, and it has no
authentication: whoever reaches its port can read and write the job's rendezvous. Given a
socket already bound (``master_listen_fd``, torch 2.13) it listens on that address only.
Both stores spotvisor hosts are bound so: the control node's rendezvous store
(:mod:`daemon.controlnode.rendezvous`) and each worker group's store, which rank 0's
torchrun agent hosts (:mod:`trainer.rendezvous`; :func:`trainer.runtime.group_store`
on rank 0's worker under another launcher), at rank 0's node's address:
:func:`address_toward` the rendezvous store, its address on the job's network.

No torch import here: the control node's ``[control]`` install has none.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["address_toward", "listen_socket"]


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to exactly ``host:port`` (``port`` 0: a free one), listening.

    ``host``: an address or a name (its first address). Raises ``ValueError`` for an
    empty ``host`` (never read as "every interface") and for a wildcard (0.0.0.0, ::,
    "0", or a name that resolves to one: every interface, never what a store without
    authentication should listen on); ``socket.gaierror`` for a name that does not
    resolve; ``OSError`` when the bind fails (the port is taken, the address is not this
    machine's)."""
    host = host.strip()
    if not host:
        raise ValueError("empty host")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 literal as a URL writes it
        host = host[1:-1]
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(addr[0].split("%")[0]).is_unspecified:
        raise ValueError("wildcard host")
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds through TIME_WAIT
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::1" means ::1, not IPv4 too
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def address_toward(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port``: the source address the
    kernel picks for it (a UDP ``connect`` sends nothing). For a node of a job, toward the
    rendezvous store, that is its address on the job's private network (one job, one
    network); ``127.0.0.1`` toward a store on loopback. Raises ``OSError`` (no route) and
    ``socket.gaierror`` (a name that does not resolve)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return str(probe.getsockname()[0]).split("%")[0]
