"""daemon/ha/partition.py: the forwarders a partition_leader chaos action cuts and heals."""

from __future__ import annotations

import asyncio

import pytest

from daemon.ha.partition import Partition


async def _echo_server() -> tuple[asyncio.Server, str]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _round_trip(endpoint: str) -> bytes:
    host, _, port = endpoint.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"ping")
        await writer.drain()
        return await asyncio.wait_for(reader.read(4), 5)
    finally:
        writer.close()


async def test_a_cut_drops_what_it_carries_and_refuses_new_connections_until_healed() -> None:
    server, target = await _echo_server()
    partition = await Partition([target]).start()
    try:
        (ours,) = partition.endpoints
        assert await _round_trip(ours) == b"ping"
        host, _, port = ours.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"x")
        assert await asyncio.wait_for(reader.read(1), 5) == b"x"  # carried, held open
        partition.cut()
        assert await asyncio.wait_for(reader.read(1), 5) == b""  # dropped by the cut
        writer.close()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            if await _round_trip(ours) == b"":  # refused: reset at once, nothing forwarded
                raise ConnectionResetError
        partition.heal()
        assert await _round_trip(ours) == b"ping"
    finally:
        await partition.close()
        server.close()
        await server.wait_closed()
