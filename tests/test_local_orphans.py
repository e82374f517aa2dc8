"""Issue 13, defect 6: the local provider's instances end with the daemon, however it ends.

The README and docs/architecture.md say it: the local provider's instances are the
daemon's own processes and stop with it. A SIGKILLed ``spotvisord run`` used to leave
every agent and its torchrun training on, orphans a restarted daemon then declared lost
while they trained, and two views of one job. Here a real ``spotvisord run`` on a local
config (its rendezvous store started beside it, as the systemd units do) brings up two
nodes, booted (fast) or training in one torchrun round (slow); the daemon is killed
(SIGKILL; and the graceful SIGTERM, whose behaviour is unchanged), and every process
of its instances (the instance's init, the node agent, torchrun, its workers: all
carry the instance's id in their environment, ``SPOTVISOR_LOCAL_INSTANCE_ID``) must
be gone within a bounded time. The daemon's progress is read from its store.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
_ID = "SPOTVISOR_LOCAL_INSTANCE_ID"
SMALL_MODEL = ["--seq-len", "32", "--n-layer", "1", "--n-embd", "64", "--n-head", "2"]


def _instance_processes(prefix: str) -> dict[int, psutil.Process]:
    """Live processes of the local instances whose id starts with ``prefix``."""
    out = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(_ID, "").startswith(prefix) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                out[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    return out


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def _config(tmp_path: Path, rdzv_port: int, sockdir: str) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    raw["pool"].update({"min_nodes": 1, "target_nodes": 2, "max_nodes": 2})
    # long enough to be training whenever the daemon dies
    raw["job"].update({"target_steps": 1_000_000, "checkpoint_interval_steps": 1_000_000, "args": SMALL_MODEL})
    raw["job"].pop("model", None)
    raw["rendezvous"]["port"] = rdzv_port
    raw["daemon"].update({"state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                          "agent_host": "127.0.0.1", "reconcile_interval_s": 0.1})
    raw["providers"]["local"]["launch_delay_s"] = 0.1
    raw["chaos"] = []
    cfg = tmp_path / "spotvisord.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def _events(db: Path) -> list[tuple[str, dict]]:
    if not db.exists():
        return []
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
            return [(k, json.loads(d)) for k, d in conn.execute("SELECT kind, data FROM events ORDER BY seq")]
    except sqlite3.OperationalError:  # created but no table yet
        return []


class _Daemon:
    """``spotvisord run --config FILE`` in its own process; ``prefix``: its instances' ids."""

    def __init__(self, cfg: Path, log: Path) -> None:
        self.db = cfg.parent / "state" / "spotvisord.db"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(cfg)], cwd=ROOT,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.prefix = f"local-{self.proc.pid}-"  # the provider's instance ids: local-<daemon pid>-<seq>

    def until(self, pred: Callable[[list[tuple[str, dict]]], bool], what: str, timeout_s: float) -> None:
        """Poll the daemon's store until ``pred(events)`` holds."""
        deadline = time.monotonic() + timeout_s
        while not pred(_events(self.db)):
            assert self.proc.poll() is None, f"the daemon exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.log.read_text()[-3000:]}"
            time.sleep(0.05)

    def end(self, sig: signal.Signals) -> list[psutil.Process]:
        """Send ``sig``, wait for the daemon's exit, and return what of its instances is
        still alive 15 s later (it was all alive just before)."""
        procs = _instance_processes(self.prefix)
        self.proc.send_signal(sig)
        self.proc.wait(30)
        _, alive = psutil.wait_procs(list(procs.values()), timeout=15)
        return alive + [p for pid, p in _instance_processes(self.prefix).items() if pid not in procs]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in _instance_processes(self.prefix).values():  # what a failed run left
            try:
                p.kill()
            except psutil.Error:
                pass


@pytest.fixture
def daemon(tmp_path: Path, rendezvous: int) -> Iterator[_Daemon]:
    with tempfile.TemporaryDirectory(prefix="svo-", dir="/tmp") as sockdir:  # a unix socket's path is short
        d = _Daemon(_config(tmp_path, rendezvous, sockdir), tmp_path / "daemon.log")
        try:
            yield d
        finally:
            d.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_booted_local_instances_end_with_the_daemon(daemon: _Daemon, sig: signal.Signals) -> None:
    """Both agents registered (and importing torch for the job): the daemon ends, and so
    does every process of its instances."""
    daemon.until(lambda evs: sum(k == "node_ready" for k, _ in evs) == 2, "both nodes ready", 60)
    ids, tmps = set(), set()
    for p in _instance_processes(daemon.prefix).values():
        with contextlib.suppress(psutil.Error):
            env = p.environ()
            ids.add(env[_ID])
            tmps.add(env["TMPDIR"])
    assert len(ids) == 2 and len(tmps) == 2 and all(Path(t).is_dir() for t in tmps), (ids, tmps)
    alive = daemon.end(sig)
    assert not alive, f"instance processes outlived the daemon ({sig.name}): {_describe(alive)}"
    # each instance's own TMPDIR went with it, however the daemon ended (its init removes it)
    assert not [t for t in tmps if Path(t).exists()], tmps


@pytest.mark.slow  # real torchrun on two nodes: ~30 s on two loaded cores
def test_training_local_instances_end_with_a_sigkilled_daemon(daemon: _Daemon) -> None:
    """Both nodes train in one torchrun round (the store says so): a SIGKILL of the daemon
    ends the agents, torchrun and its workers (in sessions of their own) too, so a
    restarted daemon never meets the old round still training."""
    daemon.until(lambda evs: any(k == "job_resumed" and d.get("world_size") == 2 for k, d in evs),
                 "training at world size 2", 180)
    procs = _instance_processes(daemon.prefix).values()
    cmdlines = " ".join(" ".join(p.cmdline()) for p in procs)
    assert "daemon.gpunode.agent" in cmdlines and "trainer.run" in cmdlines, _describe(list(procs))
    alive = daemon.end(signal.SIGKILL)
    assert not alive, f"instance processes outlived the SIGKILLed daemon: {_describe(alive)}"
