"""The feed: every event, routed to Slack and to signed webhooks, at least once and in order.

Where it sits: events are already durable (the store's ``events`` table, ``seq``
persisted and monotonic). The **outbox** is one cursor per sink in the store's
``kv`` table, ``notify.cursor.<sink>`` = the last ``seq`` that sink is done with;
no event is copied. One worker task per sink reads the events after its cursor,
oldest first, and sends **every pending event the sink wants, up to its
``max_batch``, in one request** (a batch); it advances the cursor past the whole
batch only after the sink answered 2xx. A burst (1,000 nodes registering: ~4,000
events in 10 s) thus costs a few requests, not one round trip per event queued
behind the others.

**Where the workers run**: on a thread of their own (:data:`FEED_THREAD`) with its
own asyncio loop, which also holds their HTTP sessions, tenacity's retries and
Slack's pacing, and its own SQLite connection to the store's file
(:meth:`Store.open_sibling`; WAL lets it read while the daemon writes, and its cursor
writes wait out the daemon's): on the daemon's loop a worker woken in a burst waited
behind hundreds of queued HTTP handlers (event → webhook p99 400 ms with 1,000 nodes,
bench/scale.py). The daemon's loop only appends the event and hands the wake over
(``call_soon_threadsafe``, :class:`_Handover`); the workers never touch Supervisor
objects, and their progress comes back to :meth:`Notifier.wait_until` the same way. So:

- **at least once, in order per sink**: a batch is re-sent, the same events, until
  a 2xx, and the next batch waits for it; events within a batch and batches are
  oldest first. A daemon restart resumes at the first event not yet acknowledged;
  only the batch in flight when the daemon stopped can arrive twice (then possibly
  with more events after it), so receivers de-duplicate by ``seq`` (in every event);
- **HA: only what is durable**: with the HA store (:class:`daemon.ha.store.EtcdStore`,
  ``Store.replicated``) an event is in the leader's mirror before it is in etcd, and
  a leader that dies in between takes it along. The workers send no event past
  ``Store.durable_seq()`` (woken by ``Store.on_durable`` when it moves), and write
  their cursors through the pool's store on the daemon's loop, so they reach etcd: the
  next leader's feed resumes at the cursor of the last sync, and re-sends at most what
  was delivered after it;
- **never blocking the supervisor**: ``Supervisor.record()`` only wakes the workers
  (:meth:`Notifier.wake` is a listener; it never waits for the feed's thread). A
  sink that is down is retried with exponential backoff and jitter (tenacity), capped
  at the sink's ``max_backoff_s``, for as long as it is down; other sinks are not held
  up (each has its own worker task on the feed's loop). A 429 with a
  ``Retry-After`` (seconds or an HTTP date) waits at least that long (at most
  :data:`~daemon.feed.sinks.RETRY_AFTER_MAX_S`). Every failed attempt is logged
  (``notify_attempt_failed``: sink, first and last seq of the batch, status or error,
  next wait). A sink that answers 4xx is retried too: the queue waits until the
  operator fixes it;
- a sink seen for the first time starts after the newest event already stored (a
  sink added to a long-lived pool does not replay its history);
- **a backlog stays bounded**: a sink more than :data:`FEED_BACKLOG_BOUND` events behind
  (a flood of reports, a sink down for hours) reads :data:`FEED_SHED_WINDOW` events at a
  time and, of the low-value kinds (:data:`daemon.control.bounds.SHEDDABLE_KINDS`: a
  ``job_resumed``, an alarm), sends only the newest per kind and node of the window; the
  others are skipped (the cursor moves past them), counted in ``SinkStats.shed`` and
  ``spotvisor_feed_events_shed_total{sink}``, and logged at most every 10 s
  (``notify_backlog_shed``). Notices, commits, losses and the job's end are always sent.

What an event says (its text line, the webhook body, the Slack blocks) is
:mod:`daemon.feed.feed_messages`; the sinks and how a batch reaches each (webhook,
Slack, its pacing, ``Retry-After``) are :mod:`daemon.feed.sinks`; a webhook request's
signature (``X-Spotvisor-Signature``, :func:`~daemon.feed.signing.verify_signature` for
receivers) is :mod:`daemon.feed.signing`. This module is the delivery loop.

**A bad event never stops a sink**: rendering is total (:mod:`daemon.feed.feed_messages`:
any data an older daemon stored renders, the webhook body is strict JSON), and should
rendering an event still raise (a bug), the worker logs it once
(``notify_render_failed``, error level), sends that event as a fallback line (kind and
``seq``) and goes on; the cursor still moves in order.

**Secret URLs stay out of the logs**: the sinks' secret URLs are registered with the
notifier's :class:`~daemon.feed.redaction.Redactor` (the daemon's, or one of its own),
which :meth:`Notifier.start` installs on the logging handlers (:mod:`daemon.feed.redaction`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import aiohttp
import structlog
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter
from tenacity.wait import wait_base

from daemon.config import SinkSpec
from daemon.control.bounds import shed
from daemon.controlnode.store import NotLeading, Store
from daemon.feed.redaction import Redactor
from daemon.feed.sinks import SENDERS, DeliveryError, Sender, Target, render_failed, resolve_sinks
from daemon.model import Event, Node

__all__ = ["Notifier", "SinkStats", "FEED_THREAD", "CURSOR_KEY", "FEED_BACKLOG_BOUND", "FEED_SHED_WINDOW"]

log = structlog.get_logger("spotvisor.notify")

CURSOR_KEY = "notify.cursor.{}"
_READ = 500  # events read at a time by a sink that filters kinds (at least its max_batch)
FEED_BACKLOG_BOUND = 1000  # a sink further behind than this many events sheds low-value ones
FEED_SHED_WINDOW = 2000  # events read at a time while shedding (the span a kind and node coalesce over)
_SHED_LOG_EVERY_S = 10.0
FEED_THREAD = "spotvisor-feed"  # the thread the workers run on, with their own event loop
_JOIN_TIMEOUT_S = 10.0  # aclose waits this long for the feed's thread (its workers get 5 s to stop)


class _wait_retry_after(wait_base):
    """``fallback``'s wait, or longer when the sink asked for it (a 429's Retry-After)."""

    def __init__(self, fallback: wait_base) -> None:
        self.fallback = fallback

    def __call__(self, retry_state: RetryCallState) -> float:
        wait = self.fallback(retry_state)
        exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
        asked = exc.retry_after_s if isinstance(exc, DeliveryError) else None
        return wait if asked is None else max(wait, asked)


def _take(events: Sequence[Event], wants: Callable[[int], bool], limit: int) -> tuple[list[Event], int]:
    """The next batch from ``events`` (oldest first, all after the cursor): the first
    ``limit`` events the sink wants (``wants(i)`` for ``events[i]``), and the ``seq`` the
    cursor moves to once they are delivered (past the events it does not want, up to the
    next one it does)."""
    batch: list[Event] = []
    for i, ev in enumerate(events):
        if wants(i):
            if len(batch) == limit:
                return batch, batch[-1].seq
            batch.append(ev)
    return batch, events[-1].seq


@dataclass(frozen=True, slots=True)
class SinkStats:
    """One sink's delivery so far (this process): ``cursor`` = last ``seq`` done with,
    ``delivered`` = events answered 2xx, ``failed_attempts`` = attempts (requests) that
    were not, ``failing`` = the batch in hand has failed and is being retried,
    ``batches`` = requests answered 2xx, ``shed`` = low-value events skipped while it was
    far behind (:data:`FEED_BACKLOG_BOUND`)."""

    cursor: int
    delivered: int
    failed_attempts: int
    failing: bool
    batches: int = 0
    shed: int = 0  # events skipped while the sink was over FEED_BACKLOG_BOUND behind


class _Handover:
    """A call handed to another thread's event loop, at most one in flight however often it
    is asked for: :meth:`send` (any thread) schedules ``fn`` on ``loop`` unless a hand-over
    has not run yet; the flag clears before ``fn`` runs, so what happens from then on hands
    over again. A closed loop is no error: nobody is there to call."""

    __slots__ = ("_fn", "_pending")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._pending = False

    def send(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is None or self._pending:
            return
        self._pending = True
        try:
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # that loop has just closed
            self._pending = False

    def _run(self) -> None:
        self._pending = False
        self._fn()


def sendable(last_seq: int, durable_seq: int | None) -> int:
    """The newest event seq a feed may send: every stored one (``durable_seq`` None: the
    embedded store), or under HA only what etcd holds (what a new leader would not have is
    never shown)."""
    return last_seq if durable_seq is None else min(durable_seq, last_seq)


class _SinkWorker:
    """One sink's worker, on the feed's loop: reads the events after its cursor from the
    feed's own connection, sends them in batches and moves the cursor past each batch the
    sink answered 2xx (the module docstring). It touches no Supervisor object; ``moved``
    tells the notifier it moved (delivered, skipped or failed an attempt)."""

    __slots__ = ("target", "sender", "cursor", "wake", "task", "stopped", "failing", "delivered",
                 "failed_attempts", "batches", "shed", "shed_logged_at", "shed_unlogged", "_moved", "_redactor",
                 "_durable", "_save")

    def __init__(self, target: Target, sender: Sender, cursor: int, *, moved: Callable[[], None],
                 redactor: Redactor, durable: Callable[[], int | None] = lambda: None,
                 save: Callable[[str, int], None] | None = None) -> None:
        """``durable()``: the newest seq it may send (``None``: any stored);
        ``save(key, seq)``: where its cursor is written (``None``: the feed's own connection)."""
        self.target = target
        self.sender = sender
        self.cursor = cursor
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.stopped = False  # its task has ended (set on the feed's thread, read on the daemon's)
        self.failing = False
        self.delivered = 0
        self.failed_attempts = 0
        self.batches = 0
        self.shed = 0
        self.shed_logged_at: float | None = None  # loop time of the last notify_backlog_shed line
        self.shed_unlogged = 0
        self._moved = moved
        self._redactor = redactor
        self._durable = durable
        self._save = save

    def stats(self) -> SinkStats:
        return SinkStats(self.cursor, self.delivered, self.failed_attempts, self.failing, self.batches, self.shed)

    async def run(self, store: Store) -> None:
        """Deliver until cancelled; ``store`` is the feed's own connection (its cursor is written there)."""
        key = CURSOR_KEY.format(self.target.name)
        limit = self.target.spec.max_batch
        read = limit if self.target.wants_all else max(_READ, limit)  # a filter: look further ahead
        while True:
            await self.sender.pace()
            self.wake.clear()  # before reading: an event recorded (or made durable) from here on sets it again
            last = sendable(store.last_seq(), self._durable())  # HA: what a new leader would not have, never
            behind = last - self.cursor
            shedding = behind > FEED_BACKLOG_BOUND
            pending = [ev for ev in store.events(since=self.cursor, limit=max(read, FEED_SHED_WINDOW)
                                                 if shedding else read) if ev.seq <= last]
            if not pending:
                self._moved()
                await self.wake.wait()
                continue
            send = shed([(ev.kind, ev.node) for ev in pending], backlog=behind, bound=FEED_BACKLOG_BOUND)
            batch, upto = _take(pending, lambda i: send[i] and self.target.wants(pending[i].kind), limit)
            if shedding:
                self._count_shed(sum(1 for i, ev in enumerate(pending)
                                     if ev.seq <= upto and not send[i] and self.target.wants(ev.kind)), behind)
            if batch:
                # only the nodes this batch names, by key: reading the whole node table per
                # batch stalled the loop ~20 ms per batch with 1,000 nodes (bench/scale.py)
                nodes: dict[str, Node | None] = {}
                for ev in batch:
                    if ev.node and ev.node not in nodes:
                        nodes[ev.node] = store.node(ev.node)
                await self._deliver([(ev, nodes.get(ev.node or "")) for ev in batch])
            # after the 2xx, with no await in between: a cancel during the request
            # leaves the cursor before this batch, which is then sent again
            self.cursor = upto
            if self._save is None:
                store.set(key, upto)  # waits up to busy_timeout_s for the daemon's write
            else:
                self._save(key, upto)
            self._moved()

    def _count_shed(self, n: int, behind: int) -> None:
        if n <= 0:
            return
        self.shed += n
        self.shed_unlogged += n
        now = asyncio.get_running_loop().time()
        if self.shed_logged_at is None or now - self.shed_logged_at >= _SHED_LOG_EVERY_S:
            self.shed_logged_at = now
            log.warning("notify_backlog_shed", sink=self.target.name, skipped=self.shed_unlogged, behind=behind,
                        bound=FEED_BACKLOG_BOUND, note="low-value events; the newest per kind and node is sent")
            self.shed_unlogged = 0

    async def _deliver(self, batch: list[tuple[Event, Node | None]]) -> None:
        try:
            prepared = self.sender.prepare(batch)
        except Exception as exc:  # noqa: BLE001 - a rendering bug: the batch goes as fallback lines, in order
            render_failed(self.target.name, [ev for ev, _ in batch], exc, self._redactor)
            prepared = self.sender.prepare_fallback(batch)
        cap = self.target.spec.max_backoff_s
        first, last = batch[0][0].seq, batch[-1][0].seq
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(DeliveryError),
            wait=_wait_retry_after(wait_exponential_jitter(multiplier=min(0.5, cap), max=cap, jitter=min(0.5, cap))),
            before_sleep=lambda rs: self._attempt_failed(first, last, len(batch), rs),
        )  # no stop: retried for as long as the sink is down; the same batch each time
        async for attempt in retrying:
            with attempt:
                await self.sender.send(prepared)
        self.delivered += len(batch)
        self.batches += 1
        if self.failing:
            self.failing = False
            log.info("notify_recovered", sink=self.target.name, seq=first, last_seq=last)

    def _attempt_failed(self, first: int, last: int, n: int, rs: RetryCallState) -> None:
        self.failing = True
        self.failed_attempts += 1
        self._moved()
        exc = rs.outcome.exception() if rs.outcome is not None else None
        wait = rs.next_action.sleep if rs.next_action is not None else math.nan
        log.warning("notify_attempt_failed", sink=self.target.name, seq=first, last_seq=last, events=n,
                    attempt=rs.attempt_number, error=self._redactor.redact(str(exc)), retry_in_s=round(wait, 2))


class Notifier:
    """Delivers the store's events to the configured sinks (see the module docstring).

    Lifecycle: construct (no I/O; reads the sinks' URLs and keys from ``environ`` and
    registers the secret ones with ``redactor``),
    ``await start()`` on the daemon's loop (the thread :data:`FEED_THREAD` with its own
    loop, one worker task per sink named ``notify:<sink>``; no thread without sinks),
    ``wake()`` after each new event (``Supervisor.subscribe(notifier.wake)``), then
    ``await aclose(drain_timeout_s=...)`` (idempotent, safe after a failed start).
    ``wake``, ``stats``, ``wait_until``, ``drain`` and ``aclose`` are called from the
    daemon's loop; only the workers run on the feed's.

    ``redactor``: the daemon's (:mod:`daemon.feed.redaction`), which keeps the sinks' secret
    URLs out of every log; without one the notifier has its own, installed on the logging
    handlers from :meth:`start` to :meth:`aclose`.

    Raises (constructor):
        ConfigError: a sink's ``url_env`` / ``secret_env`` variable is unset.
    """

    def __init__(self, store: Store, sinks: Sequence[SinkSpec], *, pool: str,
                 environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time,
                 redactor: Redactor | None = None) -> None:
        self.store = store
        self.pool = pool
        self.clock = clock
        self._own_redactor = redactor is None  # then it is this notifier's to install and take back
        self.redactor = Redactor() if redactor is None else redactor
        self.targets = resolve_sinks(sinks, environ, redactor=self.redactor)
        self._workers: dict[str, _SinkWorker] = {}
        # on the daemon's loop: set (and replaced) whenever a worker moved; signalled from the
        # feed's thread through call_soon_threadsafe, at most one signal in flight
        self._progress = asyncio.Event()
        self._progress_handover = _Handover(self._progressed)  # feed's thread -> daemon's loop
        self._wake_handover = _Handover(self._wake_workers)  # daemon's loop -> feed's loop
        self._caller: asyncio.AbstractEventLoop | None = None  # the daemon's loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the feed's loop, while its workers run
        self._stop: asyncio.Event | None = None  # on the feed's loop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ready: concurrent.futures.Future[None] | None = None  # the feed's setup: done or failed
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Start the feed's thread and a worker per sink at its stored cursor (a new sink:
        at the newest event). Blocks the caller's loop only for the cursor reads; returns
        once the workers run.

        Call before the supervisor records anything new, so a new sink misses nothing
        of this run.

        Raises:
            RuntimeError: called twice.
            ValueError: the store is in memory (the feed needs a second connection to it).
            sqlite3.Error, OSError: the feed could not open its connection.
        """
        if self._started:
            raise RuntimeError("Notifier.start() was already called")
        self._started = True
        if not self.targets:
            return
        self.redactor.install()  # the logging set-up is done by now: its handlers get the filter
        if self.store.in_memory:
            raise ValueError("the feed reads the store from its own thread through a second connection: "
                             "it needs a database file, not :memory:")
        self._caller = asyncio.get_running_loop()
        self.store.on_durable(self.wake)  # HA: the workers send only what is durable; more is, now
        cursors: dict[str, int] = {}
        for t in self.targets:  # here, before start() returns: a new sink starts at the newest event so far
            key = CURSOR_KEY.format(t.name)
            cursor = self.store.get(key)
            if cursor is None:
                cursor = self.store.last_seq()
                self.store.set(key, cursor)
            cursors[t.name] = int(cursor)
        self._ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._thread_main, args=(cursors, self._ready),
                                        name=FEED_THREAD, daemon=True)
        self._thread.start()
        await asyncio.shield(asyncio.wrap_future(self._ready))  # shielded: a cancelled start leaves it to aclose
        log.info("notifier_started", pool=self.pool, sinks=cursors)

    def wake(self, _event: Event | None = None) -> None:
        """New events exist: every worker looks. Never blocks (usable as a listener): it
        hands the wake to the feed's loop, one hand-over at a time however many events."""
        self._wake_handover.send(self._loop)  # None: the feed's loop is not running (yet, or any more)

    def stats(self, sink: str) -> SinkStats:
        """Where sink ``sink`` stands (for ``/metrics`` and tests)."""
        return self._workers[sink].stats()

    def collect(self) -> Iterable[Metric]:
        """Per sink: events behind and events shed (a prometheus_client custom collector;
        ``/metrics`` registers it)."""
        shed_total = CounterMetricFamily("spotvisor_feed_events_shed", "Low-value events a sink skipped while it "
                                         "was more than FEED_BACKLOG_BOUND events behind (daemon/feed/notify.py).",
                                         labels=["sink"])
        behind = GaugeMetricFamily("spotvisor_feed_backlog_events", "Events stored that a sink is not done with.",
                                   labels=["sink"])
        last = self._sendable() if self._workers else 0
        for name, w in sorted(self._workers.items()):
            shed_total.add_metric([name], w.shed)
            behind.add_metric([name], max(0, last - w.cursor))
        yield shed_total
        yield behind

    async def wait_until(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``pred()`` holds, re-checked whenever a worker delivers, skips or
        fails an attempt; False after ``timeout_s`` seconds. On the daemon's loop."""
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    await self._progress.wait()
            return True
        except TimeoutError:
            return False

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every sink is done with every stored event; False after ``timeout_s`` seconds."""
        return await self.wait_until(self._caught_up, timeout_s)

    async def aclose(self, *, drain_timeout_s: float = 3.0) -> None:
        """Give the workers up to ``drain_timeout_s`` seconds to deliver what is
        queued (e.g. the final ``pool_released``), then cancel them, close the HTTP
        sessions and the feed's connection, and join its thread (in a worker thread of
        the caller's loop: the loop never blocks on it). What is left stays in the
        outbox for the next start."""
        if self._closed:
            return
        self._closed = True
        thread, ready = self._thread, self._ready
        if thread is None or ready is None:
            self._release_redactor()
            return
        try:
            with contextlib.suppress(Exception):  # a failed setup: start() raised it already
                await asyncio.shield(asyncio.wrap_future(ready))  # short: a connection and the sessions
            if self._loop is not None and drain_timeout_s > 0 and not self._caught_up():
                if not await self.drain(drain_timeout_s):
                    log.warning("notify_undelivered_at_close",
                                behind={w.target.name: self.store.last_seq() - w.cursor
                                        for w in self._workers.values()})
        finally:
            # the feed checks _stopping after publishing _loop: one of the two sees the other
            self._stopping = True
            loop, stop = self._loop, self._stop
            if loop is not None and stop is not None:
                with contextlib.suppress(RuntimeError):  # its loop has closed: the feed already ended
                    loop.call_soon_threadsafe(stop.set)
            await asyncio.to_thread(thread.join, _JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.error("notify_thread_not_stopped", thread=thread.name, waited_s=_JOIN_TIMEOUT_S)
            self._release_redactor()

    def _release_redactor(self) -> None:
        """Its own redactor's filter leaves the logging handlers (the daemon's stays: the daemon's to remove)."""
        if self._own_redactor:
            self.redactor.uninstall()

    # -- internals: the feed's thread ------------------------------------------------------------
    def _thread_main(self, cursors: dict[str, int], ready: concurrent.futures.Future[None]) -> None:
        try:
            asyncio.run(self._feed(cursors, ready))
        except Exception as exc:  # after the setup (a failed one is start()'s to raise)
            log.error("task_crashed", task=FEED_THREAD, error=self.redactor.redact(repr(exc)))

    async def _feed(self, cursors: dict[str, int], ready: concurrent.futures.Future[None]) -> None:
        """The feed's loop: open its connection and sessions, run the workers until
        :meth:`aclose` asks, then cancel them and close what it opened, in reverse order."""
        loop = asyncio.get_running_loop()
        store: Store | None = None
        sessions: list[aiohttp.ClientSession] = []
        try:
            store = self.store.open_sibling()  # this thread's own connection (sqlite3: one thread each)
            workers: dict[str, _SinkWorker] = {}
            for t in self.targets:
                session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=t.spec.timeout_s))
                sessions.append(session)
                sender = SENDERS[t.spec.type](t, session, pool=self.pool, clock=self.clock, redactor=self.redactor)
                workers[t.name] = _SinkWorker(t, sender, cursors[t.name], moved=self._moved, redactor=self.redactor,
                                              durable=self.store.durable_seq,
                                              save=self._save_replicated if self.store.replicated else None)
            stop = asyncio.Event()
            for w in workers.values():
                w.task = asyncio.create_task(w.run(store), name=f"notify:{w.target.name}")
                w.task.add_done_callback(functools.partial(self._task_done, w))
            self._workers, self._stop = workers, stop
            self._loop = loop  # from here on wake() reaches the workers
        except Exception as exc:
            ready.set_exception(exc)
            await self._close_feed(sessions, store)
            return
        ready.set_result(None)
        try:
            if not self._stopping:
                await stop.wait()
        finally:
            self._loop = None
            tasks = [w.task for w in workers.values() if w.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)
            await self._close_feed(sessions, store)

    @staticmethod
    async def _close_feed(sessions: list[aiohttp.ClientSession], store: Store | None) -> None:
        for s in reversed(sessions):
            await s.close()
        if store is not None:
            store.close()

    def _wake_workers(self) -> None:  # on the feed's loop
        for w in self._workers.values():
            w.wake.set()

    def _sendable(self) -> int:
        """The newest seq the workers may send (on the daemon's loop)."""
        return sendable(self.store.last_seq(), self.store.durable_seq())

    def _save_replicated(self, key: str, seq: int) -> None:
        """A worker's cursor (on the feed's thread), written through the daemon's store on
        the daemon's loop: HA replicates it, so the next leader's feed resumes there and
        sends again at most what was delivered after its last sync."""
        caller = self._caller
        if caller is not None and not caller.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the next leader resends
                caller.call_soon_threadsafe(self._set_cursor, key, seq)

    def _set_cursor(self, key: str, seq: int) -> None:  # on the daemon's loop
        try:
            self.store.set(key, seq)
        except NotLeading:  # deposed: the next leader's feed resends from its last sync
            pass

    def _caught_up(self) -> bool:
        last = self._sendable()
        return all(w.cursor >= last or w.stopped for w in self._workers.values())

    def _moved(self) -> None:
        """A worker moved (on the feed's thread): wake the waiters on the daemon's loop."""
        self._progress_handover.send(self._caller)

    def _progressed(self) -> None:  # on the daemon's loop
        self._progress.set()
        self._progress = asyncio.Event()

    def _task_done(self, w: _SinkWorker, t: asyncio.Task[None]) -> None:
        w.stopped = True
        if not t.cancelled() and t.exception() is not None:
            log.error("task_crashed", task=t.get_name(), error=self.redactor.redact(repr(t.exception())))
        self._moved()
