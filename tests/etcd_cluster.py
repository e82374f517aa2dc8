"""A real 3-member etcd v3 cluster on 127.0.0.1, for the HA tests (tests/test_ha*.py).

The server is Debian's ``etcd-server`` package (3.4.x; ``/usr/bin/etcd``). Each member
gets two free ports (:func:`bench.ports.free_port`: client and peer) and a data
directory under the test's ``tmp_path``; every URL is ``http://127.0.0.1:PORT``, so
nothing listens beyond loopback (a production cluster needs TLS and client
certificates: ``--client-cert-auth``, ``--trusted-ca-file``, ``--peer-client-cert-auth``).

Readiness is observed, never slept for: :meth:`EtcdCluster.wait_healthy` polls each
member's ``GET /health`` (``{"health":"true"}`` once the member has a leader and can
serve a quorum read; etcd's docs, "Monitoring etcd": https://etcd.io/docs/v3.4/op-guide/monitoring/)
until a deadline, and raises with the member's stderr tail when it passes.

Members run at a raised CPU priority (nice -10, where the tests run as root, as CI does):
on 2 cores shared with three test workers' nodes, an etcd at the default priority missed
its own raft heartbeats ("leader failed to send out heartbeat on time") and answered a
leader's keepalive after 1.3 s, a third of a 4 s lease's margin, which the HA tests are not
about. A production member is given its own host, or a high priority beside others (etcd's
tuning guide, https://etcd.io/docs/v3.5/tuning/: disk priority with ``ionice``).

A missing binary fails the test (never a skip) with the command that installs it:
``apt-get install -y etcd-server`` (``make test-deps`` runs it).

Members never outlive the test process, however it ends (pytest SIGKILLed included):

- each member asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
  man 2 prctl, set in the child between fork and exec); Linux counts the *thread* that
  forked as the parent, so start and restart members from the main thread or a long-lived
  one (asyncio's default executor's threads, which ``asyncio.to_thread`` uses, live as long
  as their loop);
- each member carries its owner in its environment (``SPOTVISOR_ETCD_OWNER=<pid>:<start
  time>``, the start time from ``/proc/<pid>/stat`` so a reused pid is no owner), and every
  new :class:`EtcdCluster` first kills the members whose owner is gone
  (:func:`sweep_orphans`): what the first guard missed (a member forked by a thread that
  ended, a kernel without the call) goes at the next test that starts a cluster.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from bench.ports import free_port

__all__ = ["ETCD_BIN", "EtcdCluster", "EtcdMember", "etcd_binary", "etcd_cluster", "sweep_orphans"]

ETCD_BIN = os.environ.get("SPOTVISOR_ETCD_BIN", "/usr/bin/etcd")
INSTALL_HINT = "etcd is missing: install Debian's server with `apt-get install -y etcd-server` (or `make test-deps`)"


OWNER_ENV = "SPOTVISOR_ETCD_OWNER"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (the process's start, in clock ticks since boot);
    None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields after "pid (comm)" start at field 3


def _owner_token(pid: int) -> str:
    return f"{pid}:{_start_time(pid)}"


def _owner_alive(token: str) -> bool:
    pid, _, started = token.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == started


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it


#: the members' nice increment (negative: before the tests' own processes; root only)
MEMBER_NICE = -10


def _die_with(parent: int):  # type: ignore[no-untyped-def]
    """The ``preexec_fn`` that makes the child die with ``parent`` (the pid forking it)."""
    def preexec() -> None:  # pragma: no cover  (runs in the child, between fork and exec)
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody would signal us
            os._exit(1)
        with contextlib.suppress(OSError):  # raised priority (module docstring): root only
            os.nice(MEMBER_NICE)
    return preexec


def sweep_orphans() -> list[int]:
    """SIGKILL every etcd member started by this module whose owner process is gone (its
    ``SPOTVISOR_ETCD_OWNER`` names a pid that ended, or now another process); the pids
    killed. Processes of other users, and members of a live test process (another
    pytest-xdist worker's), are left alone."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.path.basename((proc / "cmdline").read_bytes().split(b"\0", 1)[0]) != b"etcd":
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        token = next((e[len(OWNER_ENV) + 1:].decode() for e in env if e.startswith(OWNER_ENV.encode() + b"=")), None)
        if token is None or _owner_alive(token):
            continue
        try:
            os.kill(int(proc.name), signal.SIGKILL)
            killed.append(int(proc.name))
        except OSError:
            continue
    return killed


def etcd_binary() -> str:
    """The etcd server binary's path. Fails the calling test (``pytest.fail``, not a skip)
    with the install command when it is missing."""
    path = ETCD_BIN if os.access(ETCD_BIN, os.X_OK) else shutil.which("etcd")
    if not path:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return path


@dataclass
class EtcdMember:
    """One member: its name, ports (client, peer), data dir and process (None: stopped)."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: the form a gRPC client takes."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """``GET /health`` says ``"health": "true"`` (the member has a leader and a quorum)."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout_s) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class EtcdCluster:
    """``size`` members on loopback. :meth:`start` launches them all and waits for health;
    :meth:`stop` (idempotent) terminates every member still running.

    ``heartbeat_ms``/``election_ms`` are etcd's ``--heartbeat-interval`` and
    ``--election-timeout`` (defaults 100 and 1000: etcd's own)."""

    def __init__(self, root: Path, *, size: int = 3, heartbeat_ms: int = 100, election_ms: int = 1000,
                 token: str = "spotvisor-test") -> None:
        self.binary = etcd_binary()
        sweep_orphans()  # a killed test process's members (module docstring)
        self.root = root
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.token = token
        self.members = [
            EtcdMember(name=f"m{i}", client_port=free_port(), peer_port=free_port(),
                       data_dir=root / f"m{i}.etcd", log_path=root / f"m{i}.log")
            for i in range(size)
        ]

    @property
    def endpoints(self) -> list[str]:
        """Every member's ``127.0.0.1:PORT`` (also the stopped ones: a client skips those)."""
        return [m.endpoint for m in self.members]

    def _argv(self, m: EtcdMember) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        return [
            self.binary, "--name", m.name, "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial, "--initial-cluster-state", "new",
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
            "--logger", "zap", "--log-level", "warn",
        ]

    def _spawn(self, m: EtcdMember) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(self._argv(m), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, OWNER_ENV: _owner_token(os.getpid())},
                                      preexec_fn=_die_with(os.getpid()))

    def start(self, *, timeout_s: float = 30.0) -> "EtcdCluster":
        for m in self.members:
            self._spawn(m)
        self.wait_healthy(timeout_s=timeout_s)
        return self

    def wait_healthy(self, members: list[EtcdMember] | None = None, *, timeout_s: float = 30.0) -> None:
        """Poll ``/health`` of ``members`` (default: every running one) until all say true.

        Raises:
            RuntimeError: the deadline passed, or a member exited; with its log's tail.
        """
        todo = list(members if members is not None else [m for m in self.members if m.running])
        deadline = time.monotonic() + timeout_s
        while todo:
            m = todo[0]
            if m.proc is not None and m.proc.poll() is not None:
                raise RuntimeError(f"etcd member {m.name} exited with {m.proc.returncode}:\n{m.log_tail()}")
            if m.healthy(timeout_s=1.0):
                todo.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {m.name} not healthy within {timeout_s} s:\n{m.log_tail()}")
            time.sleep(0.05)  # a poll interval inside a deadline, not synchronisation

    def raft_leader(self, timeout_s: float = 10.0) -> int:
        """The index of the member that leads the raft group now, as the running members'
        ``POST /v3/maintenance/status`` (the gRPC gateway) report it.

        Raises:
            RuntimeError: no running member names a leader among them within the deadline.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            ids: dict[str, int] = {}
            leader = None
            for i, m in enumerate(self.members):
                if not m.running:
                    continue
                try:
                    req = urllib.request.Request(f"{m.client_url}/v3/maintenance/status", data=b"{}", method="POST")
                    with urllib.request.urlopen(req, timeout=1.0) as r:
                        st = json.loads(r.read())
                except (OSError, ValueError):
                    continue
                ids[str(st["header"]["member_id"])] = i
                leader = str(st.get("leader", "")) or leader
            if leader in ids:
                return ids[leader]
            if time.monotonic() > deadline:
                raise RuntimeError("no etcd member reports a leader")
            time.sleep(0.05)  # a poll interval inside a deadline

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: ``kill -9``) to member ``index`` and reap it."""
        m = self.members[index]
        if m.proc is None:
            return
        if m.proc.poll() is None:
            m.proc.send_signal(sig)
            m.proc.wait(timeout=30)
        m.proc = None

    def stop_member(self, index: int) -> None:
        """A clean stop (SIGTERM) of member ``index``."""
        self.kill(index, signal.SIGTERM)

    def restart(self, index: int, *, timeout_s: float = 30.0) -> None:
        """Start member ``index`` again on its data dir (it rejoins: its WAL names the
        cluster) and wait for its health."""
        m = self.members[index]
        if m.running:
            raise RuntimeError(f"etcd member {m.name} is still running")
        self._spawn(m)
        self.wait_healthy([m], timeout_s=timeout_s)

    def stop(self) -> None:
        for i in range(len(self.members)):
            self.kill(i, signal.SIGTERM)

    def strain(self) -> str:
        """What the members logged of being slow (etcd 3.4's warnings: "apply request took
        too long", "leader failed to send out heartbeat on time", "slow fdatasync", timed
        out reads, lost peer streams), counted per message; "" when nothing. A deposition
        under CI's load is then told apart: etcd struggling, or the daemon's host."""
        counts: dict[str, int] = {}
        longest: dict[str, float] = {}  # seconds, of the warnings that say how long ("took")
        for m in self.members:
            with contextlib.suppress(OSError):
                for raw in m.log_path.read_text(errors="replace").splitlines():
                    with contextlib.suppress(ValueError, AttributeError):
                        entry = json.loads(raw)
                        msg = str(entry.get("msg", ""))
                        if not any(w in msg for w in STRAIN_WORDS):
                            continue
                        key = f"{m.name}: {msg}"
                        counts[key] = counts.get(key, 0) + 1
                        took = _go_duration_s(str(entry.get("took", "")))
                        if took is not None and took > longest.get(key, -1.0):
                            longest[key] = took
        return "; ".join(f"{n}x {key}" + (f" (longest {longest[key]:.3f} s)" if key in longest else "")
                         for key, n in sorted(counts.items()))


def _go_duration_s(text: str) -> float | None:
    """A Go duration as etcd logs it ("1.2345s", "345.6ms", "1m2.5s") in seconds; None if not one."""
    parts = re.findall(r"([0-9.]+)(h|ms|us|µs|ns|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    return sum(float(n) * scale[u] for n, u in parts)


#: words of the etcd warnings that mean a member was slow (see :meth:`EtcdCluster.strain`)
STRAIN_WORDS = ("took too long", "slow", "heartbeat on time", "timed out", "lost TCP streaming")


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A started, healthy 3-member cluster; stopped after the test."""
    cluster = EtcdCluster(tmp_path / "etcd")
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if said := cluster.strain():  # shown with a failed test's report (captured at teardown)
            print(f"etcd under strain: {said}")


