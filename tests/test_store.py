"""Store: the SQLite event log, node table and kv, against a real file in tmp_path."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.model import EventKind, IllegalTransition, Node, NodeState, TrainerState
from daemon.controlnode.store import Store


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "spotvisord.db"  # parent does not exist yet: open() makes it


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(db_path).open()
    try:
        yield s
    finally:
        s.close()


def make_node(id: str = "n1", ordinal: int = 1, **kw) -> Node:
    fields = dict(
        id=id,
        ordinal=ordinal,
        provider="local",
        region="local",
        zone="local-a",
        instance_type="local.cpu",
        gpus=1,
        price_usd_h=0.0,
        token=f"tok-{id}",
        created_at=1000.0,
    )
    fields.update(kw)
    return Node(**fields)


def raw_node_body(path: Path, node_id: str) -> str | None:
    db = sqlite3.connect(path)
    try:
        row = db.execute("SELECT body FROM nodes WHERE id = ?", (node_id,)).fetchone()
    finally:
        db.close()
    return None if row is None else row[0]


# --------------------------------------------------------------------------- lifetime


def test_constructor_does_no_io(db_path: Path) -> None:
    Store(db_path)
    assert not db_path.parent.exists()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.append_event("x"),
        lambda s: s.events(),
        lambda s: s.last_seq(),
        lambda s: s.put_node(make_node()),
        lambda s: s.nodes(),
        lambda s: s.get("k"),
        lambda s: s.set("k", 1),
    ],
    ids=["append_event", "events", "last_seq", "put_node", "nodes", "get", "set"],
)
def test_use_before_open_raises_clear_error(db_path: Path, call) -> None:
    s = Store(db_path)
    with pytest.raises(RuntimeError, match=r"not open.*Store\.open\(\)"):
        call(s)


def test_use_after_close_raises_and_close_is_idempotent(db_path: Path) -> None:
    s = Store(db_path)
    s.close()  # before open: fine
    s.open()
    s.append_event("x")
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="Store.open"):
        s.events()


def test_wal_mode_is_on(store: Store, db_path: Path) -> None:
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # persistent: a fresh connection that never asked for WAL sees it too
    other = sqlite3.connect(db_path)
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        other.close()


# --------------------------------------------------------------------------- events


def test_event_seq_starts_at_one_and_is_monotonic(store: Store) -> None:
    assert store.last_seq() == 0
    seqs = [store.append_event("k", at=float(i)).seq for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5]
    assert store.last_seq() == 5


def test_event_seq_continues_across_reopen_never_reused(db_path: Path) -> None:
    s = Store(db_path).open()
    assert [s.append_event("a").seq for _ in range(3)] == [1, 2, 3]
    s.close()

    s = Store(db_path).open()
    assert s.last_seq() == 3
    assert s.append_event("b").seq == 4
    # even if the newest rows vanish, their numbers are not handed out again
    s.db.execute("DELETE FROM events WHERE seq >= 3")
    s.close()

    s = Store(db_path).open()
    try:
        assert s.append_event("c").seq == 5
        assert [e.seq for e in s.events()] == [1, 2, 5]
    finally:
        s.close()


def test_event_round_trip(store: Store) -> None:
    ev = store.append_event("node_lost", "n7", {"reason": "heartbeat_lost", "step": 42, "ranks": [0, 1]}, at=123.5)
    assert (ev.seq, ev.time, ev.kind, ev.node) == (1, 123.5, "node_lost", "n7")
    [back] = store.events()
    assert back == ev
    assert back.to_dict() == {
        "seq": 1,
        "time": 123.5,
        "kind": "node_lost",
        "node": "n7",
        "data": {"reason": "heartbeat_lost", "step": 42, "ranks": [0, 1]},
    }


def test_event_data_is_copied_not_aliased(store: Store) -> None:
    data = {"a": 1}
    ev = store.append_event("k", data=data)
    data["a"] = 2
    assert ev.data == {"a": 1}
    assert store.events()[0].data == {"a": 1}


def test_event_without_data_or_node(store: Store) -> None:
    store.append_event("pool_released")
    [ev] = store.events()
    assert ev.node is None and ev.data == {}


@pytest.fixture
def five_events(store: Store) -> Store:
    for kind in ["a", "b", "a", "c", "b"]:  # seq 1..5
        store.append_event(kind)
    return store


@pytest.mark.parametrize(
    ("kwargs", "seqs"),
    [
        ({}, [1, 2, 3, 4, 5]),
        ({"since": 0}, [1, 2, 3, 4, 5]),
        ({"since": 2}, [3, 4, 5]),
        ({"since": 5}, []),
        ({"since": 99}, []),
        ({"kinds": ["a"]}, [1, 3]),
        ({"kinds": ["a", "c"]}, [1, 3, 4]),
        ({"kinds": ["zzz"]}, []),
        ({"kinds": []}, [1, 2, 3, 4, 5]),
        ({"kinds": None}, [1, 2, 3, 4, 5]),
        ({"since": 1, "kinds": ["a", "b"]}, [2, 3, 5]),
        ({"since": 1, "kinds": ("b",), "limit": 1}, [2]),
        ({"limit": 2}, [1, 2]),
    ],
)
def test_events_filters(five_events: Store, kwargs: dict, seqs: list[int]) -> None:
    assert [e.seq for e in five_events.events(**kwargs)] == seqs


def test_events_kinds_accepts_enum_members(store: Store) -> None:
    store.append_event(EventKind.NODE_LOST.value, "n1")
    store.append_event(EventKind.NODE_READY.value, "n2")
    got = store.events(kinds=[EventKind.NODE_READY])
    assert [(e.seq, e.kind, e.node) for e in got] == [(2, "node_ready", "n2")]


def test_events_kinds_generator_is_consumed_once(five_events: Store) -> None:
    assert [e.seq for e in five_events.events(kinds=(k for k in ["c"]))] == [4]


# --------------------------------------------------------------------------- nodes


def test_node_round_trip_all_fields_across_reopen(db_path: Path) -> None:
    n = make_node(
        "n2",
        ordinal=2,
        market="on_demand",
        zone=None,
        gpus=8,
        price_usd_h=12.34,
        state=NodeState.DRAINING,
        instance_id="i-0abc",
        created_at=1700000000.125,
        ready_at=1700000030.5,
        last_heartbeat=1700000099.75,
        deadline=1700000120.0,
        step=77,
        detail="interruption notice",
    )
    s = Store(db_path).open()
    s.put_node(n)
    s.close()
    s = Store(db_path).open()
    try:
        [back] = s.nodes()
    finally:
        s.close()
    assert back == n
    assert back.state is NodeState.DRAINING


def test_a_row_written_before_offer_keys_loads_with_its_offer_key(store: Store) -> None:
    # rows of an older daemon carry the offer's position in config.offers; a node's offer
    # is now named by its own fields (provider/region/zone/type/market), never by position
    n = make_node(trainer=TrainerState.RUNNING)
    body = dataclasses.asdict(n) | {"state": n.state.value, "offer_index": 3}
    body.pop("market")
    store.db.execute("INSERT INTO nodes(id, body) VALUES (?, ?)", (n.id, json.dumps(body)))
    [back] = store.nodes()
    assert back == n and back.offer_key == "local/local/local-a/local.cpu/spot"
    assert back.trainer is TrainerState.RUNNING


def test_put_node_upserts(store: Store) -> None:
    n = make_node()
    store.put_node(n)
    n.step = 10
    n.last_heartbeat = 2000.0
    store.put_node(n)
    assert store.nodes() == [n]


def test_nodes_sorted_by_ordinal(store: Store) -> None:
    for id, ordinal in [("c", 3), ("a", 1), ("b", 2)]:
        store.put_node(make_node(id, ordinal))
    assert [n.id for n in store.nodes()] == ["a", "b", "c"]


def test_node_by_id(store: Store) -> None:
    for id, ordinal in [("a", 1), ("b", 2)]:
        store.put_node(make_node(id, ordinal, state=NodeState.RUNNING))
    back = store.node("b")
    assert back == store.nodes()[1] and back.state is NodeState.RUNNING
    assert store.node("zz") is None


def test_set_node_state_legal_path_persists(store: Store, db_path: Path) -> None:
    n = make_node()
    store.put_node(n)
    for state in [NodeState.LAUNCHING, NodeState.READY, NodeState.RUNNING, NodeState.DRAINING]:
        store.set_node_state(n, state)
    store.set_node_state(n, NodeState.TERMINATED, detail="drained")
    assert n.state is NodeState.TERMINATED and n.detail == "drained"
    [back] = store.nodes()
    assert (back.state, back.detail) == (NodeState.TERMINATED, "drained")


def test_set_node_state_same_state_is_noop_and_keeps_detail(store: Store) -> None:
    n = make_node(state=NodeState.RUNNING, detail="joined")
    store.put_node(n)
    store.set_node_state(n, NodeState.RUNNING)
    assert store.nodes()[0].detail == "joined"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (NodeState.TERMINATED, NodeState.RUNNING),
        (NodeState.LOST, NodeState.READY),
        (NodeState.FAILED, NodeState.LAUNCHING),
        (NodeState.DRAINING, NodeState.RUNNING),
        (NodeState.REQUESTED, NodeState.RUNNING),
        (NodeState.RUNNING, NodeState.FAILED),
    ],
)
def test_set_node_state_refuses_illegal_and_writes_nothing(
    store: Store, db_path: Path, old: NodeState, new: NodeState
) -> None:
    n = make_node(state=old, detail="before")
    store.put_node(n)
    body_before = raw_node_body(db_path, n.id)
    seq_before = store.last_seq()

    with pytest.raises(IllegalTransition, match=f"{old.value} → {new.value}"):
        store.set_node_state(n, new, detail="after")

    assert raw_node_body(db_path, n.id) == body_before
    assert (n.state, n.detail) == (old, "before")  # the caller's object is untouched too
    assert store.last_seq() == seq_before
    assert store.nodes()[0].state is old


# --------------------------------------------------------------------------- kv


def test_kv_get_set(store: Store) -> None:
    assert store.get("missing") is None
    assert store.get("missing", 7) == 7
    store.set("job", {"step": 3, "world": [0, 1]})
    assert store.get("job") == {"step": 3, "world": [0, 1]}
    store.set("job", {"step": 4})
    assert store.get("job") == {"step": 4}
    store.set("zero", 0)
    assert store.get("zero", 99) == 0  # a stored falsy value is not "missing"
    store.set("none", None)
    assert store.get("none", "default") is None


def test_kv_persists_across_reopen(db_path: Path) -> None:
    s = Store(db_path).open()
    s.set("released", True)
    s.close()
    s = Store(db_path).open()
    try:
        assert s.get("released") is True
    finally:
        s.close()
