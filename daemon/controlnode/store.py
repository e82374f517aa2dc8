"""Durable state of one pool: the event log and the node table, in SQLite (WAL).

The event ``seq`` is SQLite's INTEGER PRIMARY KEY AUTOINCREMENT, so it is
monotonic across daemon restarts and never reused: ``spotctl events --since SEQ``
resumes exactly. Node rows are written through on every state change, with the
transition checked against :data:`daemon.control.lifecycle.NODE_TRANSITIONS`.

Calls are short local-disk transactions (well under a millisecond in WAL mode
with ``synchronous=NORMAL``); they run on the event loop's thread on purpose, so
that an event's ``seq`` order is the order the daemon decided things in. A part
that runs on a thread of its own (the feed, :mod:`daemon.feed.notify`) opens its own
connection with :meth:`Store.open_sibling`: WAL lets it read while the daemon writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import structlog

from daemon.model import Event, Node, NodeState, TrainerState, check_transition
from daemon.state_dir import check_private, chmod_private, open_private

__all__ = ["NotLeading", "Store"]

log = structlog.get_logger("spotvisor.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    node TEXT,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind);
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def _owner_only(path: Path) -> None:
    """Create ``path`` (empty: SQLite reads it as a new database) if it is missing, and make
    it and any SQLite files beside it 0600; none of them may be a symbolic link, a FIFO
    or another uid's (:mod:`daemon.state_dir`: SQLite would follow a link)."""
    if not check_private(path):
        os.close(open_private(path, os.O_RDWR | os.O_CREAT))
    for f in (path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal"))):
        if check_private(f):  # no descriptor opened and closed: that would drop this process's SQLite locks
            chmod_private(f, 0o600)


class NotLeading(Exception):
    """This daemon no longer leads its pool (HA, :mod:`daemon.ha`): what it decided is not
    durable where the next leader reads it, and nothing it decides may be acted on."""


class Store:
    """SQLite store. Construct, then :meth:`open`; :meth:`close` is idempotent.

    ``busy_timeout_s``: how long a write waits for another connection's write to the
    same file (seconds; sqlite3's default, 5)."""

    __slots__ = ("path", "busy_timeout_s", "_db", "_reported")

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 5.0) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self._db: sqlite3.Connection | None = None
        self._reported: set[int] = set()  # seqs of events whose data was not an object (logged once)

    @property
    def in_memory(self) -> bool:
        """The database is SQLite's ``:memory:`` one (private to its connection)."""
        return str(self.path) == ":memory:"

    def open(self) -> "Store":
        """Open (creating) the database. The file is made 0600 whatever the umask, and so
        are SQLite's ``-wal``/``-shm`` beside it (SQLite gives them the database's mode):
        it holds every node's agent token. Raises ``OSError``/``sqlite3.Error``;
        :class:`daemon.state_dir.UnsafeStatePath` (an ``OSError``) for a symbolic link,
        FIFO or another uid's file at any of them."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.in_memory:
            _owner_only(self.path)
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        self._db = db
        return self

    def open_sibling(self) -> "Store":
        """Another Store on the same database file with a connection of its own, opened;
        for another thread (a connection is used by one thread at a time). WAL lets it
        read while this one writes; its writes wait up to ``busy_timeout_s`` for this
        one's. Blocks for the open (a few local-disk reads). Close it on its thread.

        Raises:
            ValueError: the database is in memory (another connection would open
                another, empty database).
        """
        if self.in_memory:
            raise ValueError("an in-memory store (:memory:) has no second connection: use a database file")
        return Store(self.path, busy_timeout_s=self.busy_timeout_s).open()

    #: True where a write reaches the pool's next daemon only through this object (the HA
    #: store: etcd). A sibling connection's writes (:meth:`open_sibling`) then stay on this
    #: machine, and its reads may show events that are not durable yet (:meth:`durable_seq`).
    replicated = False

    def durable_seq(self) -> int | None:
        """The newest event seq that is durable where the pool's next daemon reads it;
        ``None``: every event is, as soon as it is recorded (SQLite, this machine's disk).
        Safe to call from any thread (the HA store answers from a counter)."""
        return None

    def on_durable(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the daemon's loop) each time :meth:`durable_seq` moves.
        SQLite: never (an event is durable when recorded; ``Supervisor.subscribe`` hears it)."""

    async def durable(self) -> None:
        """Return once every write made before this call is durable where the daemon that
        runs the pool next reads it; an agent is told to act (a start, an admission, a
        command) only after it (:mod:`daemon.interfaces.api`). SQLite commits each write
        as it is made, on this machine's disk: nothing to wait for. The HA store
        (:class:`daemon.ha.store.EtcdStore`) commits under its fence here.

        Raises:
            NotLeading: (HA) this daemon was deposed; nothing more may be acted on.
        """

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("Store is not open: call Store.open() first")
        return self._db

    # -- events -------------------------------------------------------------
    def append_event(self, kind: str, node: str | None = None, data: dict[str, Any] | None = None,
                     *, at: float | None = None) -> Event:
        t = time.time() if at is None else at
        body = dict(data or {})
        cur = self.db.execute(
            "INSERT INTO events(time, kind, node, data) VALUES (?, ?, ?, ?)",
            (t, kind, node, json.dumps(body, default=str)),
        )
        return Event(seq=int(cur.lastrowid), time=t, kind=kind, node=node, data=body)

    def events(self, *, since: int = 0, kinds: Iterable[str] | None = None, limit: int | None = None) -> list[Event]:
        """Events with ``seq > since``, oldest first; optionally only ``kinds``. Each event's
        ``data`` is a dict (:meth:`_data`). A ``since`` past SQLite's integers (2^63-1)
        matches nothing."""
        sql = "SELECT seq, time, kind, node, data FROM events WHERE seq > ?"
        args: list[Any] = [max(-(2**63), min(since, 2**63 - 1))]
        kinds = list(kinds or [])
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += kinds
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [Event(s, t, k, n, self._data(s, d)) for s, t, k, n, d in self.db.execute(sql, args)]

    def _data(self, seq: int, text: str) -> dict[str, Any]:
        """An event's stored data as the object every reader expects. What this daemon never
        writes (a JSON array or scalar, or no JSON: an older daemon's, a hand edit) is wrapped
        as ``{"value": ...}``, with one ``store_event_data_not_an_object`` log line per event
        and store, so no reader meets a list where it reads keys (the daemon starts)."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError):
            data = text
        if isinstance(data, dict):
            return data
        if seq not in self._reported:
            self._reported.add(seq)
            log.warning("store_event_data_not_an_object", seq=seq, type=type(data).__name__, data=repr(data)[:200])
        return {"value": data}

    def last_seq(self) -> int:
        row = self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()
        return int(row[0])

    # -- nodes --------------------------------------------------------------
    def put_node(self, node: Node) -> None:
        body = dataclasses.asdict(node)
        body["state"] = node.state.value
        body["trainer"] = TrainerState(node.trainer).value
        self.db.execute(
            "INSERT INTO nodes(id, body) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET body = excluded.body",
            (node.id, json.dumps(body)),
        )

    def set_node_state(self, node: Node, state: NodeState, *, detail: str = "") -> None:
        """Change a node's state, checking the transition table, and persist it.

        Raises:
            IllegalTransition: the table does not allow it (nothing is written).
        """
        check_transition(node.state, state)
        node.state = state
        if detail:
            node.detail = detail
        self.put_node(node)

    def nodes(self) -> list[Node]:
        out = [_node(body) for (body,) in self.db.execute("SELECT body FROM nodes")]
        return sorted(out, key=lambda n: n.ordinal)

    def node(self, node_id: str) -> Node | None:
        """One node's row (None: no such node). A primary-key lookup: the cost does not
        grow with the table, which keeps every node the pool ever had."""
        row = self.db.execute("SELECT body FROM nodes WHERE id = ?", (node_id,)).fetchone()
        return None if row is None else _node(row[0])

    # -- small values -------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set(self, key: str, value: Any) -> None:
        self.db.execute(
            "INSERT INTO kv(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )


def _node(body: str) -> Node:
    raw = json.loads(body)
    raw["state"] = NodeState(raw["state"])
    raw.pop("offer_index", None)  # rows written before nodes kept their offer's key (Node.offer_key)
    raw["trainer"] = TrainerState(raw.get("trainer", TrainerState.NOT_STARTED))
    return Node(**raw)
