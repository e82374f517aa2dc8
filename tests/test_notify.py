"""The feed (daemon/feed/notify.py) against a real HTTP receiver on 127.0.0.1.

The receiver is an aiohttp app that can answer 500 (or 429 with a Retry-After),
stop listening (connection refused), hold a request without answering (a request
in flight when the daemon stops), or hold every request behind a gate (a sink that
is slow while a backlog builds). It closes every connection after its answer, so
"down" really refuses the next attempt. :class:`ThreadedHook` receives on a thread of
its own, for the test that blocks the event loop to show the feed's thread delivers
meanwhile. Waits are on events (the receiver's, the notifier's progress), never on
sleeps (that one block aside).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import hmac
import json
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest
from aiohttp import web
from slack_sdk.models.blocks import Block, ContextBlock, HeaderBlock, SectionBlock

from conftest import UNTIL_TIMEOUT_S, RecordingProvider
from daemon.interfaces.cli import main as spotvisord_main
from daemon.config import SLACK_MAX_BATCH, WEBHOOK_MAX_BATCH, Config, ConfigError, SinkSpec, load_config
from daemon.model import Event, EventKind, Node, NodeState
from daemon.feed import feed_messages, notify, sinks
from daemon.feed.feed_messages import (EMOJI, SLACK_FIELD_MAX_CHARS, SLACK_HEADER_MAX_CHARS, SLACK_LOG_LINES,
                                       SLACK_MAX_BLOCKS, SLACK_MAX_FIELDS, SLACK_SECTION_MAX_CHARS,
                                       SLACK_TEXT_MAX_CHARS, render_text, slack_digest, slack_message,
                                       webhook_batch_body)
from daemon.feed.notify import CURSOR_KEY, Notifier
from daemon.feed.redaction import Redactor
from daemon.feed.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature
from daemon.feed.sinks import retry_after_s, resolve_sinks
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor

SECRET = "whsec-test-4f1c"
ENV = {"SV_TEST_KEY": SECRET}


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # loop time it arrived
    status: int | None = None  # None: never answered

    @property
    def json(self) -> dict[str, Any]:
        return json.loads(self.body)

    @property
    def seqs(self) -> list[int]:
        """The ``seq`` of each event of a webhook batch, in body order."""
        return [e["seq"] for e in self.json["events"]]


class Receiver:
    """An HTTP endpoint on 127.0.0.1 standing in for a webhook receiver or hooks.slack.com.

    ``fail_first``: answer the first N requests with ``fail_status`` (and
    ``fail_headers``, e.g. a Retry-After). ``hang_on``: hold the Nth request (1-based)
    unanswered until ``release`` is set. ``gate``: when given, hold every request
    until it is set (a slow sink). ``down()`` stops listening (the next attempt gets
    connection refused), ``up()`` listens again on the same port.
    """

    def __init__(self, *, fail_first: int = 0, fail_status: int = 500, fail_headers: dict[str, str] | None = None,
                 hang_on: int | None = None, gate: asyncio.Event | None = None, ok_body: str = "ok") -> None:
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.fail_headers = fail_headers or {}
        self.hang_on = hang_on
        self.gate = gate
        self.ok_body = ok_body
        self.requests: list[Received] = []
        self.release = asyncio.Event()
        self._changed = asyncio.Event()
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self._site: web.TCPSite | None = None
        self.port = 0

    async def start(self) -> "Receiver":
        await self._runner.setup()
        await self.up()
        return self

    async def up(self) -> None:
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await self._site.start()
        self.port = self._runner.addresses[0][1]

    async def down(self) -> None:
        assert self._site is not None
        await self._site.stop()
        self._site = None

    async def aclose(self) -> None:
        self.release.set()
        if self.gate is not None:
            self.gate.set()
        await self._runner.cleanup()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rec = Received(request.path, dict(request.headers), await request.read(), asyncio.get_running_loop().time())
        self.requests.append(rec)
        n = len(self.requests)
        self._changed.set()
        self._changed = asyncio.Event()
        if n == self.hang_on:
            await self.release.wait()
        if self.gate is not None:
            await self.gate.wait()
        rec.status = self.fail_status if n <= self.fail_first else 200
        resp = web.Response(status=rec.status, text=self.ok_body if rec.status == 200 else "internal_error",
                            headers=self.fail_headers if rec.status != 200 else None)
        resp.force_close()  # one request per connection: after down(), the next attempt is refused
        return resp

    async def wait_for(self, pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"receiver: timed out after {timeout_s} s waiting for {what or pred}") from None

    def seqs(self, path: str | None = None) -> list[int]:
        """``seq`` of every event of every webhook request that reached the receiver,
        answered or not, in arrival order (a retried batch: its events again)."""
        return [s for r in self.requests if path is None or r.path == path for s in r.seqs]

    def accepted(self, path: str | None = None) -> list[Received]:
        return [r for r in self.requests if r.status == 200 and (path is None or r.path == path)]

    def events(self, path: str | None = None) -> list[dict[str, Any]]:
        """Every event of every webhook request answered 2xx, in arrival order."""
        return [e for r in self.accepted(path) for e in r.json["events"]]


def dedup(seqs: list[int]) -> list[int]:
    """What a receiver keeps after de-duplicating by seq."""
    seen: set[int] = set()
    return [s for s in seqs if not (s in seen or seen.add(s))]


def batches_in_order(requests: list[Received]) -> bool:
    """Each batch oldest first, and each one either the previous batch again (a retry,
    or the batch in flight at a daemon stop, then perhaps longer) or wholly after it."""
    batches = [r.seqs for r in requests]
    if any(b != sorted(set(b)) or not b for b in batches):
        return False
    return all(b[0] == a[0] or b[0] > a[-1] for a, b in zip(batches, batches[1:]))


def webhook(name: str, url: str, **kw: Any) -> SinkSpec:
    return SinkSpec(name=name, type="webhook", url=url, secret_env="SV_TEST_KEY", timeout_s=2.0,
                    max_backoff_s=0.05, **kw)


def emit(store: Store, notifier: Notifier, kind: str, node: str | None = None, **data: Any) -> int:
    """What Supervisor.record does for the feed: append, then wake the workers."""
    ev = store.append_event(kind, node, data)
    notifier.wake(ev)
    return ev.seq


def emit_all(store: Store, notifier: Notifier, events: list[tuple[str, str | None, dict[str, Any]]]) -> list[int]:
    """A burst of ``(kind, node, data)`` appended in one transaction, then one wake: the
    feed's thread sees all of it or none, so the batches a test checks do not depend on
    when that thread happens to read (event by event, it may send the first one alone)."""
    store.db.execute("BEGIN IMMEDIATE")
    try:
        seqs = [store.append_event(kind, node, data).seq for kind, node, data in events]
    except BaseException:
        store.db.execute("ROLLBACK")
        raise
    store.db.execute("COMMIT")
    notifier.wake()
    return seqs


@pytest.fixture
async def receiver():
    rx = await Receiver().start()
    try:
        yield rx
    finally:
        await rx.aclose()


# -- delivery: down, then up --------------------------------------------------------------------
async def test_sink_down_then_up_every_event_arrives_in_order_once(store: Store) -> None:
    rx = await Receiver(fail_first=3).start()  # 500 for the first three requests
    n = Notifier(store, [webhook("hook", rx.url())], pool="test", environ=ENV)
    await n.start()
    try:
        seqs = emit_all(store, n, [("node_launched", f"test-{i}", {"instance_id": f"i-{i}"}) for i in range(1, 6)])
        assert await n.drain(10.0), n.stats("hook")
        # the receiver goes away entirely: connection refused while more events happen
        await rx.down()
        failed_before = n.stats("hook").failed_attempts
        seqs += emit_all(store, n, [("checkpoint_committed", "test-1", {"step": s, "seconds": 1.5})
                                    for s in (20, 40, 60)])
        assert await n.wait_until(lambda: n.stats("hook").failed_attempts >= failed_before + 3, 10.0)
        assert n.stats("hook").cursor == seqs[4]  # nothing past the first undelivered event
        await rx.up()
        assert await n.drain(10.0), n.stats("hook")
    finally:
        await n.aclose()
        await rx.aclose()

    assert [r.status for r in rx.requests[:4]] == [500, 500, 500, 200]
    assert [r.seqs for r in rx.requests[:4]] == [seqs[:5]] * 4  # one batch, the same one retried until a 2xx
    assert batches_in_order(rx.requests)  # in order, retries included
    assert [r.seqs for r in rx.accepted()] == [seqs[:5], seqs[5:]]  # each event answered 2xx exactly once
    assert dedup(rx.seqs()) == seqs
    assert n.stats("hook").failed_attempts >= 3 + 3
    assert (n.stats("hook").delivered, n.stats("hook").batches) == (8, 2)
    assert store.get(CURSOR_KEY.format("hook")) == seqs[-1]
    body = rx.accepted()[1].json
    assert set(body) == {"pool", "events"} and body["pool"] == "test"
    ev = body["events"][0]
    assert set(ev) == {"seq", "time", "kind", "node", "data", "text"}
    assert (ev["seq"], ev["kind"], ev["node"], ev["data"]) == (
        seqs[5], "checkpoint_committed", "test-1", {"step": 20, "seconds": 1.5})
    assert ev["text"] == "✅ Checkpoint committed · test-1: step 20, flush 1.5 s"
    stored = {e.seq: e for e in store.events()}
    assert [(e["time"], e["kind"]) for e in rx.events()] == [(stored[s].time, stored[s].kind) for s in seqs]


async def test_daemon_restart_loses_nothing_and_resends_at_most_the_batch_in_flight(tmp_path: Path) -> None:
    rx = await Receiver(hang_on=3).start()  # the third request is never answered: in flight at the stop
    config = Config.model_validate({
        "pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_trainer"},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "reconcile_interval_s": 0.05},
        "notify": [{"name": "hook", "type": "webhook", "url": rx.url(), "secret_env": "SV_TEST_KEY",
                    "max_backoff_s": 0.05, "timeout_s": 30, "max_batch": 2}],  # 5 events: three requests
    })
    db = tmp_path / "state" / "spotvisord.db"

    async def start_daemon(store: Store) -> tuple[Supervisor, Notifier]:
        """What running_daemon does for the feed, with a test provider and no API."""
        sup = Supervisor(config, provider=RecordingProvider(), store=store)
        notifier = Notifier(store, config.notify, pool=config.pool.name, environ=ENV)
        sup.subscribe(notifier.wake)
        await notifier.start()
        await sup.start(agent_url="http://127.0.0.1:9")
        return sup, notifier

    store = Store(db).open()
    sup, n = await start_daemon(store)
    try:
        for i in range(5):
            sup.record(EventKind.CHECKPOINT_REQUESTED, None, reason="manual", request_id=f"before-{i}")
        await rx.wait_for(lambda: len(rx.requests) >= 3, what="the request that hangs")
        in_flight = rx.requests[2].seqs
    finally:  # the daemon stops (SIGTERM) while that request is in flight
        await sup.aclose()
        await n.aclose(drain_timeout_s=0)
        store.close()
    assert n.stats("hook").cursor == in_flight[0] - 1 == rx.requests[1].seqs[-1]
    before_restart = len(rx.requests)

    store = Store(db).open()
    for i in range(3):  # recorded while the feed's worker is not running yet
        store.append_event("checkpoint_requested", None, {"reason": "manual", "request_id": f"between-{i}"})
    sup, n = await start_daemon(store)
    try:
        for i in range(3):
            sup.record(EventKind.CHECKPOINT_REQUESTED, None, reason="manual", request_id=f"after-{i}")
        await sup.aclose()  # no more events: now everything stored must arrive
        assert await n.drain(10.0), n.stats("hook")
        stored = [e.seq for e in store.events()]
    finally:
        await sup.aclose()
        await n.aclose()
        await rx.aclose()
        store.close()

    got = rx.seqs()
    assert dedup(got) == stored  # nothing lost, in order
    assert batches_in_order(rx.requests)
    assert rx.requests[before_restart].seqs[0] == in_flight[0]  # resumed at the first unacknowledged event
    twice = {s for s in got if got.count(s) > 1}
    assert in_flight[0] in twice and twice <= set(in_flight)  # only the batch in flight, again
    assert all(got.count(s) <= 2 for s in twice)
    firsts = {e["seq"]: e["data"].get("request_id") for r in reversed(rx.requests) for e in r.json["events"]}
    ids = [firsts[s] for s in dedup(got)]
    assert [i for i in ids if i] == [*(f"before-{i}" for i in range(5)), *(f"between-{i}" for i in range(3)),
                                     *(f"after-{i}" for i in range(3))]


async def test_new_sink_starts_at_newest_event_and_close_delivers_the_queue(store: Store, receiver: Receiver) -> None:
    for i in range(3):
        store.append_event("node_ready", f"old-{i}", {})
    n = Notifier(store, [webhook("hook", receiver.url())], pool="test", environ=ENV)
    await n.start()
    assert n.stats("hook").cursor == store.last_seq()  # a new sink does not replay history
    last = emit(store, n, "pool_released", None, reason="job_completed", cost_usd=12.5)
    await n.aclose(drain_timeout_s=10.0)  # the final event goes out before the daemon exits
    assert receiver.seqs() == [last]
    assert "cost $12.50" in receiver.events()[0]["text"]


# -- the feed's own thread ------------------------------------------------------------------------
class ThreadedHook:
    """A webhook receiver on its own thread (``http.server``): it answers while the
    test's event loop is blocked. ``arrivals``: (``time.monotonic()``, seqs) per request."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, list[int]]] = []
        self._cond = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with hook._cond:
                    hook.arrivals.append((time.monotonic(), [e["seq"] for e in json.loads(body)["events"]]))
                    hook._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="test-hook", daemon=True)

    def __enter__(self) -> "ThreadedHook":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def arrived(self, seq: int) -> float | None:
        """When the first request carrying ``seq`` arrived (monotonic), or None."""
        with self._cond:
            return next((at for at, seqs in self.arrivals if seq in seqs), None)

    def wait_arrived(self, seq: int, timeout_s: float) -> float | None:
        """Block this thread (an event loop's too) until a request carrying ``seq`` arrived,
        at most ``timeout_s`` seconds; when it arrived (monotonic), or None."""
        with self._cond:
            self._cond.wait_for(lambda: self.arrived(seq) is not None, timeout=timeout_s)
            return self.arrived(seq)


def feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == notify.FEED_THREAD]


async def test_the_feed_delivers_while_the_daemons_loop_is_blocked(store: Store) -> None:
    """The point of the feed's thread: a burst of handlers on the daemon's loop (here the
    loop blocked until the delivery arrives, at most 30 s) does not hold up a delivery."""
    with ThreadedHook() as hook:
        n = Notifier(store, [webhook("hook", hook.url())], pool="test", environ=ENV)
        await n.start()
        try:
            t0 = time.monotonic()  # from here to blocked_until this coroutine never yields: the loop runs nothing
            seq = emit(store, n, "checkpoint_committed", "test-1", step=10)
            # the loop blocked, as by a burst of handlers, until the delivery arrives (or 30 s)
            arrived = hook.wait_arrived(seq, 30.0)
            blocked_until = time.monotonic()
            assert arrived is not None and t0 <= arrived < blocked_until, (t0, arrived, blocked_until)
            assert await n.drain(10.0), n.stats("hook")
        finally:
            await n.aclose()
    assert n.stats("hook").cursor == seq and store.get(CURSOR_KEY.format("hook")) == seq


async def test_aclose_leaves_no_feed_thread_even_after_a_failed_start(
        store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    assert feed_threads() == []
    n = Notifier(store, [webhook("a", receiver.url("/a")), webhook("b", receiver.url("/b"))], pool="test",
                 environ=ENV)
    await n.start()
    assert len(feed_threads()) == 1  # one thread for every sink
    await n.aclose()
    assert feed_threads() == []
    await n.aclose()  # idempotent

    empty = Notifier(store, [], pool="test")  # no sinks: no thread
    await empty.start()
    assert feed_threads() == []
    await empty.aclose()

    def refuse(self: Store) -> Store:
        raise OSError("disk gone")

    monkeypatch.setattr(Store, "open", refuse)  # the feed's own connection cannot be opened
    broken = Notifier(store, [webhook("a", receiver.url("/a"))], pool="test", environ=ENV)
    with pytest.raises(OSError, match="disk gone"):
        await broken.start()
    await broken.aclose()
    assert feed_threads() == []

    in_memory = Notifier(Store(":memory:"), [webhook("a", receiver.url("/a"))], pool="test", environ=ENV)
    with pytest.raises(ValueError, match="memory"):
        await in_memory.start()
    await in_memory.aclose()
    assert feed_threads() == []


async def test_a_new_notifier_on_the_same_file_resumes_at_the_cursor(tmp_path: Path, receiver: Receiver) -> None:
    db = tmp_path / "spotvisord.db"
    sinks = [webhook("hook", receiver.url())]
    store = Store(db).open()
    n = Notifier(store, sinks, pool="test", environ=ENV)
    await n.start()
    try:
        first = [emit(store, n, "node_ready", f"test-{i}") for i in range(3)]
        assert await n.drain(10.0), n.stats("hook")
    finally:
        await n.aclose()
        store.close()

    store = Store(db).open()  # the daemon restarted
    try:
        between = [store.append_event("node_lost", f"test-{i}", {}).seq for i in range(2)]  # no feed running
        n = Notifier(store, sinks, pool="test", environ=ENV)
        await n.start()
        try:
            assert n.stats("hook").cursor == first[-1]  # from the store file, not the newest event
            after = [emit(store, n, "node_ready", "test-9")]
            assert await n.drain(10.0), n.stats("hook")
        finally:
            await n.aclose()
    finally:
        store.close()
    assert receiver.seqs() == first + between + after  # each once, in order
    assert feed_threads() == []


class ReplicatedStore(Store):
    """A store whose events become durable only when the test commits them, as the HA
    store's do when a fenced etcd txn lands (:class:`daemon.ha.store.EtcdStore`); it
    records the threads its cursor writes came from."""

    replicated = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.through = 0
        self.listeners: list[Callable[[], None]] = []
        self.cursor_writes: list[tuple[int, str]] = []

    def durable_seq(self) -> int:
        return self.through

    def on_durable(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def commit_through(self, seq: int) -> None:
        self.through = seq
        for listener in self.listeners:
            listener()

    def set(self, key: str, value: Any) -> None:
        if key.startswith(CURSOR_KEY.format("")):
            self.cursor_writes.append((value, threading.current_thread().name))
        super().set(key, value)


async def test_ha_the_feed_sends_only_durable_events_and_its_cursor_goes_through_the_pools_store(
        tmp_path: Path, receiver: Receiver) -> None:
    """HA: an event in the leader's mirror but not yet in etcd could vanish with the leader
    (the next one never had it), so the feed must not announce it; and the feed's cursor
    is written through the pool's store (replicated), so the next leader's feed resumes
    there instead of at its newest event."""
    store = ReplicatedStore(tmp_path / "spotvisord.db").open()
    n = Notifier(store, [webhook("hook", receiver.url())], pool="test", environ=ENV)
    await n.start()
    try:
        seqs = emit_all(store, n, [("node_ready", f"test-{i}", {}) for i in range(3)])
        store.commit_through(seqs[0])
        assert await n.drain(10.0), n.stats("hook")
        assert receiver.seqs() == seqs[:1]  # the other two are in the mirror only
        store.commit_through(seqs[-1])
        assert await n.drain(10.0), n.stats("hook")
    finally:
        await n.aclose()
        store.close()
    assert receiver.seqs() == seqs
    main = threading.current_thread().name
    assert store.cursor_writes[1:] == [(seqs[0], main), (seqs[-1], main)]  # after start()'s, on the daemon's loop


# -- batches ------------------------------------------------------------------------------------------
async def test_a_backlog_goes_out_in_few_requests_in_order(store: Store) -> None:
    gate = asyncio.Event()  # the sink holds every request until the gate opens
    rx = await Receiver(gate=gate).start()
    n = Notifier(store, [webhook("hook", rx.url())], pool="test", environ=ENV)
    await n.start()
    try:
        seqs = emit_all(store, n, [("node_ready", f"test-{i}", {"boot_s": 3.0}) for i in range(250)])
        await rx.wait_for(lambda: len(rx.requests) >= 1, what="the first batch, held at the gate")
        assert n.stats("hook").cursor == seqs[0] - 1  # nothing acknowledged while the sink holds it
        gate.set()
        assert await n.drain(10.0), n.stats("hook")
        assert len(rx.requests) <= 3
        assert [len(r.seqs) for r in rx.requests] == [100, 100, 50]  # max_batch: 100 by default
        assert rx.seqs() == seqs  # none missing, none twice, oldest first
        assert (n.stats("hook").cursor, store.get(CURSOR_KEY.format("hook"))) == (seqs[-1], seqs[-1])
        assert (n.stats("hook").delivered, n.stats("hook").batches) == (250, 3)

        # a burst while a request is in flight joins the next request
        gate.clear()
        first = emit(store, n, "node_ready", "late-0")
        await rx.wait_for(lambda: len(rx.requests) >= 4, what="the next request, held at the gate")
        more = [emit(store, n, "node_ready", f"late-{i}") for i in range(1, 121)]
        gate.set()
        assert await n.drain(10.0), n.stats("hook")
    finally:
        await n.aclose()
        await rx.aclose()
    assert [r.seqs for r in rx.requests[3:]] == [[first], more[:100], more[100:]]
    for r in rx.requests:
        assert verify_signature(SECRET, r.headers[TIMESTAMP_HEADER], r.body, r.headers[SIGNATURE_HEADER])


async def test_a_failed_batch_is_sent_again_whole_and_never_skipped(store: Store) -> None:
    rx = await Receiver(fail_first=2).start()
    n = Notifier(store, [webhook("hook", rx.url())], pool="test", environ=ENV)
    await n.start()
    try:
        seqs = emit_all(store, n, [("checkpoint_committed", "test-1", {"step": 10 * i}) for i in range(10)])
        assert await n.wait_until(lambda: n.stats("hook").failed_attempts >= 1, 10.0)
        assert n.stats("hook").cursor == seqs[0] - 1
        seqs += emit_all(store, n, [("node_ready", f"test-{i}", {}) for i in range(5)])  # recorded during the retries
        assert await n.drain(10.0), n.stats("hook")
    finally:
        await n.aclose()
        await rx.aclose()
    assert [r.status for r in rx.requests] == [500, 500, 200, 200]
    assert [r.seqs for r in rx.requests[:3]] == [seqs[:10]] * 3  # the same batch: the new events wait
    assert rx.requests[0].body == rx.requests[2].body  # the same bytes, signed anew each attempt
    assert rx.requests[3].seqs == seqs[10:]
    assert [e["seq"] for e in rx.events()] == seqs


async def test_max_batch_and_kind_filters_shape_the_batches(store: Store, receiver: Receiver) -> None:
    every = webhook("every", receiver.url("/every"), max_batch=7)
    commits = webhook("commits", receiver.url("/commits"), max_batch=3, kinds=["checkpoint_committed"])
    n = Notifier(store, [every, commits], pool="test", environ=ENV)
    await n.start()
    try:
        seqs = emit_all(store, n, [ev for i in range(10) for ev in (
            ("checkpoint_committed", "test-1", {"step": i}),
            ("node_ready", f"test-{i}", {}),  # the last event: one "commits" does not want
        )])
        assert await n.drain(10.0)
    finally:
        await n.aclose()
    assert [r.seqs for r in receiver.accepted("/every")] == [seqs[:7], seqs[7:14], seqs[14:]]
    assert [r.seqs for r in receiver.accepted("/commits")] == [seqs[0:6:2], seqs[6:12:2], seqs[12:18:2], [seqs[18]]]
    assert n.stats("every").cursor == n.stats("commits").cursor == seqs[-1]  # past the unwanted tail too


def test_webhook_batch_body_is_the_documented_json() -> None:
    evs = [Event(seq=7, time=1_700_000_000.5, kind="node_ready", node="n1", data={"boot_s": 3.0}),
           Event(seq=9, time=1_700_000_001.0, kind="pool_released", node=None, data={"cost_usd": 1.5})]
    body = webhook_batch_body([(evs[0], "ready ✓"), (evs[1], "released")], pool="p")
    assert json.loads(body) == {"pool": "p", "events": [
        {"seq": 7, "time": 1_700_000_000.5, "kind": "node_ready", "node": "n1", "data": {"boot_s": 3.0},
         "text": "ready ✓"},
        {"seq": 9, "time": 1_700_000_001.0, "kind": "pool_released", "node": None, "data": {"cost_usd": 1.5},
         "text": "released"}]}
    assert "ready ✓".encode() in body  # UTF-8, not \\u escapes


# -- signatures -----------------------------------------------------------------------------------
async def test_signature_verifies_and_tampering_or_staleness_fails(store: Store, receiver: Receiver) -> None:
    n = Notifier(store, [webhook("hook", receiver.url())], pool="test", environ=ENV)
    await n.start()
    try:
        emit(store, n, "interruption_notice", "test-2", provider="aws", deadline=time.time() + 120)
        assert await n.drain(10.0)
    finally:
        await n.aclose()
    (req,) = receiver.requests
    ts, sig, body = req.headers[TIMESTAMP_HEADER], req.headers[SIGNATURE_HEADER], req.body
    assert abs(int(ts) - time.time()) < 60
    # the documented scheme, computed independently
    assert sig == "sha256=" + hmac.new(SECRET.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    assert verify_signature(SECRET, ts, body, sig)
    assert verify_signature(SECRET.encode(), int(ts), body.decode(), sig, now=int(ts) + 299)
    tampered = body.replace(b'"test-2"', b'"test-3"')
    assert tampered != body
    assert not verify_signature(SECRET, ts, tampered, sig)
    assert not verify_signature(SECRET, str(int(ts) + 1), body, sig)  # the timestamp is signed too
    assert not verify_signature(SECRET, ts, body, sig, now=int(ts) + 301)  # stale: a replay
    assert not verify_signature(SECRET, ts, body, sig, now=int(ts) - 301)  # from the future
    assert not verify_signature("another-key", ts, body, sig)
    assert not verify_signature(SECRET, "yesterday", body, sig)
    assert not verify_signature(SECRET, ts, body, sig.removeprefix("sha256="))


# -- Slack ----------------------------------------------------------------------------------------
_NODE = Node(id="demo-3", ordinal=3, provider="aliyun", region="cn-hangzhou", zone="cn-hangzhou-h",
             instance_type="ecs.gn7i-c8g1.2xlarge", gpus=1, price_usd_h=0.52, token="t", state=NodeState.RUNNING)


def _rich_event(kind: str, seq: int = 42) -> Event:
    """An event with every number the feed knows, some of them far too long."""
    data = {"step": 18200, "last_step": 18150, "world_size": 7, "old": 8, "new": 7, "seconds": 4.1,
            "bytes": 3 * 1024**3, "boot_s": 121.0, "detection_latency_s": 0.8, "price_usd_h": 0.52,
            "cost_usd": 1234.5, "savings_usd": 2900.0, "reason": "spot_reclaimed <&>",
            "error": "capacity", "message": "x" * 5000, "deadline": 1_700_000_120.0, "provider": "aliyun",
            "log_tail": ["```<&> " + "z" * 3000] * 30 + [7, None]}
    return Event(seq=seq, time=1_700_000_000.0, kind=kind, node="demo-3", data=data)


@pytest.mark.parametrize("kind", [k.value for k in EventKind])
def test_slack_message_is_valid_block_kit_for_every_kind(kind: str) -> None:
    for ev, node, template in [
        (_rich_event(kind), _NODE, None),
        (Event(seq=1, time=1_700_000_000.0, kind=kind, node=None, data={}), None, None),
        (_rich_event(kind), _NODE, "{emoji} {node} on {provider} {instance_type}: step {step:,} " + "y" * 4000),
    ]:
        msg = slack_message(ev, pool="demo", node=node, template=template)
        assert 1 <= len(msg.blocks) <= SLACK_MAX_BLOCKS
        for block in msg.blocks:
            block.validate_json()  # raises SlackObjectFormationError on a broken limit
        header, *_, context = msg.blocks
        assert isinstance(header, HeaderBlock) and isinstance(context, ContextBlock)
        assert header.text.text.startswith(EMOJI.get(kind, "🔔")) and len(header.text.text) <= SLACK_HEADER_MAX_CHARS
        for section in (b for b in msg.blocks if isinstance(b, SectionBlock)):
            assert section.text is not None or section.fields
            assert section.text is None or len(section.text.text) <= SLACK_SECTION_MAX_CHARS
            assert len(section.fields or []) <= SLACK_MAX_FIELDS
            assert all(len(f.text) <= SLACK_FIELD_MAX_CHARS for f in section.fields or [])
        assert 0 < len(msg.text) <= SLACK_TEXT_MAX_CHARS
        body = msg.to_dict()
        assert [Block.parse(b).to_dict() for b in body["blocks"]] == body["blocks"]  # parses back, same JSON
        assert f"seq {ev.seq}" in context.elements[0].text


def test_every_event_kind_has_an_emoji() -> None:
    assert set(EMOJI) == {k.value for k in EventKind}


def test_slack_fields_carry_the_key_numbers() -> None:
    msg = slack_message(_rich_event("checkpoint_committed"), pool="demo", node=_NODE)
    fields = {f.text.split("\n", 1)[0]: f.text.split("\n", 1)[1] for f in msg.blocks[1].fields}
    assert fields["*Node*"] == "demo-3"
    assert fields["*Instance*"] == "aliyun ecs.gn7i-c8g1.2xlarge cn-hangzhou-h"
    assert fields["*Step*"] == "18,200"
    assert fields["*World size*"] == "7"
    assert fields["*Flush*"] == "4.1 s"
    assert fields["*Size*"] == "3.0 GiB"
    assert len(fields) == SLACK_MAX_FIELDS
    assert "<!date^1700000000^" in msg.blocks[-1].elements[0].text
    lost = slack_message(Event(seq=5, time=1_700_000_000.0, kind="node_lost", node="n<1>",
                               data={"reason": "gone <&>"}), pool="demo")
    assert "n&lt;1&gt;" in lost.text and "gone &lt;&amp;&gt;" in lost.text  # event text is escaped for Slack
    assert {"type": "mrkdwn", "text": "*Reason*\ngone &lt;&amp;&gt;"} in lost.to_dict()["blocks"][1]["fields"]


def test_a_failed_job_says_why_and_its_last_log_lines() -> None:
    """``job_failed``: the reason in the text (the one line a phone shows) and the failing
    node's last log lines in the Slack message, escaped; the webhook's data has them all."""
    why = "3 tries without progress (job.max_restarts_on_errors 3); the last workers_failed on n2: OSError: <bad>"
    tail = [f"line {i}" for i in range(14)] + ["a ``` fence", "FileNotFoundError: 'train.py' & <co>"]
    ev = Event(seq=9, time=1_700_000_000.0, kind="job_failed", node="n2",
               data={"why": why, "failed_tries": 3, "exit_code": 1, "step": None, "last_commit_step": 40,
                     "log_tail": tail})
    text = render_text(ev, pool="demo")
    assert text.startswith("💥 Job failed · n2: why 3 tries without progress") and "last commit 40" in text
    msg = slack_message(ev, pool="demo")
    assert "why 3 tries without progress" in msg.text and "&lt;bad&gt;" in msg.text
    (logs,) = [b for b in msg.blocks if isinstance(b, SectionBlock) and b.text and "Last log lines" in b.text.text]
    shown = logs.text.text.split("```")[1].splitlines()
    assert shown == [*tail[-SLACK_LOG_LINES:-2], "a ` ` ` fence", "FileNotFoundError: 'train.py' &amp; &lt;co&gt;"]
    for block in msg.blocks:
        block.validate_json()


@pytest.fixture
def no_slack_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slack's one message a second, off: tests that are not about it stay fast."""
    monkeypatch.setattr(sinks, "SLACK_MIN_INTERVAL_S", 0.0)


async def test_slack_sink_posts_block_kit_to_a_local_hooks_endpoint(store: Store, no_slack_pacing: None) -> None:
    rx = await Receiver(fail_first=1).start()  # Slack answers 500 once
    slack = SinkSpec(name="ops-slack", type="slack", url=rx.url("/services/T000/B000/XXXX"), max_backoff_s=0.05)
    n = Notifier(store, [slack], pool="demo", environ={})
    await n.start()
    try:
        store.put_node(_NODE)
        deadline = datetime.fromtimestamp(time.time() + 300, timezone.utc).isoformat().replace("+00:00", "Z")
        notice = emit(store, n, "interruption_notice", "demo-3", provider="aliyun",
                      deadline=deadline, detection_latency_s=0.8)
        assert await n.drain(10.0), n.stats("ops-slack")  # one event at a time: each a rich message
        commit = emit(store, n, "checkpoint_committed", "demo-3", step=18200, seconds=4.1, bytes=2**30)
        assert await n.drain(10.0), n.stats("ops-slack")
    finally:
        await n.aclose()
        await rx.aclose()
    assert [r.status for r in rx.requests] == [500, 200, 200]
    first, second = (r.json for r in rx.accepted())
    assert rx.requests[0].json == first  # the retry sends the same message
    for body in (first, second):
        assert body["text"]
        for raw in body["blocks"]:
            Block.parse(raw).validate_json()
    assert first["blocks"][0]["text"]["text"] == "⚠️ Interruption notice · demo-3"
    assert first["text"].startswith("⚠️ Interruption notice · demo-3: instance aliyun ecs.gn7i")
    assert f"seq {notice}" in first["blocks"][-1]["elements"][0]["text"]
    deadline_field = next(f["text"] for f in first["blocks"][1]["fields"] if f["text"].startswith("*Deadline*"))
    assert deadline_field.startswith("*Deadline*\nin 4 min 5") or deadline_field.startswith("*Deadline*\nin 5 min")
    assert {"type": "mrkdwn", "text": "*Step*\n18,200"} in second["blocks"][1]["fields"]
    assert f"seq {commit}" in second["blocks"][-1]["elements"][0]["text"]


def _digest_seqs(body: dict[str, Any]) -> list[int]:
    """The ``seq`` of each event in a Slack message (a digest or one rich event), from its context lines."""
    out = []
    for b in body["blocks"]:
        if b["type"] == "context":
            m = re.search(r"(?:^|· )seq (\d+) ·", b["elements"][0]["text"])
            if m:
                out.append(int(m.group(1)))
    return out


def test_slack_digest_fits_in_50_blocks_and_is_valid_block_kit() -> None:
    assert 2 + 2 * SLACK_MAX_BATCH <= SLACK_MAX_BLOCKS
    kinds = [k.value for k in EventKind]
    items = [(_rich_event(kinds[i % len(kinds)], seq=100 + i), _NODE, "{emoji} {node} {reason} " + "z" * 4000)
             for i in range(SLACK_MAX_BATCH)]
    msg = slack_digest(items, pool="demo")
    assert len(msg.blocks) <= SLACK_MAX_BLOCKS
    for block in msg.blocks:
        block.validate_json()
    body = msg.to_dict()
    assert [Block.parse(b).to_dict() for b in body["blocks"]] == body["blocks"]
    assert body["blocks"][0]["text"]["text"] == f"🔔 {SLACK_MAX_BATCH} events"
    assert _digest_seqs(body) == [100 + i for i in range(SLACK_MAX_BATCH)]  # oldest first
    sections = [b for b in msg.blocks if isinstance(b, SectionBlock)]
    assert len(sections) == SLACK_MAX_BATCH
    assert all(len(sec.text.text) <= feed_messages.SLACK_DIGEST_LINE_MAX_CHARS for sec in sections)
    assert "spot_reclaimed &lt;&amp;&gt;" in sections[0].text.text  # event text is escaped for Slack
    assert f"seq 100–{100 + SLACK_MAX_BATCH - 1}" in body["blocks"][-1]["elements"][0]["text"]
    assert 0 < len(msg.text) <= SLACK_TEXT_MAX_CHARS and msg.text.startswith(f"{SLACK_MAX_BATCH} events in demo")

    same = slack_digest([(_rich_event("node_lost", seq=s), None, None) for s in (1, 2, 3)], pool="demo")
    assert same.blocks[0].text.text == "💀 Node lost × 3"
    one = slack_digest(items[:1], pool="demo")
    assert one.to_dict() == slack_message(items[0][0], pool="demo", node=_NODE, template=items[0][2]).to_dict()
    with pytest.raises(ValueError):
        slack_digest(items + items[:1], pool="demo")
    with pytest.raises(ValueError):
        slack_digest([], pool="demo")


async def test_slack_sink_sends_a_backlog_as_digests(store: Store, no_slack_pacing: None) -> None:
    gate = asyncio.Event()
    rx = await Receiver(gate=gate).start()
    slack = SinkSpec(name="ops-slack", type="slack", url=rx.url("/services/T/B/X"), max_backoff_s=0.05)
    assert slack.max_batch == SLACK_MAX_BATCH
    n = Notifier(store, [slack], pool="demo", environ={})
    await n.start()
    try:
        seqs = emit_all(store, n, [("node_lost", f"n{i}", {"reason": "gone"}) for i in range(30)])
        await rx.wait_for(lambda: len(rx.requests) >= 1, what="the first message, held")
        gate.set()
        assert await n.drain(10.0), n.stats("ops-slack")
    finally:
        await n.aclose()
        await rx.aclose()
    bodies = [r.json for r in rx.accepted()]
    assert [_digest_seqs(b) for b in bodies] == [seqs[:24], seqs[24:]]
    for body in bodies:
        assert len(body["blocks"]) <= SLACK_MAX_BLOCKS
        for raw in body["blocks"]:
            Block.parse(raw).validate_json()
    assert bodies[1]["blocks"][0]["text"]["text"] == "💀 Node lost × 6"


@pytest.mark.parametrize("kind", ["slack", "webhook"])
async def test_a_429_waits_its_retry_after(store: Store, no_slack_pacing: None, kind: str) -> None:
    rx = await Receiver(fail_first=1, fail_status=429, fail_headers={"Retry-After": "1"}).start()
    spec = (SinkSpec(name="s", type="slack", url=rx.url("/services/T/B/X"), max_backoff_s=0.05) if kind == "slack"
            else webhook("s", rx.url()))  # backoff alone: a retry within 0.05 s
    n = Notifier(store, [spec], pool="demo", environ=ENV)
    await n.start()
    try:
        emit(store, n, "node_lost", "n1", reason="gone")
        assert await n.drain(10.0), n.stats("s")
    finally:
        await n.aclose()
        await rx.aclose()
    first, second = rx.requests
    assert (first.status, second.status) == (429, 200)
    assert second.at - first.at >= 0.95  # Slack's Retry-After is whole seconds
    assert first.body == second.body  # the same batch (a webhook's signed anew)
    assert n.stats("s").failed_attempts == 1


async def test_slack_sends_at_most_one_message_per_interval(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sinks, "SLACK_MIN_INTERVAL_S", 0.3)
    rx = await Receiver().start()
    n = Notifier(store, [SinkSpec(name="s", type="slack", url=rx.url("/services/T/B/X"))], pool="demo", environ={})
    await n.start()
    try:
        first = emit(store, n, "node_lost", "n1", reason="gone")
        assert await n.wait_until(lambda: n.stats("s").delivered == 1, 10.0)
        later = emit_all(store, n, [("node_ready", f"n{i}", {}) for i in (2, 3)])  # within the interval: they wait
        assert await n.drain(10.0), n.stats("s")
    finally:
        await n.aclose()
        await rx.aclose()
    one, two = rx.requests
    assert _digest_seqs(one.json) == [first] and _digest_seqs(two.json) == later
    assert two.at - one.at >= 0.3 - 0.01


def test_retry_after_is_seconds_or_an_http_date() -> None:
    now = 1_700_000_000.0
    assert retry_after_s(429, {"Retry-After": "3"}) == 3.0
    assert retry_after_s(429, {"Retry-After": email.utils.formatdate(now + 30, usegmt=True)}, now=now) == 30.0
    assert retry_after_s(429, {"Retry-After": "10000000"}) == sinks.RETRY_AFTER_MAX_S
    assert retry_after_s(429, {"Retry-After": "-5"}) == 0.0
    assert retry_after_s(429, {"Retry-After": "soon"}) is None
    assert retry_after_s(429, {"Retry-After": "nan"}) is None
    assert retry_after_s(429, {}) is None
    assert retry_after_s(503, {"Retry-After": "3"}) is None


# -- filters and templates ---------------------------------------------------------------------------
async def test_per_sink_filters_and_templates(store: Store, receiver: Receiver) -> None:
    a = webhook("a", receiver.url("/a"), kinds=["checkpoint_committed", "interruption_notice"], template={
        "checkpoint_committed": "step {step:,} committed in {seconds:.1f} s on {node} ({pool}) {missing}",
        "*": "{emoji} {kind} #{seq} {provider}",
    })
    b = webhook("b", receiver.url("/b"), exclude_kinds=["node_ready"],
                template={"checkpoint_committed": "{seconds:.1f} s"})  # a spec that does not fit: default text
    n = Notifier(store, [a, b], pool="demo", environ=ENV)
    await n.start()
    try:
        s1 = emit(store, n, "node_ready", "n1", boot_s=3.0)
        s2 = emit(store, n, "interruption_notice", "n1", provider="aws")
        s3 = emit(store, n, "checkpoint_committed", "n1", step=18200, seconds=4.14)
        s4 = emit(store, n, "checkpoint_committed", "n1", step=18300, seconds=None)
        s5 = emit(store, n, "job_resumed", None, step=18200, world_size=2)
        assert await n.drain(10.0)
    finally:
        await n.aclose()
    assert receiver.seqs("/a") == [s2, s3, s4]
    assert receiver.seqs("/b") == [s2, s3, s4, s5]
    assert n.stats("a").cursor == n.stats("b").cursor == s5  # filtered-out events are passed, not held
    texts_a = [e["text"] for e in receiver.events("/a")]
    assert texts_a[0] == f"⚠️ interruption_notice #{s2} aws"
    assert texts_a[1] == "step 18,200 committed in 4.1 s on n1 (demo) ?"  # a missing field reads "?"
    assert texts_a[2] == "✅ Checkpoint committed · n1: step 18,300"  # None does not fit .1f: default line
    texts_b = [e["text"] for e in receiver.events("/b")]
    assert texts_b[1] == "4.1 s"
    assert texts_b[3] == "▶️ Job resumed: step 18,200, world size 2"
    assert s1 not in receiver.seqs()


def test_render_text_template_fields() -> None:
    ev = Event(seq=7, time=1_700_000_000.0, kind="node_launched", node="n2", data={"price_usd_h": 0.5})
    text = render_text(ev, pool="p", node=_NODE, template="{iso} {pool}/{node} {instance_type} ${price_usd_h:.2f}/h")
    assert text == "2023-11-14T22:13:20+00:00 p/n2 ecs.gn7i-c8g1.2xlarge $0.50/h"


# -- configuration ----------------------------------------------------------------------------------
def _problems(tmp_path: Path, notify_yaml: str) -> list[str]:
    p = tmp_path / "c.yaml"
    p.write_text("notify:\n" + notify_yaml)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    return e.value.problems


@pytest.mark.parametrize("notify_yaml, expected", [
    ("  - {name: ops, type: slack, url: 'https://hooks.slack.com/x', kinds: [node_prempted]}",
     "notify.0.kinds: unknown event kind 'node_prempted' (valid: '*', node_launch_requested,"),
    ("  - {name: ops, type: slack, url: 'https://h/x', exclude_kinds: [checkpoint_comitted]}",
     "notify.0.exclude_kinds: unknown event kind 'checkpoint_comitted'"),
    ("  - {name: ops, type: slack, url: 'https://h/x', template: {nodes_lost: '{node}'}}",
     "notify.0.template: unknown event kind 'nodes_lost'"),
    ("  - {name: ops, type: slack, url: 'https://h/x', template: {'*': 'step {step'}}",
     "notify.0.template: *: not a str.format template"),
    ("  - {name: ops, type: slack, url: 'https://h/x', template: {'*': 'step {}'}}",
     "notify.0.template: *: positional field {}"),
    ("  - {name: ops, type: webhook, url: 'https://h/x'}",
     "notify.0: secret_env: a webhook sink signs its requests"),
    ("  - {name: ops, type: slack, url: 'https://h/x', url_env: HOOK}",
     "notify.0: give exactly one of url or url_env"),
    ("  - {name: ops, type: slack}",
     "notify.0: give exactly one of url or url_env"),
    ("  - {name: ops, type: slack, url: 'https://h/x', secret_env: K}",
     "notify.0: secret_env: Slack incoming webhooks are not signed"),
    ("  - {name: Ops Feed, type: slack, url: 'https://h/x'}",
     "notify.0.name: must be lowercase letters, digits, '_' and '-', starting with a letter or digit"),
    ("  - {name: ops, type: teams, url: 'https://h/x'}",
     "notify.0.type: Input should be 'slack' or 'webhook'"),
    ("  - {name: ops, type: slack, url: 'https://h/x'}\n  - {name: ops, type: slack, url: 'https://h/y'}",
     "notify.1.name: sink 'ops' is named twice"),
    ("  - {name: ops, type: webhook, url: 'https://h/x', secret_env: K, max_batch: 0}",
     "notify.0.max_batch: events per request must be at least 1, got 0"),
    ("  - {name: ops, type: slack, url: 'https://h/x', max_batch: 50}",
     "notify.0: max_batch: a Slack message holds at most 24 events"),
])
def test_bad_notify_config_is_one_clear_line(tmp_path: Path, notify_yaml: str, expected: str) -> None:
    problems = _problems(tmp_path, notify_yaml)
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems[0]
    if "unknown event kind" in expected:
        assert "checkpoint_flush_timed_out" in problems[0]  # the valid ones are listed


def test_max_batch_defaults_by_sink_type() -> None:
    assert SinkSpec(name="a", type="webhook", url="https://h/x", secret_env="K").max_batch == WEBHOOK_MAX_BATCH == 100
    assert SinkSpec(name="a", type="slack", url="https://h/x").max_batch == SLACK_MAX_BATCH == 24
    assert SinkSpec(name="a", type="slack", url="https://h/x", max_batch=5).max_batch == 5


def test_the_example_in_configs_local_yaml_validates() -> None:
    import yaml

    text = (Path(__file__).resolve().parents[1] / "configs" / "local.yaml").read_text()
    block = text[text.index("# notify:"):]
    example = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    config = Config.model_validate(example)
    env = {"SPOTVISOR_SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T/B/X", "SPOTVISOR_WEBHOOK_KEY": "k"}
    slack, audit = resolve_sinks(config.notify, env, redactor=Redactor())
    assert (slack.spec.type, audit.spec.type) == ("slack", "webhook")
    assert "hooks.slack.com" not in repr(slack) and "b'k'" not in repr(audit)  # secrets stay out of logs


def test_unset_environment_is_one_line_per_variable_and_run_refuses(tmp_path: Path, capsys) -> None:
    specs = [SinkSpec(name="ops", type="slack", url_env="SV_TEST_UNSET_HOOK"),
             SinkSpec(name="audit", type="webhook", url="https://h/x", secret_env="SV_TEST_UNSET_KEY")]
    with pytest.raises(ConfigError) as e:
        resolve_sinks(specs, {}, redactor=Redactor())
    assert [p.split(":", 1)[0] for p in e.value.problems] == ["notify.0.url_env", "notify.1.secret_env"]
    assert "$SV_TEST_UNSET_HOOK is not set" in e.value.problems[0]
    (t,) = resolve_sinks(specs[:1], {"SV_TEST_UNSET_HOOK": "https://hooks.slack.com/services/T/B/X"},
                         redactor=Redactor())
    assert t.url == "https://hooks.slack.com/services/T/B/X" and t.secret is None

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"daemon: {{state_dir: {tmp_path / 'state'}}}\n"
                   "notify:\n  - {name: ops, type: slack, url_env: SV_TEST_UNSET_HOOK}\n")
    assert spotvisord_main(["run", "--config", str(cfg)]) == 2  # before anything starts
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{cfg}: notify.0.url_env: $SV_TEST_UNSET_HOOK is not set (sink 'ops': export it in the "
                   "daemon's environment, e.g. systemd EnvironmentFile=)"]
    assert not (tmp_path / "state").exists()


# -- the supervisor: a flush that never commits is its own event ---------------------------------------
async def _running_node_on_manual_clock(h) -> tuple[Node, Any]:
    from conftest import ManualClock

    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    h.sup.agents.on_register(node)
    await h.until(lambda: node.state is NodeState.RUNNING, what="node running")
    h.sup.agents.on_heartbeat(node, {"trainer": {"state": "running"}})
    clock = ManualClock(time.time())
    h.sup.clock = clock
    # its trainer's attempt a1 starts (its rank 0 here): the commits below are of a led attempt
    h.sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
        "event": "started", "attempt": "a1", "rank": 0, "world_size": 1, "step": 0}}])
    return node, clock


def _notice(nid: str, clock: Any, lead_s: float = 10.0) -> dict[str, Any]:
    return {"kind": "interruption_notice", "notice": {"id": nid, "provider": "aws", "action": "terminate"},
            "seen_at": clock(), "deadline": clock() + lead_s}


async def test_notice_answered_by_a_commit_is_not_a_flush_timeout(spot_daemon) -> None:
    h = spot_daemon
    node, clock = await _running_node_on_manual_clock(h)
    h.sup.intake.on_reports(node, [_notice("n-answered", clock)])
    h.sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
        "event": "checkpoint_committed", "attempt": "a1", "rank": 0, "step": 40, "notice_ids": ["n-answered"],
        "seconds": 1.2}}])
    clock.advance(60)
    await h.sup.reconcile_once()
    assert h.events("interruption_notice") and h.events("checkpoint_committed")
    assert not h.events("checkpoint_flush_timed_out")


async def test_notice_without_commit_by_the_deadline_is_a_flush_timed_out_event(spot_daemon) -> None:
    h = spot_daemon
    node, clock = await _running_node_on_manual_clock(h)
    h.sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
        "event": "checkpoint_committed", "attempt": "a1", "rank": 0, "step": 40, "notice_ids": [],
        "seconds": 1.2}}])
    h.sup.intake.on_reports(node, [_notice("n-hung", clock)])
    (notice_ev,) = h.events("interruption_notice")  # recorded the moment it was reported
    clock.advance(10.0 + 4.0)  # past the deadline, inside the grace for a late commit report
    await h.sup.reconcile_once()
    assert not h.events("checkpoint_flush_timed_out")
    clock.advance(2.0)
    await h.sup.reconcile_once()
    (ev,) = h.events("checkpoint_flush_timed_out")
    assert ev.node == node.id and notice_ev.seq < ev.seq
    assert ev.data["notice_id"] == "n-hung" and ev.data["last_commit_step"] == 40
    await h.sup.reconcile_once()
    assert len(h.events("checkpoint_flush_timed_out")) == 1  # said once


async def test_a_flood_of_low_value_events_is_shed_and_the_vital_ones_all_arrive(store: Store, receiver: Receiver) -> None:
    """Issue 25, item 5: 6,000 job_resumed events of one node (a report flood) with 30
    commits among them. The sink, far behind, sends every commit and only the newest
    job_resumed of each window it reads, so it falls at most FEED_BACKLOG_BOUND events
    behind the flood, not 6,000 (on main it sent all of them, 40 minutes of Slack)."""
    n = Notifier(store, [webhook("hook", receiver.url())], pool="test", environ=ENV)
    await n.start()
    try:
        events = [("job_resumed", "n1", {"attempt": f"a{i}", "step": 0}) for i in range(6000)]
        for k in range(30):
            events.insert(200 * k + 100, ("checkpoint_committed", "n2", {"step": k}))
        seqs = emit_all(store, n, events)
        assert await n.drain(UNTIL_TIMEOUT_S), n.stats("hook")
    finally:
        await n.aclose()
    got = receiver.events()
    commits = [e["data"]["step"] for e in got if e["kind"] == "checkpoint_committed"]
    resumed = [e for e in got if e["kind"] == "job_resumed"]
    assert commits == list(range(30))
    assert len(resumed) <= notify.FEED_BACKLOG_BOUND + 5
    assert [e["seq"] for e in got] == sorted(e["seq"] for e in got)  # still in order
    assert resumed[-1]["seq"] == seqs[-1] or got[-1]["seq"] == seqs[-1]  # the newest state arrives
    stats = n.stats("hook")
    assert stats.shed == 6000 - len(resumed) and stats.cursor == seqs[-1]
    (shed_family, _) = list(n.collect())
    assert [(s.labels, s.value) for s in shed_family.samples if s.name.endswith("_total")] == \
        [({"sink": "hook"}, stats.shed)]
