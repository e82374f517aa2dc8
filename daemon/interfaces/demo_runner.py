"""``spotvisord demo`` as an outside runner, for the chaos that kills the daemon.

When a demo's chaos schedule holds ``kill_daemon``, ``kill_control_node`` or
``partition_leader`` (:data:`daemon.config.DAEMON_FAULTS`), the daemon cannot run inside
the demo's process: it must die by a real SIGKILL (or stop, cut off) and come back on the
same state, as ``systemd``'s ``Restart=`` brings back ``spotvisord.service``. The demo then
plays the control node's service manager:

1. It starts the rendezvous store (its child, as in every demo) and the daemon as a child
   process, the real service (``spotvisord run --config FILE`` on the demo's run directory,
   with a fixed agent port, so the nodes find the restarted daemon where they left it).
2. It holds the write end of the local instances' lifeline and passes the daemon the read
   end (:data:`daemon.providers.local_instance.LIFELINE_FD_ENV`): the instances end when
   this runner ends, not when the daemon dies, and a restarted daemon adopts them.
3. When the daemon dies by SIGKILL, it reads the daemon's event log for the
   ``chaos_injected`` that said so (:func:`restart_for`), waits its ``restart_after_s`` (for
   ``kill_control_node``, until the store is back too) and starts the daemon again. Any
   other end of the daemon ends the demo (exit 1).
4. It keeps the store as ``spotvisor-rendezvous.service``'s ``Restart=always`` would
   (:class:`_StoreKeeper`): when the store dies (the daemon's ``kill_store`` or
   ``kill_control_node`` SIGKILLed it), it starts it again, empty, on the same port, after
   the ``restart_after_s`` of the chaos that killed it (2 s, the unit's ``RestartSec=``, when
   none did), and writes each store's pid to ``rendezvous.pid`` in the state directory,
   the file the daemon finds through :data:`STORE_PID_FILE_ENV`
   (:class:`daemon.controlnode.rendezvous.RunnerStore`).
5. It prints the event log as it grows, and returns the log once the daemon exits 0 (the
   job completed and the pool is released) for the demo's summary. With ``ha:`` the log is
   read where the pool keeps it, in etcd (:class:`EtcdEventLog`).
6. ``partition_leader`` (``ha:``): the daemon reaches etcd through the runner's forwarders
   (:class:`daemon.ha.partition.Partition`, given as ``--etcd-endpoints``); once the
   runner reads the event in etcd it cuts them for the event's ``restart_after_s``
   (:class:`_PartitionKeeper`). The daemon, unable to renew its lease, exits 1; the
   runner waits until the partition has lasted its time, heals it and starts the daemon
   again (``Restart=on-failure``). A SIGKILL is blamed on ``kill_daemon`` or
   ``kill_control_node`` only, an exit 1 on ``partition_leader`` only.

Without those actions ``spotvisord demo`` runs the daemon in its own process, as ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import sys
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import structlog

from daemon.config import DAEMON_FAULTS, Config
from daemon.controlnode.rendezvous import write_pid
from daemon.model import Event, EventKind
from daemon.providers.local_instance import LIFELINE_FD_ENV, STORE_PID_FILE_ENV
from daemon.state_dir import open_private, prepare_state_dir

if TYPE_CHECKING:
    from daemon.controlnode.rendezvous import StoreProcess

__all__ = ["needs_runner", "restart_for", "run_outside", "with_fixed_agent_port"]

log = structlog.get_logger("spotvisor.demo")

#: seconds between two reads of the event log (what the demo prints, and how soon), and
#: between two looks at the store
TAIL_EVERY_S = 0.5
#: the chaos actions that kill the rendezvous store (the runner restarts it)
STORE_FAULTS = ("kill_store", "kill_control_node")
#: seconds before a store that died of no chaos is started again (the unit's RestartSec=)
STORE_RESTART_SEC_S = 2.0
#: seconds a daemon's restart after ``kill_control_node`` waits for the store beyond the outage
STORE_BACK_WAIT_S = 30.0


def needs_runner(config: Config) -> bool:
    """Whether the demo's chaos kills the daemon (it then runs as this runner's child)."""
    return any(ev.action in DAEMON_FAULTS for ev in config.chaos)


def restart_for(stored: Iterable[Event], handled: set[int],
                actions: Iterable[str] = DAEMON_FAULTS) -> Event | None:
    """The ``chaos_injected`` of a kill (one of ``actions``: the daemon's by default,
    :data:`STORE_FAULTS` for the store's) not handled yet (the newest), or None: a process
    that died without one is not the chaos's doing. Pure."""
    actions = set(actions)
    found = None
    for ev in stored:
        if (ev.kind == EventKind.CHAOS_INJECTED.value and ev.data.get("action") in actions
                and not ev.data.get("skipped") and ev.data.get("index") not in handled):
            found = ev
    return found


def with_fixed_agent_port(config: Config) -> Config:
    """``config`` with a fixed ``daemon.agent_port`` (one outside the kernel's ephemeral
    range, free now) when it has 0: a restarted daemon must listen where its nodes call."""
    if config.daemon.agent_port:
        return config
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(20000, max(20001, low))
        with socket.socket() as s:
            try:
                s.bind((config.daemon.agent_host, port))
            except OSError:
                continue
        return config.model_copy(update={"daemon": config.daemon.model_copy(update={"agent_port": port})})
    raise RuntimeError("no free port for the daemon's agent API; set daemon.agent_port")


def read_events(db: Path, since: int = 0) -> list[Event]:
    """The daemon's events after ``since``, read-only (the daemon may be writing)."""
    if not db.exists():
        return []
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
            rows = conn.execute("SELECT seq, time, kind, node, data FROM events WHERE seq > ? ORDER BY seq",
                                (since,)).fetchall()
    except sqlite3.Error as exc:  # not made yet, or busy: the next read
        log.debug("demo_events_unreadable", error=str(exc))
        return []
    out = []
    for seq, t, kind, node, data in rows:
        try:
            body = json.loads(data)
        except ValueError:
            body = {"value": data}
        out.append(Event(seq, t, kind, node, body if isinstance(body, dict) else {"value": body}))
    return out


class SqliteEventLog:
    """The events of a daemon whose store is its state directory's SQLite file."""

    def __init__(self, db: Path) -> None:
        self.db = db

    async def read(self, since: int = 0) -> list[Event]:
        return await asyncio.to_thread(read_events, self.db, since)

    async def aclose(self) -> None:
        return None


class EtcdEventLog:
    """The events of a pool whose daemons keep its state in etcd (``ha:``), read where a
    new leader reads them (``/spotvisor/<pool>/events/<seq>``, :mod:`daemon.ha.store`),
    on the real endpoints: a partition the runner holds does not hide them from it."""

    PAGE = 500  # keys a read asks for at once

    def __init__(self, spec: Any, pool: str) -> None:
        from daemon.ha.elector import pool_prefix
        from daemon.ha.leading import client_for

        self.client = client_for(spec)
        self.prefix = pool_prefix(pool) + b"events/"

    async def read(self, since: int = 0) -> list[Event]:
        """The events after ``since``, in order; what was read so far when etcd stops
        answering (logged at debug: the next read tries again)."""
        from aetcd.utils import prefix_range_end

        out: list[Event] = []
        start, end = self.prefix + f"{since + 1:020d}".encode(), prefix_range_end(self.prefix)
        try:
            while True:
                page = await self.client.range_page(start, end, limit=self.PAGE)
                for kv in page.kvs:
                    body = json.loads(kv.value)
                    data = body.get("data")
                    out.append(Event(int(kv.key[len(self.prefix):]), float(body["time"]), str(body["kind"]),
                                     body.get("node"), data if isinstance(data, dict) else {"value": data}))
                if not page.more or not page.kvs:
                    return out
                start = page.kvs[-1].key + b"\0"
        except Exception as exc:  # noqa: BLE001 - etcd out of reach (or a key we cannot parse): next read
            log.debug("demo_events_unreadable", error=str(exc)[:200])
            return out

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.close()


def gave_up(ev: Event) -> bool:
    """Whether ``ev`` says the job ended without completing and its pool is released (it
    failed, or ``spotctl down`` cancelled it): a demo ends there, exit 1. The daemon itself
    stays up (``spotctl relaunch`` or ``up`` may start the job again); a demo has no one to
    ask it."""
    return ev.kind == EventKind.POOL_RELEASED.value and ev.data.get("reason") in ("job_failed", "job_cancelled")


def _show(events: list[Event], line: Callable[[Event], None], seen: list[int]) -> None:
    """Print the events after ``seen[0]``, the last seq printed, and move it on."""
    for ev in events:
        if ev.seq > seen[0]:
            seen[0] = ev.seq
            line(ev)


async def _tail(events: "SqliteEventLog | EtcdEventLog", line: Callable[[Event], None], seen: list[int],
                partition: "_PartitionKeeper | None") -> None:
    while True:
        new = await events.read(seen[0])
        if partition is not None:
            partition.saw(new)
        _show(new, line, seen)
        await asyncio.sleep(TAIL_EVERY_S)  # a polling period, not synchronisation


class _PartitionKeeper:
    """The ``partition_leader`` fault (the module docstring, 6): the daemon reaches etcd
    through ``partition`` (a :class:`daemon.ha.partition.Partition`); once an event is
    read (:meth:`saw`), the partition is cut and a timer heals it ``restart_after_s``
    later; :meth:`healed` waits for that heal (the runner, before it starts the daemon
    again)."""

    def __init__(self, partition: Any, out: Callable[[str], None]) -> None:
        self.partition, self.out = partition, out
        self._healed: dict[int, asyncio.Event] = {}  # chaos index → set once its partition healed
        self._timers: list[asyncio.TimerHandle] = []

    def saw(self, events: list[Event]) -> None:
        for ev in events:
            if (ev.kind == EventKind.CHAOS_INJECTED.value and ev.data.get("action") == "partition_leader"
                    and not ev.data.get("skipped") and ev.data.get("index") not in self._healed):
                index, for_s = ev.data.get("index"), float(ev.data.get("restart_after_s") or 0.0)
                healed = self._healed[index] = asyncio.Event()
                self.partition.cut()
                self._timers.append(asyncio.get_running_loop().call_later(for_s, self._heal, healed))
                self.out(f"spotvisor demo: chaos #{index} cut the leading daemon off from etcd for {for_s:g} s")

    def _heal(self, healed: asyncio.Event) -> None:
        self.partition.heal()
        healed.set()

    async def healed(self, index: int) -> None:
        """Wait until the partition of chaos ``index`` (cut by :meth:`saw`) has healed."""
        await self._healed[index].wait()

    async def aclose(self) -> None:
        for t in self._timers:
            t.cancel()
        await self.partition.close()


class _StoreKeeper:
    """The store's service manager while the daemon is this runner's child (the module
    docstring, 4): :meth:`run` looks at the store every :data:`TAIL_EVERY_S` and starts it
    again once it died; :meth:`back` waits for the restart after a given chaos event."""

    def __init__(self, store: "StoreProcess", events: "SqliteEventLog | EtcdEventLog", pid_file: Path,
                 out: Callable[[str], None]) -> None:
        self.store, self.events, self.pid_file, self.out = store, events, pid_file, out
        self.restarted: set[int] = set()  # the chaos indices whose kill was answered by a restart
        self._changed = asyncio.Event()

    async def run(self) -> None:
        handled: set[int] = set()
        while True:
            await asyncio.sleep(TAIL_EVERY_S)  # a polling period, not synchronisation
            proc = self.store.proc
            if proc is None or proc.poll() is None:
                continue
            rc = proc.returncode
            await asyncio.to_thread(self.store.kill)  # reaps it, closes its pipes
            fault = restart_for(await self.events.read(), handled, STORE_FAULTS)
            if fault is not None:
                handled.add(fault.data["index"])
                wait_s = float(fault.data.get("restart_after_s") or 0.0)
                self.out(f"spotvisor demo: the rendezvous store was SIGKILLed by chaos #{fault.data['index']}; "
                         f"restarting it in {wait_s:g} s")
            else:
                wait_s = STORE_RESTART_SEC_S
                self.out(f"spotvisor demo: the rendezvous store exited ({_how(rc or 0)}) and no chaos said so; "
                         f"restarting it in {wait_s:g} s")
            await asyncio.sleep(wait_s)  # the outage itself, as Restart= and RestartSec= give it
            try:
                await asyncio.to_thread(self.store.start)  # empty, on the same port
            except RuntimeError as exc:  # the daemon's kill_store records store_restart_failed
                self.out(f"spotvisor demo: {exc}")
                return
            await asyncio.to_thread(write_pid, self.pid_file, self.store.pid or 0)
            if fault is not None:
                self.restarted.add(fault.data["index"])
                self._changed.set()

    async def back(self, index: int, timeout_s: float) -> bool:
        """Whether the store killed by chaos ``index`` was started again within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                while index not in self.restarted:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True


def _child_argv(config: Config, config_path: str, etcd: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", config_path,
            "--state-dir", str(config.daemon.state_path()), "--socket", str(config.daemon.socket_path()),
            "--agent-port", str(config.daemon.agent_port), "--rendezvous-port", str(config.rendezvous.port),
            *(["--etcd-endpoints", ",".join(etcd)] if etcd else [])]


def _partitioned(config: Config) -> bool:
    return config.ha is not None and any(ev.action == "partition_leader" for ev in config.chaos)


async def run_outside(config: Config, config_path: str, *, store: "StoreProcess", timeout_s: float,
                      out: Callable[[str], None], line: Callable[[Event], None]) -> tuple[int, list[Event]]:
    """Run the daemon as a child until the job completes, restarting it after each chaos
    kill (the module docstring). ``store``: the first domain's rendezvous store, started.
    ``config``: the demo's, on its run directory, with a fixed agent port
    (:func:`with_fixed_agent_port`). Returns (0, every event) once the daemon exited 0; (1,
    the events so far) on a timeout or a daemon that ended otherwise. Ending (a return,
    an error, a cancel) stops the daemon and closes the lifeline: every instance ends."""
    state = prepare_state_dir(config.daemon.state_path())
    db, log_path, pid_file = state / "spotvisord.db", state / "daemon.log", state / "rendezvous.pid"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    events: SqliteEventLog | EtcdEventLog = (EtcdEventLog(config.ha, config.pool.name) if config.ha is not None
                                             else SqliteEventLog(db))
    partition: _PartitionKeeper | None = None
    lifeline_r, lifeline_w = os.pipe()  # both close-on-exec: the daemon gets the read end by pass_fds
    seen = [0]
    tasks: list[asyncio.Task[None]] = []
    handled: set[int] = set()
    proc: asyncio.subprocess.Process | None = None
    ended = asyncio.Event()  # the job failed or was cancelled, its pool released (gave_up)

    def show(ev: Event) -> None:
        line(ev)
        if gave_up(ev):
            ended.set()

    try:
        if _partitioned(config):
            from daemon.ha.partition import Partition

            assert config.ha is not None
            partition = _PartitionKeeper(await Partition(config.ha.endpoints).start(), out)
        write_pid(pid_file, store.pid or 0)
        keeper = _StoreKeeper(store, events, pid_file, out)
        tasks += [asyncio.create_task(_tail(events, show, seen, partition), name="demo:tail"),
                  asyncio.create_task(keeper.run(), name="demo:store")]
        while True:
            env = {**os.environ, LIFELINE_FD_ENV: str(lifeline_r), STORE_PID_FILE_ENV: str(pid_file)}
            argv = _child_argv(config, config_path, partition.partition.endpoints if partition else None)
            with os.fdopen(open_private(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT, pass_fds=(lifeline_r,), env=env)
            exited = asyncio.create_task(proc.wait(), name="demo:daemon")
            gone = asyncio.create_task(ended.wait(), name="demo:ended")
            try:
                await asyncio.wait([exited, gone], timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not exited.done():
                exited.cancel()
                if ended.is_set():  # the daemon stays up for a relaunch: stopped below (finally)
                    out(f"spotvisor demo: the job ended without completing (the lines above say why); see {log_path}")
                else:
                    out(f"spotvisor demo: the job did not complete within {timeout_s:g} s; see {log_path}")
                return 1, await events.read()
            rc = exited.result()
            if rc == 0:
                break
            stored = await events.read()
            if partition is not None:
                partition.saw(stored)
            _show(stored, show, seen)  # the daemon's last events before what we say of its end
            fault = None
            if rc == -signal.SIGKILL:
                fault = restart_for(stored, handled, ("kill_daemon", "kill_control_node"))
            elif rc == 1 and partition is not None:  # deposed by the cut: it stopped fail closed
                fault = restart_for(stored, handled, ("partition_leader",))
            if fault is None:
                out(f"spotvisor demo: the daemon exited ({_how(rc)}) and no chaos said so; see {log_path}")
                return 1, await events.read()
            handled.add(fault.data["index"])
            wait_s = float(fault.data.get("restart_after_s") or 0.0)
            if fault.data.get("action") == "partition_leader":
                assert partition is not None
                out(f"spotvisor demo: the daemon (pid {proc.pid}) stopped, cut off from etcd by chaos "
                    f"#{fault.data['index']}; restarting it once the partition heals")
                await partition.healed(fault.data["index"])  # saw() read the event that cut it
                continue
            control_node = fault.data.get("action") == "kill_control_node"
            out(f"spotvisor demo: the daemon (pid {proc.pid}) was SIGKILLed by chaos #{fault.data['index']}"
                f"{' with the rendezvous store' if control_node else ''}; restarting in {wait_s:g} s")
            await asyncio.sleep(wait_s)  # the outage itself, as Restart= and RestartSec= give it
            if control_node and not await keeper.back(fault.data["index"], STORE_BACK_WAIT_S):
                out(f"spotvisor demo: the rendezvous store is not back {STORE_BACK_WAIT_S:g} s after the outage; "
                    "starting the daemon without it")
        done = await events.read()
        _show(done, show, seen)  # what the tail had not printed yet
        return 0, done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if proc is not None and proc.returncode is None:
            await _stop(proc)
        os.close(lifeline_w)  # the instances' inits see the end of the pipe: whatever is left ends
        os.close(lifeline_r)
        if partition is not None:
            await partition.aclose()
        await events.aclose()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the daemon, SIGKILL after 10 s."""
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def _how(rc: int) -> str:
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
