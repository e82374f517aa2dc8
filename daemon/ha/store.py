"""The pool's state in etcd, where a new leader reads it: :class:`EtcdStore`, and the
provider gate that commits it before each purchase or termination (:class:`FencedProvider`).

:class:`EtcdStore` is :class:`daemon.controlnode.store.Store` (its interface, its reads,
its seq semantics) over an in-memory SQLite mirror, plus an **outbox**: every write
(event, node row, small value) is applied to the mirror at once, synchronously as the
supervisor expects (no I/O on the event loop), and queued as an etcd op. :meth:`EtcdStore.sync`
commits the outbox, in order, through fenced txns (:class:`daemon.ha.fence.Fence`: the
leader key's create_revision == the fence and its lease == ours), each also comparing
the seq counter's mod_revision with the last one this store wrote, and putting the counter to
the batch's last seq: events keep their order and no seq is reused, even across leaders.
A background flush runs every ``flush_every_s``; :class:`FencedProvider` calls
:meth:`sync` before each ``launch`` and ``terminate``, so the node row and its
``node_launch_requested`` event are in etcd, under the fence, before the cloud is asked:
a deposed leader's sync raises :class:`~daemon.ha.fence.Deposed` and the provider is not called.

Keys under ``/spotvisor/<pool>/``: ``seq`` (the last event's seq), ``events/<seq, 20 digits>``
(``{"time", "kind", "node", "data"}``), ``nodes/<id>`` (the row's JSON), ``kv/<key>`` (JSON).

etcd keeps what it holds in memory and caps its database (``--quota-backend-bytes``, 2 GiB by
default), so the event log in etcd is bounded: every ``trim_every`` events the store deletes,
in its fenced txns and from its mirror, the events older than the newest ``keep_events``
except those of :data:`KEPT_KINDS`, the kinds a new leader reads back over the whole history
(the job's resumes and commits, its completion, the pool's release, the copies' egress, the
job timeline's). What stays grows with the job's commits and resumes, not with its
heartbeats, exits or alarms. A feed sink more than ``keep_events`` behind a new leader
misses the trimmed ones.

:meth:`EtcdStore.load` reads in pages of ``page_keys`` keys (etcd's Range with a limit, all
at the revision of the first page: one consistent state), so a large pool's state does not
come back in one response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, Callable

import structlog

from daemon.controlnode.store import Store
from daemon.controlnode.core import stop_tasks
from daemon.ha.elector import pool_prefix
from aetcd.utils import prefix_range_end

from daemon.ha.fence import Deposed, Fence
from daemon.model import Event, EventKind, Node
from daemon.providers.base import Provider

__all__ = ["EtcdStore", "FencedProvider", "KEPT_KINDS", "MAX_OPS_PER_TXN", "trim_cutoff"]

_K = EventKind
#: event kinds never trimmed: what the daemon reads over the whole history when it starts
#: (daemon/controlnode/job_tracker.py: resumes, commits, completion, release;
#: metrics.egress_usd: the copies; metrics.TIMELINE_KINDS: the job timeline; placement: the
#: first launch request, the job's submission time)
KEPT_KINDS = frozenset(k.value for k in (
    _K.JOB_RESUMED, _K.CHECKPOINT_COMMITTED, _K.JOB_COMPLETED, _K.POOL_RELEASED, _K.CHECKPOINT_REPLICATED,
    _K.NODE_LAUNCH_REQUESTED, _K.NODE_ADMITTED, _K.JOB_PAUSING, _K.JOB_UNPAUSED, _K.INTERRUPTION_NOTICE,
    _K.NODE_LOST))


def trim_cutoff(last_seq: int, keep_events: int) -> int:
    """The highest seq a trim may delete (events of :data:`KEPT_KINDS` excepted): all but the
    newest ``keep_events``; 0: nothing yet."""
    return max(0, last_seq - keep_events)

log = structlog.get_logger("spotvisor.ha")

#: ops per txn: etcd refuses more than ``--max-txn-ops`` (128 by default) in one
MAX_OPS_PER_TXN = 100


class EtcdStore(Store):
    """Store on etcd (module docstring). Construct, :meth:`open`, ``await`` :meth:`load`
    (as the new leader, before the supervisor starts), :meth:`start` the flush;
    ``await`` :meth:`aclose` (a last sync, best effort) then :meth:`close`."""

    __slots__ = ("fence", "prefix", "flush_every_s", "keep_events", "trim_every", "page_keys", "_outbox", "_lock",
                 "_seq_mod", "_flusher", "_deposed", "_queued", "_committed", "_since_trim", "_trimmed_through",
                 "_term", "_durable_seq", "_durable_listeners")

    def __init__(self, fence: Fence, *, mirror: str | Path = ":memory:", flush_every_s: float = 0.2,
                 keep_events: int = 10_000, trim_every: int = 500, page_keys: int = 1000) -> None:
        """``mirror``: the SQLite file the state is mirrored in (the daemon's: under its state
        dir, so the feed's thread can open a sibling connection; emptied by :meth:`open`:
        etcd, not this file, is the truth). ``:memory:``: no file (tests, tools).
        ``keep_events``, ``trim_every``: the event log's trim (module docstring);
        ``page_keys``: keys per read of :meth:`load`. Raises ``ValueError`` for one under 1."""
        for name, n in (("keep_events", keep_events), ("trim_every", trim_every), ("page_keys", page_keys)):
            if n < 1:
                raise ValueError(f"{name} must be at least 1, got {n}")
        super().__init__(mirror)
        self.fence = fence
        self.prefix = pool_prefix(fence.elector.pool)
        self.flush_every_s = flush_every_s
        self._outbox: list[tuple[str, str, str | None, int | None]] = []
        self._lock = asyncio.Lock()
        self._seq_mod = 0  # mod_revision of the seq key as this store last saw it (0: absent)
        self._flusher: asyncio.Task[None] | None = None
        self._deposed = False
        self._queued = self._committed = 0  # writes queued / committed to etcd since this store opened
        self.keep_events, self.trim_every, self.page_keys = keep_events, trim_every, page_keys
        self._since_trim = 0  # events appended since the last trim
        self._trimmed_through = 0  # no event to trim at or below this seq is left
        self._term: int | None = None  # the fence it was loaded under (None: not loaded; tools, tests)
        self._durable_seq = 0  # the newest event seq in etcd under a fence (read by the feed's thread)
        self._durable_listeners: list[Callable[[], None]] = []

    def open(self) -> "EtcdStore":
        """Open the mirror, emptied (a previous run's file is stale: etcd holds the state)."""
        super().open()
        for table in ("events", "nodes", "kv"):
            self.db.execute(f"DELETE FROM {table}")
        self.db.execute("DELETE FROM sqlite_sequence")
        return self

    # -- loading: the new leader reads what the old one committed ---------------------
    async def load(self) -> None:
        """Read the pool's state from etcd into the mirror (replacing nothing: call on a
        freshly opened store), as the writer of the elector's current term: the store
        commits under that fence only (a daemon that leads again, with a new fence, loads a
        new store). Raises aetcd/gRPC errors: etcd unreachable."""
        self._term = self.fence.elector.fence
        client, end = self.fence.client, prefix_range_end(self.prefix)
        start, revision = self.prefix, 0
        while True:  # pages of page_keys keys, all at the first page's revision: one state
            page = await client.range_page(start, end, limit=self.page_keys, revision=revision)
            revision = revision or page.header.revision
            self._load_rows(page.kvs)
            if not page.more or not page.kvs:
                self._durable_seq = self.last_seq()  # what etcd holds is durable
                return
            start = page.kvs[-1].key + b"\0"  # the next key after the page's last

    def _load_rows(self, rows: Any) -> None:
        db = self.db
        db.execute("BEGIN")  # one transaction per page: one write of the mirror, not one per row
        try:
            for kv in rows:
                key, value = kv.key[len(self.prefix):].decode(), kv.value
                kind, _, name = key.partition("/")
                if kind == "seq":
                    self._seq_mod = kv.mod_revision
                elif kind == "events":
                    ev = json.loads(value)
                    db.execute("INSERT INTO events(seq, time, kind, node, data) VALUES (?, ?, ?, ?, ?)",
                               (int(name), ev["time"], ev["kind"], ev["node"], json.dumps(ev["data"])))
                elif kind == "nodes":
                    db.execute("INSERT INTO nodes(id, body) VALUES (?, ?)", (name, value.decode()))
                elif kind == "kv":
                    db.execute("INSERT INTO kv(key, value) VALUES (?, ?)", (name, value.decode()))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- writes: the mirror now, etcd at the next sync --------------------------------
    def append_event(self, kind: str, node: str | None = None, data: dict[str, Any] | None = None,
                     *, at: float | None = None) -> Event:
        ev = super().append_event(kind, node, data, at=at)
        body = {"time": ev.time, "kind": ev.kind, "node": ev.node, "data": ev.data}
        self._queue(("events", f"{ev.seq:020d}", json.dumps(body, default=str), ev.seq))
        self._since_trim += 1
        if self._since_trim >= self.trim_every:
            self._since_trim = 0
            self.trim(ev.seq)
        return ev

    def trim(self, last_seq: int) -> int:
        """Delete (from the mirror now, from etcd at the next sync) the events at or below
        :func:`trim_cutoff` whose kind is not in :data:`KEPT_KINDS`; how many."""
        cutoff = trim_cutoff(last_seq, self.keep_events)
        if cutoff <= self._trimmed_through:
            return 0
        kept = sorted(KEPT_KINDS)
        seqs = [seq for (seq,) in self.db.execute(
            f"SELECT seq FROM events WHERE seq > ? AND seq <= ? AND kind NOT IN ({','.join('?' * len(kept))})",
            (self._trimmed_through, cutoff, *kept))]
        self.db.executemany("DELETE FROM events WHERE seq = ?", [(seq,) for seq in seqs])
        for seq in seqs:
            self._queue(("events", f"{seq:020d}", None, None))
        self._trimmed_through = cutoff
        return len(seqs)

    def put_node(self, node: Node) -> None:
        super().put_node(node)
        (body,) = self.db.execute("SELECT body FROM nodes WHERE id = ?", (node.id,)).fetchone()
        self._queue(("nodes", node.id, body, None))

    def set(self, key: str, value: Any) -> None:
        super().set(key, value)
        self._queue(("kv", key, json.dumps(value), None))

    def _queue(self, item: tuple[str, str, str | None, int | None]) -> None:
        if self._deposed:
            raise Deposed("this daemon was deposed: its store takes no more writes")
        self._outbox.append(item)
        self._queued += 1

    @property
    def pending(self) -> int:
        """Writes not yet committed to etcd."""
        return len(self._outbox)

    async def sync(self) -> None:
        """Commit every write made so far, in order, through fenced txns (one at least,
        also with nothing pending: the fence is checked by etcd).

        Raises:
            Deposed: this daemon does not lead; nothing more is written, ever (the outbox is dropped).
            aetcd/gRPC errors: etcd unreachable (the outbox is kept; the next sync retries).
        """
        async with self._lock:
            await self._sync_locked()

    async def durable(self) -> None:
        """Return once every write made before this call is committed to etcd under this
        daemon's fence, with its clock gate still open: what an agent is told next may
        follow from those writes (:meth:`daemon.controlnode.store.Store.durable`). Writes
        already committed (by the flush, or by a call that came first) cost no txn, so a
        heartbeat that changed nothing asks only the clock gate.

        Raises:
            Deposed: this daemon does not lead (the gate is shut, or etcd refused the fence).
            aetcd/gRPC errors: etcd unreachable (the writes stay queued).
        """
        target = self._queued
        if self._committed < target:
            async with self._lock:
                if self._committed < target:  # else a sync that came first committed them
                    await self._sync_locked()
        if self._deposed or not self.fence.elector.may_act():
            raise Deposed(f"{self.fence.elector.name} does not lead {self.fence.elector.pool}")

    async def _sync_locked(self) -> None:
        if self._deposed:
            raise Deposed("this store's writer was deposed: load a new one if this daemon leads again")
        while True:  # at least one txn: the provider gate asks etcd, not only this daemon's clock
            batch = self._outbox[:MAX_OPS_PER_TXN]
            await self._commit(batch)
            del self._outbox[:len(batch)]
            self._committed += len(batch)
            seqs = [seq for kind, _, body, seq in batch if kind == "events" and body is not None and seq is not None]
            if seqs and max(seqs) > self._durable_seq:
                self._durable_seq = max(seqs)
                for listener in self._durable_listeners:
                    listener()
            if not self._outbox:
                return

    async def _commit(self, batch: list[tuple[str, str, str | None, int | None]]) -> None:
        tx = self.fence.client.transactions
        seq_key = self.prefix + b"seq"
        last = {(kind, name): body for kind, name, body, _ in batch}  # one txn is atomic: the last write of a key wins
        ops = [tx.put(self.prefix + f"{kind}/{name}".encode(), body.encode()) if body is not None
               else tx.delete(self.prefix + f"{kind}/{name}".encode())  # a trimmed event
               for (kind, name), body in last.items()]
        seqs = [seq for *_, seq in batch if seq is not None]
        if seqs:
            ops.append(tx.put(seq_key, str(max(seqs)).encode()))
        ops.append(tx.get(seq_key))
        try:
            if self._term is not None and self.fence.elector.fence != self._term:  # led again since the load:
                raise Deposed(f"{self.fence.elector.name}'s store was loaded under fence {self._term}: "  # its
                              "load a new one for the new term")  # mirror may lack what another leader wrote
            answers = await self.fence.commit(ops, extra_compares=[tx.mod(seq_key) == self._seq_mod])
        except Deposed:
            self._deposed = True
            self._outbox.clear()
            raise
        kvs = answers[-1]
        self._seq_mod = kvs[0][1].mod_revision if kvs else 0

    # -- what is durable (the feed sends nothing else) ---------------------------------
    replicated = True

    def durable_seq(self) -> int:
        """The newest event seq committed to etcd under this store's fence (or loaded from
        it); events past it are in the mirror only. A counter: safe from any thread."""
        return self._durable_seq

    def on_durable(self, listener: Callable[[], None]) -> None:
        """``listener()`` after each commit that moves :meth:`durable_seq` (on the loop
        that syncs: the daemon's)."""
        self._durable_listeners.append(listener)

    # -- lifetime ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the background flush (task ``ha:store:<pool>``)."""
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name=f"ha:store:{self.fence.elector.pool}")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_every_s)
            try:
                if self._outbox:
                    await self.sync()
            except Deposed:
                log.warning("ha_store_deposed", pool=self.fence.elector.pool)
                return
            except Exception as exc:  # noqa: BLE001  etcd away: kept, retried next period
                log.warning("ha_store_sync_failed", error=repr(exc)[:200], pending=self.pending)

    async def aclose(self) -> None:
        """Stop the flush and make a last sync (best effort: a deposed or cut-off daemon's
        writes stay out of etcd, as they must).

        A flush in flight finishes first: cancelled halfway, its txn could be applied by
        etcd with its answer lost, and the last sync's compare on the seq key would then be
        refused as if this daemon were deposed, dropping the writes made since (a seeded HA
        job trial lost the final ``pool_released`` so)."""
        task, self._flusher = self._flusher, None
        if task is not None:
            async with self._lock:  # the flush's sync holds it while its txn is on the wire
                task.cancel()
            await stop_tasks([task])  # (cancelled again if an aetcd call lost the cancel)
        with contextlib.suppress(Exception):
            await self.sync()


class FencedProvider(Provider):
    """``inner``, whose ``launch`` and ``terminate`` run only after ``store.sync()``
    committed everything decided so far under this daemon's fence (module docstring).
    ``describe``, ``spot_price`` and ``aclose`` pass through (reads: anyone may).

    Raises (launch, terminate): :class:`~daemon.ha.fence.Deposed` before the cloud is called.
    """

    def __init__(self, inner: Provider, store: EtcdStore) -> None:
        self.inner = inner
        self.store = store
        self.name = inner.name
        # the inner provider's traits: Provider's class defaults would answer them first
        # (__getattr__ only sees what normal lookup misses), and an AWS pool under HA would
        # then get no agent wheel, and its listing's lag would be taken for a loss
        for trait in ("installs_agent", "listing_lag_s", "idempotent_launch"):
            setattr(self, trait, getattr(inner, trait, getattr(Provider, trait)))

    def __getattr__(self, attr: str) -> Any:  # launch_spec_of, launch_facts, ...: the inner provider's
        return getattr(self.inner, attr)

    async def launch(self, offer, node):  # type: ignore[no-untyped-def]
        await self._gate()
        return await self.inner.launch(offer, node)

    async def terminate(self, instance_id: str) -> None:
        await self._gate()
        await self.inner.terminate(instance_id)

    async def _gate(self) -> None:
        await self.store.sync()
        if not self.store.fence.elector.may_act():
            raise Deposed(f"{self.store.fence.elector.name}'s lease ran out before the provider call")

    async def describe(self, tag: str):  # type: ignore[no-untyped-def]
        return await self.inner.describe(tag)

    async def spot_price(self, offer):  # type: ignore[no-untyped-def]
        return await self.inner.spot_price(offer)

    async def aclose(self) -> None:
        await self.inner.aclose()
