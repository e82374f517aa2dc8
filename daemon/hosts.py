"""Host names and addresses as the daemon judges them: loopback, private, a wildcard.

No I/O (a name is never resolved: it is not judged). Used by the config's checks
(:mod:`daemon.config`), the rendezvous store's ``--host`` (:mod:`daemon.controlnode.rendezvous`)
and the node agent's daemon URL (:mod:`daemon.gpunode.agent`).
"""

from __future__ import annotations

import errno
import ipaddress
import socket

__all__ = ["address_of", "bind_fix", "exposed_address", "is_loopback", "is_wildcard"]

_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
_WILDCARD = "a wildcard address (every interface)"


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` spells (brackets, and the forms the resolver also takes as IPv4:
    "0", "127.1", "0x7f000001"; an IPv4-mapped IPv6 address as its IPv4), or None for a name."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        try:
            addr = ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None  # a name
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` spells (as :func:`exposed_address` reads it), or None for a name."""
    return _address(host) if host.strip() else None


def exposed_address(host: str) -> str | None:
    """Why ``host`` would expose a listener beyond loopback and private networks:
    ``"a wildcard address (every interface)"`` (also for an empty host), ``"not a private
    address"``, or None (loopback, private, or a host name, which is not judged)."""
    text = host.strip()
    if not text or text == "[]":
        return _WILDCARD
    addr = _address(text)
    if addr is None:
        return None
    if addr.is_unspecified:
        return _WILDCARD
    if addr.is_loopback or any(addr in net for net in _PRIVATE_NETS):
        return None
    return "not a private address"


def is_wildcard(host: str) -> bool:
    """``host`` is empty or an unspecified address (0.0.0.0, "0", ::, [::]): every interface."""
    return exposed_address(host) == _WILDCARD


def is_loopback(host: str) -> bool:
    """``host`` is ``localhost`` or a loopback address (127.0.0.0/8, ::1, ::ffff:127.x)."""
    text = host.strip().lower().rstrip(".")
    if text == "localhost":
        return True
    addr = _address(text)
    return addr is not None and addr.is_loopback


#: what to do when a listener cannot bind, by errno
_BIND_FIXES = {
    errno.EADDRNOTAVAIL: "no interface of this machine has that address (give one of its own: ip -brief address)",
    errno.EADDRINUSE: "another process holds the port (ss -ltnp), or give another port",
    errno.EACCES: "a port below 1024 needs privileges this process does not have (give one above 1024)",
}


def bind_fix(code: int | None) -> str:
    """What to do about a listener's bind that failed with errno ``code``, for a person."""
    return _BIND_FIXES.get(code or 0, "see the error")
