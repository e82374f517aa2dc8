"""Issue 25, item 4: what a connection to the agent port can make the daemon spend is bounded.

A real daemon (Supervisor + ApiServer, the ``spot_daemon`` fixture, or one built here with
short timeouts) in the test's loop; the attacker's connections are raw sockets from
127.0.0.2 (another "host": Linux routes all of 127/8 to loopback), the node's agent
speaks from 127.0.0.1. Waits are on events (a socket's EOF, the store's events),
with generous bounds that cost nothing when the daemon behaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import structlog

from conftest import UNTIL_TIMEOUT_S, DaemonHarness, RecordingProvider
from daemon.control.bounds import MAX_AGENT_BODY_BYTES, ConnectionCaps
from daemon.interfaces import api as api_mod
from daemon.interfaces import listener as listener_mod
from test_api import running_node

ATTACKER = "127.0.0.2"


async def metrics(h: DaemonHarness) -> str:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=h.socket_path)) as s:
        async with s.get("http://daemon/metrics") as r:
            assert r.status == 200
            return await r.text()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series of the exposition ``text`` (labels in any order), or None."""
    for m in re.finditer(rf"^{name}(?:{{(.*?)}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if got == labels:
            return float(m.group(2))
    return None


async def until_closed(reader: asyncio.StreamReader, timeout_s: float = UNTIL_TIMEOUT_S) -> bool:
    """True once the daemon has closed the connection (EOF or reset), False after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(4096):
                pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def agent_addr(h: DaemonHarness) -> tuple[str, int]:
    u = urlsplit(h.api.agent_url)  # type: ignore[attr-defined]
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


async def heartbeat(h: DaemonHarness, node: Any) -> int:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        async with s.post(f"{h.api.agent_url}/v1/agent/heartbeat", json={"node_id": node.id, "step": 1},
                          timeout=aiohttp.ClientTimeout(total=UNTIL_TIMEOUT_S)) as r:
            return r.status


# -- item 4: connections -------------------------------------------------------------------------
async def test_idle_connections_past_a_peers_cap_are_closed_and_agents_are_still_served(spot_daemon) -> None:
    """An address that opens 100 connections and sends nothing keeps at most its cap
    (4 x pool.max_nodes + 16 = 24 here); the rest are closed at once, counted, and the
    node's agent, from another address, is answered meanwhile. On main every one of them
    was held open, for an hour (aiohttp's keep-alive), and 1,100 of them exhausted the
    unit's 1,024 descriptors."""
    h = spot_daemon
    node = await running_node(h)
    host, port = agent_addr(h)
    per_peer = h.api.listener.caps.per_peer  # type: ignore[attr-defined]
    assert per_peer == 4 * h.config.pool.max_nodes + 16  # type: ignore[attr-defined]
    conns = [await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0)) for _ in range(100)]
    try:
        readers = [r for r, _ in conns]
        closed = await asyncio.gather(*(until_closed(r) for r in readers[per_peer:]))
        assert all(closed), f"{closed.count(False)} connections past the per-address cap are still open"
        assert await heartbeat(h, node) == 200
        text = await metrics(h)
        assert sample(text, "spotvisor_agent_connections_refused_total", reason="per_peer") == 100 - per_peer
        assert sample(text, "spotvisor_agent_connections_limit", scope="per_peer") == per_peer
    finally:
        for _, w in conns:
            w.close()


@contextlib.asynccontextmanager
async def own_daemon(tmp_path: Path, *, caps: ConnectionCaps, first_request_s: float) -> AsyncIterator[DaemonHarness]:
    """Like ``spot_daemon``, with the given caps and first-request timeout (seconds)."""
    from daemon.config import Config
    from daemon.controlnode.store import Store
    from daemon.controlnode.supervisor import Supervisor
    from daemon.interfaces.api import ApiServer

    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = Config.model_validate({
        "pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 1_000_000},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                   "reconcile_interval_s": 0.05},
    })
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = RecordingProvider()
    sup = Supervisor(config, provider=provider, store=store)
    api = ApiServer(sup, agent_host="127.0.0.1", agent_port=0, socket_path=f"{sockdir}/d.sock", caps=caps,
                    first_request_s=first_request_s)
    try:
        await api.start()
        assert api.agent_url is not None
        await sup.start(agent_url=api.agent_url)
        yield DaemonHarness(sup, api, provider, config, f"{sockdir}/d.sock", tmp_path)
    finally:
        await sup.aclose()
        await api.aclose()
        store.close()


async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node: Any) -> bytes:
    body = json.dumps({"node_id": node.id, "step": 1}).encode()
    writer.write(b"POST /v1/agent/heartbeat HTTP/1.1\r\nHost: daemon\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {node.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


async def test_the_connection_past_the_total_cap_is_closed_at_once(tmp_path: Path) -> None:
    """Four connections held (the cap), the fifth closed at once and counted; the agent's,
    among the four, is still served. (The first-request timeout is 60 s here: nothing
    else closes a connection during the test.)"""
    async with own_daemon(tmp_path, caps=ConnectionCaps(total=4, per_peer=4), first_request_s=60.0) as h:
        node = await running_node(h)
        host, port = agent_addr(h)
        agent = await asyncio.open_connection(host, port)
        assert await _http(*agent, node) == b"HTTP/1.1 200 OK"
        held = [await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0)) for _ in range(3)]
        over = await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0))
        try:
            assert await until_closed(over[0]), "the connection over the total cap was not closed"
            assert await _http(*agent, node) == b"HTTP/1.1 200 OK"
            text = await metrics(h)
            assert sample(text, "spotvisor_agent_connections_refused_total", reason="total") == 1
            assert sample(text, "spotvisor_agent_connections") == 4
        finally:
            for _, w in (agent, *held, over):
                w.close()


async def test_a_connection_without_a_request_head_in_time_is_closed_and_a_served_one_is_kept(tmp_path: Path) -> None:
    """Idle and slowloris connections end at the first-request timeout (0.5 s here); an
    agent's kept-alive connection that has been served outlives it and serves its next
    request. (A loop stalled past 0.5 s could end the agent's connection before its first
    request is read, as it would any; the agent then connects again, and so does this test.)"""
    async with own_daemon(tmp_path, caps=ConnectionCaps(total=16, per_peer=16), first_request_s=0.5) as h:
        node = await running_node(h)
        host, port = agent_addr(h)
        for _ in range(10):
            agent = await asyncio.open_connection(host, port)
            try:
                assert await _http(*agent, node) == b"HTTP/1.1 200 OK"
                break
            except (asyncio.IncompleteReadError, ConnectionError):
                agent[1].close()
        idle = await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0))
        slow = await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0))
        slow[1].write(b"POST /v1/agent/heartbeat HTTP/1.1\r\nHost: daemon\r\nContent-Le")  # and no more
        try:
            assert await until_closed(idle[0]) and await until_closed(slow[0])
            assert await _http(*agent, node) == b"HTTP/1.1 200 OK"  # the same connection, past the 0.5 s
            assert sample(await metrics(h), "spotvisor_agent_connections_timed_out_total") >= 2
        finally:
            for _, w in (agent, idle, slow):
                w.close()


async def test_a_request_stalled_in_its_body_does_not_hold_the_daemons_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that sends a request head and stalls in its body holds a handler (the body
    has ``BODY_READ_S``, made an hour here); stopping the API cancels it after its own
    ``SHUTDOWN_S`` (1 s), and the connection is closed. Before, the agent port kept
    aiohttp's default, 60 s: a demo stopped with Ctrl-C, or a unit stopped by systemd,
    waited on whatever stray client was mid-request."""
    monkeypatch.setattr(api_mod, "BODY_READ_S", 3600.0)
    in_flight = asyncio.Event()
    started = listener_mod.AgentListener.request_started

    def request_started(transport: Any) -> None:
        started(transport)
        in_flight.set()

    monkeypatch.setattr(listener_mod.AgentListener, "request_started", staticmethod(request_started))
    async with own_daemon(tmp_path, caps=ConnectionCaps(total=16, per_peer=16), first_request_s=60.0) as h:
        host, port = agent_addr(h)
        reader, writer = await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0))
        try:
            writer.write(b"POST /v1/agent/heartbeat HTTP/1.1\r\nHost: daemon\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # and no more of the body
            await writer.drain()
            async with asyncio.timeout(UNTIL_TIMEOUT_S):
                await in_flight.wait()  # its handler is reading the body
            closing = asyncio.create_task(h.api.aclose())  # type: ignore[attr-defined]
            done, _ = await asyncio.wait([closing], timeout=20.0)  # 1 s to spare, 60 s before
            assert done, "the API's close waited on a request stalled in its body"
            closing.result()
            assert await until_closed(reader), "the stalled connection was left open"
        finally:
            writer.close()


async def test_accept_failures_for_want_of_descriptors_are_logged_once_and_counted(
        spot_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """50 accept() calls failing with EMFILE: one log line (not 50 tracebacks), a count of
    50 in /metrics, and the port accepts again once descriptors are back."""
    h = spot_daemon
    node = await running_node(h)
    monkeypatch.setattr(listener_mod, "_ACCEPT_RETRY_S", 0.001)
    loop = asyncio.get_running_loop()
    real = loop.sock_accept
    failures = 0

    async def sock_accept(sock: Any) -> Any:
        nonlocal failures
        if failures < 50:
            failures += 1
            raise OSError(24, "Too many open files")  # EMFILE
        return await real(sock)

    monkeypatch.setattr(loop, "sock_accept", sock_accept)
    host, port = agent_addr(h)
    with structlog.testing.capture_logs() as logs:
        conn = await asyncio.open_connection(host, port)  # wakes the accept loop's sleeping call
        conn[1].close()
        assert await heartbeat(h, node) == 200  # accepted once the failures stop
    lines = [e for e in logs if e["event"] == "agent_accept_failed"]
    assert len(lines) == 1 and lines[0]["error"] == "EMFILE"
    assert sample(await metrics(h), "spotvisor_accept_errors_total", errno="EMFILE", listener="agent") == 50


async def test_a_body_over_the_cap_is_413_and_nesting_past_the_parser_is_400(spot_daemon) -> None:
    h = spot_daemon
    node = await running_node(h)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        big = json.dumps({"node_id": node.id, "events": [], "pad": "x" * MAX_AGENT_BODY_BYTES})
        async with s.post(f"{h.api.agent_url}/v1/agent/events", data=big,  # type: ignore[attr-defined]
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413
        async with s.post(f"{h.api.agent_url}/v1/agent/events", data="[" * 100_000,  # type: ignore[attr-defined]
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
