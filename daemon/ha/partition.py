"""A network partition between one daemon and its etcd cluster, made on purpose.

The ``partition_leader`` chaos action (:mod:`daemon.interfaces.demo_runner`) and the
tests cut the leading daemon off from etcd while its nodes and its rendezvous store stay
in reach. :class:`Partition` is one TCP forwarder per etcd member, listening on
loopback: the daemon is given :attr:`Partition.endpoints` for ``ha.endpoints`` (the
runner's ``spotvisord run --etcd-endpoints``), :meth:`Partition.cut` aborts every
forwarded connection and resets new ones at once (as a dropped route does to a client
that retries), :meth:`Partition.heal` forwards again. Bytes are forwarded as they are
(gRPC, TLS included), 64 KiB at a time; nothing is read or kept.

The forwarders run on an event loop of their own, in a thread of their own: until the
cut, the partition must add no delay that a network would not. On the owner's loop
they waited behind whatever else it ran (in the chaos tests, the node agents and the
metadata endpoints of a simulated cloud: busy spells of 0.2-0.4 s on an idle machine,
longer under load), and a leader's keepalives, carried late, could cost it a lease no
partition had cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

__all__ = ["Partition"]


class Partition:
    """Forwarders to ``targets`` (each ``HOST:PORT``), on 127.0.0.1, served by a thread
    of their own (module docstring). Use :meth:`start` first; :meth:`close` (idempotent)
    stops them, drops what they carry and ends the thread. :meth:`cut` and :meth:`heal`
    may be called from any thread; a new connection sees their effect at once, the
    connections already carried are aborted within the forwarders' next step."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = list(targets)
        self.endpoints: list[str] = []  # ours, in the order of targets
        self.is_cut = False
        self._servers: list[asyncio.Server] = []
        self._transports: set[asyncio.BaseTransport] = set()  # touched on the forwarders' loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> "Partition":
        """Start the forwarders' thread and listen for each target (a free port each).
        Raises OSError: no port to listen on (the thread is stopped again)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="etcd-partition", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._listen(), loop))
        except BaseException:
            await self.close()
            raise
        return self

    async def _listen(self) -> None:
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

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    def _abort_all(self) -> None:
        for t in list(self._transports):
            t.abort()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`heal`."""
        self.is_cut = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_all)

    def heal(self) -> None:
        """Forward new connections again."""
        self.is_cut = False

    async def close(self) -> None:
        """Cut, stop listening and end the forwarders' thread (idempotent)."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        self.is_cut = True
        if loop is None or thread is None:
            return

        async def shut() -> None:
            self._abort_all()
            for s in self._servers:
                s.close()
                await s.wait_closed()
            self._servers = []
            carrying = asyncio.all_tasks() - {asyncio.current_task()}  # the aborted pipes, ending
            if carrying:
                _, left = await asyncio.wait(carrying, timeout=5)
                for task in left:
                    task.cancel()
                await asyncio.gather(*left, return_exceptions=True)

        with contextlib.suppress(Exception):  # noqa: BLE001  a listener that failed to start
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(shut(), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()
