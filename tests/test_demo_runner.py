"""The outside runner's store keeping (daemon/interfaces/demo_runner.py) and its daemon
child's view of that store (daemon.controlnode.rendezvous.RunnerStore).

Under ``spotvisord demo`` with a chaos action that kills the daemon, the rendezvous store
is the runner's child, not the daemon's: the daemon's ``kill_store`` SIGKILLs it by the
pid the runner wrote, the runner starts it again (as the store unit's ``Restart=`` would)
after the event's ``restart_after_s`` and writes the new pid, and the daemon's wait for the
store ends once the new one listens. The store here is a plain listening process (what
the keeping needs of it: a pid and a port that accepts connections); the end-to-end cell
with the real store is tests/chaos/test_local_daemon_kill.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.ports import free_port
from daemon.controlnode.rendezvous import RunnerStore, read_pid, wait_until_listening, write_pid
from daemon.controlnode.store import Store
from daemon.interfaces import demo_runner
from daemon.interfaces.demo_runner import STORE_FAULTS, SqliteEventLog, _StoreKeeper, restart_for
from daemon.model import Event

_LISTEN = ("import socket, sys, time\n"
           "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
           "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8); time.sleep(600)\n")


class _Listener:
    """A stand-in for :class:`~daemon.controlnode.rendezvous.StoreProcess`: the same
    ``proc``, ``pid``, ``start``, ``kill`` and ``stop``, a process that only listens."""

    def __init__(self, port: int) -> None:
        self.host, self.port = "127.0.0.1", port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 30.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _LISTEN, str(self.port)])
        self.starts += 1
        if not wait_until_listening(self.host, self.port, timeout_s):
            raise RuntimeError("the listener did not listen")

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    stop = kill


def _chaos(seq: int, **data: object) -> Event:
    return Event(seq, 0.0, "chaos_injected", None, dict(data))


@given(st.lists(st.tuples(st.sampled_from(["kill_store", "kill_control_node", "kill_daemon", "partition_leader",
                                           "notice"]),
                          st.booleans()), max_size=8),
       st.sets(st.integers(0, 7)))
def test_the_store_is_restarted_for_the_newest_unhandled_store_kill_only(fired: list[tuple[str, bool]],
                                                                          handled: set[int]) -> None:
    stored = [_chaos(i + 1, index=i, action=a, skipped=skipped) for i, (a, skipped) in enumerate(fired)]
    want = [e for e in stored if e.data["action"] in STORE_FAULTS and not e.data["skipped"]
            and e.data["index"] not in handled]
    assert restart_for(stored, handled, STORE_FAULTS) == (want[-1] if want else None)
    daemon = restart_for(stored, handled)  # the faults that end the daemon
    assert daemon is None or daemon.data["action"] in ("kill_daemon", "kill_control_node", "partition_leader")
    killed = restart_for(stored, handled, ("kill_daemon", "kill_control_node"))  # what a SIGKILL is blamed on
    assert killed is None or killed.data["action"] != "partition_leader"


def test_a_pid_file_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    f = tmp_path / "rendezvous.pid"
    assert read_pid(f) is None  # no runner wrote it yet
    write_pid(f, 4242)
    assert read_pid(f) == 4242
    f.write_text("0\n")
    assert read_pid(f) is None
    f.write_text("42 junk")
    assert read_pid(f) is None


async def test_a_store_the_daemon_kills_is_restarted_by_the_runner_and_the_daemon_sees_the_new_one(
        tmp_path: Path) -> None:
    """The daemon's ``kill_store`` under the runner: the event is in the log before the kill,
    the runner starts the store again after the event's ``restart_after_s``, writes its pid,
    and the daemon's wait (:meth:`RunnerStore.start`) returns once it listens. A second kill
    finds the new store by the file, not the first pid."""
    port = free_port()
    store = _Listener(port)
    store.start()
    db, pid_file = tmp_path / "spotvisord.db", tmp_path / "rendezvous.pid"
    write_pid(pid_file, store.pid or 0)
    events = Store(db).open()
    said: list[str] = []
    keeper = _StoreKeeper(store, SqliteEventLog(db), pid_file, said.append)  # type: ignore[arg-type]
    keeping = asyncio.create_task(keeper.run())
    daemon_side = RunnerStore(pid_file, "127.0.0.1", port)
    try:
        for index in (4, 7):
            first = daemon_side.pid
            assert first is not None and first == store.pid
            events.append_event("chaos_injected", None, {"index": index, "action": "kill_store",
                                                        "restart_after_s": 0.2})
            await asyncio.to_thread(daemon_side.kill)
            await asyncio.to_thread(daemon_side.start, 20.0)
            assert daemon_side.pid not in (None, first)
            assert await keeper.back(index, 1.0)
            with pytest.raises(ProcessLookupError):
                os.kill(first, 0)  # the first store is gone, reaped by the runner
        assert store.starts == 3
        assert [line for line in said if "SIGKILLed by chaos" in line] == [
            "spotvisor demo: the rendezvous store was SIGKILLed by chaos #4; restarting it in 0.2 s",
            "spotvisor demo: the rendezvous store was SIGKILLed by chaos #7; restarting it in 0.2 s"]
    finally:
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
        store.stop()
        events.close()


async def test_a_store_that_dies_of_no_chaos_is_restarted_as_its_unit_would(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_runner, "STORE_RESTART_SEC_S", 0.1)
    port = free_port()
    store = _Listener(port)
    store.start()
    db, pid_file = tmp_path / "spotvisord.db", tmp_path / "rendezvous.pid"
    write_pid(pid_file, store.pid or 0)
    said: list[str] = []
    keeper = _StoreKeeper(store, SqliteEventLog(db), pid_file, said.append)  # type: ignore[arg-type]
    keeping = asyncio.create_task(keeper.run())
    try:
        first = store.pid
        assert first is not None
        os.kill(first, signal.SIGTERM)
        waiting = RunnerStore(pid_file, "127.0.0.1", port)
        waiting._killed = first  # as if this daemon had killed it
        await asyncio.to_thread(waiting.start, 20.0)
        assert read_pid(pid_file) == store.pid != first
        assert said == ["spotvisor demo: the rendezvous store exited (signal SIGTERM) and no chaos said so; "
                        "restarting it in 0.1 s"]
    finally:
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
        store.stop()


def test_the_daemon_says_when_the_runner_starts_no_new_store(tmp_path: Path) -> None:
    pid_file = tmp_path / "rendezvous.pid"
    write_pid(pid_file, 2 ** 22 + 1)  # no such process
    side = RunnerStore(pid_file, "127.0.0.1", free_port())
    side.kill()  # gone already: nothing to do
    with pytest.raises(RuntimeError, match=f"no new rendezvous store within 0.3 s .*{pid_file.name}"):
        side.start(0.3)


async def test_a_daemon_fault_waits_for_a_store_restart_in_flight() -> None:
    """Overdue events fire back to back (a restarted daemon catching up on its schedule): a
    kill_control_node 1 s after a kill_store found the store dead, killed nothing, and took
    the daemon that was to record the store's restart with it. A daemon fault now waits
    for the store restarts in flight, whose records come first."""
    from types import SimpleNamespace

    from daemon.config import ChaosEvent
    from daemon.model import JobState
    from daemon.providers import chaos

    recorded: list[dict] = []
    started = asyncio.Event()

    class Store:  # the rendezvous store: killed now, started again after its outage
        def kill(self) -> None:
            pass

        def start(self) -> None:
            started.set()

    sup = SimpleNamespace(
        store=SimpleNamespace(events=lambda **_: []), clock=lambda: 100.0, nodes={},
        job=SimpleNamespace(started_at=0.0, step=40, state=JobState.RUNNING, resumed_at=None, world_size=1),
        fleet=SimpleNamespace(provider=SimpleNamespace(publish_interruption=None, kill=None, name="stand-in")),
        record=lambda kind, node=None, **data: recorded.append(data))
    events = [ChaosEvent(action="kill_store", at_step=20, restart_after_s=0.2, wait_full_pool=False),
              ChaosEvent(action="kill_daemon", at_step=12, restart_after_s=2, wait_full_pool=False)]  # skipped: no runner
    await chaos.run_chaos(sup, events, tick_s=0.01, rendezvous=Store())  # type: ignore[arg-type]
    assert started.is_set()
    assert [(r["index"], r["action"]) for r in recorded] == [(0, "kill_store"), (0, "store_restarted"),
                                                               (1, "kill_daemon")]
