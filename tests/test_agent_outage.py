"""What a node agent says while the daemon is out of reach (daemon.gpunode.outage): a few
lines an outage, whatever its length and however many loops keep calling; and, given
every control node of an HA pool, which one it calls."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from daemon.gpunode import daemon_link
from daemon.gpunode.daemon_link import DaemonLink, daemon_urls, failure_reason
from daemon.gpunode.outage import REMIND_EVERY_S, Outage

CALLS = ("heartbeat", "commands", "events", "register")


def test_a_five_minute_outage_with_three_loops_calling_is_four_lines_not_hundreds() -> None:
    o, said = Outage(), []
    t = 100.0
    while t < 400.0:  # heartbeats every second, the command poll and the outbox every 5 s
        for call in ("heartbeat",) + (("commands", "events") if t % 5 == 0 else ()):
            said.append(o.failed(t, call, "unreachable", "Cannot connect to host 10.0.0.2:7480"))
        t += 1.0
    said.append(o.answered(t))
    lines = [line for line in said if line is not None]
    assert [line.event for line in lines] == [
        "daemon_unreachable", *["daemon_still_unreachable"] * 4, "daemon_reachable"]
    assert lines[0].fields["call"] == "heartbeat" and lines[0].level == "warning"
    assert lines[-1].fields == {"down_s": 300.0, "failed_calls": 300 + 2 * 60}
    assert o.since is None and o.failures == 0  # nothing kept past the outage


def test_a_new_reason_is_said_at_once_and_an_untrusted_certificate_is_an_error() -> None:
    o = Outage()
    assert o.failed(0.0, "heartbeat", "unreachable", "refused").event == "daemon_unreachable"
    assert o.failed(1.0, "heartbeat", "unreachable", "refused") is None
    moved = o.failed(2.0, "heartbeat", "http_503", "503, message='not leading'")
    assert moved is not None and moved.fields["down_s"] == 2.0 and moved.fields["failed_calls"] == 3
    cert = o.failed(3.0, "register", "certificate_untrusted", "certificate verify failed")
    assert (cert.level, cert.event) == ("error", "daemon_certificate_untrusted")
    assert "--ca-file" in cert.fields["note"]
    assert o.answered(4.0).fields == {"down_s": 4.0, "failed_calls": 4}
    assert o.answered(5.0) is None  # no outage, nothing to end


@given(st.lists(st.tuples(st.floats(0, 30), st.booleans(), st.sampled_from(CALLS),
                          st.sampled_from(("unreachable", "timeout", "http_503"))), max_size=300))
def test_lines_are_bounded_by_outages_reasons_and_time_whatever_the_calls(
        calls: list[tuple[float, bool, str, str]]) -> None:
    o, t = Outage(), 0.0
    lines, outages, changes = 0, 0, 0
    last_reason = None
    for dt, ok, call, reason in calls:
        t += dt
        was_down = o.since is not None
        line = o.answered(t) if ok else o.failed(t, call, reason, "x" * 1000)
        if not ok and (not was_down or reason != last_reason):
            changes += 1
        if ok:
            outages += was_down
        last_reason = None if ok else reason
        if line is not None:
            lines += 1
            assert len(str(line.fields.get("error", ""))) <= 300
    # a line per outage's start or change of reason, one per end, one per REMIND_EVERY_S of time
    assert lines <= changes + outages + int(t // REMIND_EVERY_S) + 1


@pytest.mark.parametrize(("exc", "reason"), [
    (asyncio.TimeoutError(), "timeout"),
    (aiohttp.ClientResponseError(None, (), status=503), "http_503"),
    (aiohttp.ClientResponseError(None, (), status=404), None),  # it answered: there is a daemon
    (aiohttp.ServerDisconnectedError(), "disconnected"),
])
def test_each_failure_has_a_stable_reason(exc: BaseException, reason: str | None) -> None:
    assert failure_reason(exc) == reason


async def test_a_link_to_a_closed_port_says_once_that_the_daemon_is_unreachable(monkeypatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said, link = await _posts(monkeypatch, port, "/v1/agent/heartbeat", 5, aiohttp.ClientConnectorError)
    assert said == [("warning", "daemon_unreachable")]
    assert link.outage.failures == 5


async def _posts(monkeypatch, port: int, path: str, n: int,
                 error: type[BaseException]) -> tuple[list[tuple[str, str]], DaemonLink]:
    """``n`` posts to ``path`` on 127.0.0.1:``port``, each raising ``error``: the lines the
    link said (level, event), and the link."""
    said: list[tuple[str, str]] = []

    class Tap:
        def __getattr__(self, level: str):
            return lambda event, **kw: said.append((level, event))

    monkeypatch.setattr(daemon_link, "log", Tap())
    link = DaemonLink(daemon_url=f"http://127.0.0.1:{port}", token="t", node_id="n1")
    await link.open()
    try:
        for _ in range(n):
            with pytest.raises(error):
                await link.post(path, {"events": []})
    finally:
        await link.aclose()
    return said, link


async def test_a_refusal_is_not_an_outage_and_is_said_each_time(monkeypatch) -> None:
    """A 4xx is the daemon answering: no outage, and a refused report is said each time
    (a report the daemon will never take must not be retried in silence)."""
    runner, _, _ = await _serve(400)
    try:
        said, link = await _posts(monkeypatch, runner.addresses[0][1], "/v1/agent/events", 2,
                                  aiohttp.ClientResponseError)
    finally:
        await runner.cleanup()
    assert said == [("warning", "daemon_refused")] * 2 and link.outage.since is None


async def _serve(status: int) -> tuple[web.AppRunner, str, list[str]]:
    """A stand-in daemon answering every agent POST with ``status``; its runner, URL and the paths it was asked."""
    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"ok": True}, status=status)

    app = web.Application()
    app.router.add_post("/v1/agent/{call}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", asked


@pytest.mark.parametrize("first", ["nothing listens", "a deposed leader's 503"])
async def test_a_link_given_every_control_node_follows_the_one_that_serves(first: str) -> None:
    """ha.agent_urls: a standby binds nothing and a deposed leader answers 503; the link
    moves on to the next URL and stays with the daemon that answers."""
    leader, leader_url, asked = await _serve(200)
    if first == "nothing listens":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            other_url, other = f"http://127.0.0.1:{s.getsockname()[1]}", None
    else:
        other, other_url, _ = await _serve(503)
    link = DaemonLink(daemon_url=f"{other_url},{leader_url}", token="t", node_id="n1")
    await link.open()
    try:
        with pytest.raises((aiohttp.ClientConnectorError, aiohttp.ClientResponseError)):
            await link.post("/v1/agent/heartbeat", {})
        assert link.daemon_url == leader_url
        for _ in range(3):
            assert await link.post("/v1/agent/heartbeat", {}) == {"ok": True}
        assert asked == ["/v1/agent/heartbeat"] * 3 and link.daemon_url == leader_url
    finally:
        await link.aclose()
        await leader.cleanup()
        if other is not None:
            await other.cleanup()


async def test_a_refusal_keeps_the_link_where_it_is() -> None:
    """A 4xx is a daemon that serves and refused this call: no reason to move on."""
    refusing, url, _ = await _serve(400)
    spare, spare_url, spare_asked = await _serve(200)
    link = DaemonLink(daemon_url=f"{url},{spare_url}", token="t", node_id="n1")
    await link.open()
    try:
        for _ in range(2):
            with pytest.raises(aiohttp.ClientResponseError):
                await link.post("/v1/agent/events", {"events": []})
        assert link.daemon_url == url and spare_asked == []
    finally:
        await link.aclose()
        await refusing.cleanup()
        await spare.cleanup()


@pytest.mark.parametrize("value,needle", [
    ("https://10.0.0.1:7480,", "has an empty item"),
    ("https://10.0.0.1:7480,https://10.0.0.1:7480", "names a URL twice"),
    ("https://10.0.0.1:7480,http://10.0.0.2:7480", "plain http to a host that is not loopback"),
])
def test_a_bad_url_list_is_one_line_naming_it(value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        daemon_urls(value)
    assert daemon_urls("https://10.0.0.1:7480/, https://10.0.0.2:7480") == ["https://10.0.0.1:7480",
                                                                           "https://10.0.0.2:7480"]


async def test_the_outbox_goes_as_soon_as_the_daemon_is_back_and_counts_what_it_owes(monkeypatch) -> None:
    """A restarted daemon gets a node's queued reports as soon as any call finds it back,
    not after the rest of the outbox's back-off (up to 5 s: the heartbeat came first, the
    daemon released the drained node, its notice's commit report died with it); each
    heartbeat says how many reports are owed (``reports_pending``) until they are answered."""
    from tenacity import wait_fixed

    real = daemon_link._until_daemon_answers
    monkeypatch.setattr(daemon_link, "_until_daemon_answers",  # a back-off far longer than the test waits
                        lambda sleep=asyncio.sleep: real(sleep).copy(wait=wait_fixed(120)))
    status, events, refused = [503], [], asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        if request.path.endswith("/events"):
            if status[0] == 200:
                events.extend((await request.json())["events"])
            else:
                refused.set()
        return web.json_response({"ok": True}, status=status[0])

    app = web.Application()
    app.router.add_post("/v1/agent/{call}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    link = DaemonLink(daemon_url=f"http://127.0.0.1:{runner.addresses[0][1]}", token="t", node_id="n1")
    await link.open()
    outbox = asyncio.create_task(link.deliver_reports())
    try:
        link.report("trainer_status", line={"event": "checkpoint_committed", "step": 22})
        link.report("trainer_exited", exit_code=-15)
        assert link.reports_pending == 2
        await asyncio.wait_for(refused.wait(), 10)  # the daemon restarting: the outbox backs off
        assert link.reports_pending == 2
        status[0] = 200
        await link.post("/v1/agent/heartbeat", {})  # the daemon is back
        async with asyncio.timeout(10):
            while link.reports_pending:
                await asyncio.sleep(0.01)
        assert [e["kind"] for e in events] == ["trainer_status", "trainer_exited"]
    finally:
        outbox.cancel()
        await link.aclose()
        await runner.cleanup()
