"""A network partition between one daemon and its etcd cluster, made on purpose.

The ``partition_leader`` chaos action (:mod:`daemon.interfaces.demo_runner`) and the
tests cut the leading daemon off from etcd while its nodes and its rendezvous store stay
in reach. :class:`Partition` is one TCP forwarder per etcd member, listening on
loopback: the daemon is given :attr:`Partition.endpoints` for ``ha.endpoints`` (the
runner's ``spotvisord run --etcd-endpoints``), :meth:`Partition.cut` aborts every
forwarded connection and resets new ones at once (as a dropped route does to a client
that retries), :meth:`Partition.heal` forwards again. Bytes are forwarded as they are
(gRPC, TLS included), 64 KiB at a time; nothing is read or kept.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Partition"]


class Partition:
    """Forwarders to ``targets`` (each ``HOST:PORT``), on 127.0.0.1. Use :meth:`start`
    first; :meth:`close` (idempotent) stops them and drops what they carry."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = list(targets)
        self.endpoints: list[str] = []  # ours, in the order of targets
        self.is_cut = False
        self._servers: list[asyncio.Server] = []
        self._transports: set[asyncio.BaseTransport] = set()

    async def start(self) -> "Partition":
        """Listen for each target (a free port each). Raises OSError: no port to listen on."""
        for target in self.targets:
            host, _, port = target.rpartition(":")

            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             host: str = host, port: int = int(port)) -> None:
                if self.is_cut:
                    writer.transport.abort()
                    return
                try:
                    up_reader, up_writer = await asyncio.open_connection(host, port)
                except OSError:
                    writer.transport.abort()
                    return
                pair = (writer.transport, up_writer.transport)
                self._transports.update(pair)
                try:
                    await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
                finally:
                    self._transports.difference_update(pair)

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self._servers.append(server)
            self.endpoints.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        return self

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`heal`."""
        self.is_cut = True
        for t in list(self._transports):
            t.abort()

    def heal(self) -> None:
        """Forward new connections again."""
        self.is_cut = False

    async def close(self) -> None:
        self.cut()
        for s in self._servers:
            s.close()
            await s.wait_closed()
        self._servers = []
