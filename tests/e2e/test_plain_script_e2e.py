"""End to end: an unmodified torchrun DDP script (trainer/examples/plain_ddp.py: torchrun's
environment, ``init_process_group()``, its own ``--save-dir``; nothing of spotvisor's)
runs as ``job.command`` under ``spotvisord demo`` through two faults: an interruption
notice (``spotctl simulate-preemption``) and a node killed without notice
(every process of its local instance SIGKILLed, as the chaos ``kill`` does), each once the
script has trained past its last restart by its own saves.

What a user cares about: the job completes (every step of the script done, from its
own saves), each notice reached the script as a SIGTERM with its deadline before the
node went, each noticed node was replaced in its own placement domain, and nothing is
left running or billing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from daemon.controlnode.store import Store
from daemon.providers.local import _INSTANCE_ENV, _kill_instance_processes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "trainer" / "examples" / "plain_ddp.py"
STEPS = 120
SAVE_EVERY = 20
CHAOS_TIMEOUT_S = 240.0  # for each fault's moment to come (the script's start included)


def _left_running(marker: str) -> list[int]:
    """Pids of processes whose command line names ``marker`` (this run's directory)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and int(pid) != os.getpid():
            out.append(int(pid))
    return out


def _ctl(sock: Path, *argv: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "daemon.interfaces.ctl", "--socket", str(sock), *argv, "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def _saves(save_dir: Path) -> list[dict]:
    try:
        text = (save_dir / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _chaos_by_the_scripts_own_progress(save_dir: Path, tmp_path: Path) -> Callable[[subprocess.Popen, Path], None]:
    """The faults (a notice on node 2, then node 1 killed), each fired once
    the script has trained ``SAVE_EVERY`` steps past its last restart, by its own saves.

    The script reports nothing to spotvisor, so the daemon's chaos could only go by time,
    and on two loaded cores a start can take a minute: a notice that came before the
    script installed its handler would test nothing. Here each fault waits for the
    script's own ``events.jsonl`` (a periodic save since the newest ``resumed``)."""

    def trained_on(since: float, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + CHAOS_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            saves = _saves(save_dir)
            starts = [s for s in saves if s["event"] == "resumed" and s["time"] > since]
            if starts and any(s["event"] == "periodic" and s["time"] > starts[-1]["time"]
                              and s["step"] >= starts[-1]["step"] + SAVE_EVERY for s in saves):
                return
            time.sleep(0.5)
        raise AssertionError(f"the script did not train {SAVE_EVERY} steps past its restart: {_saves(save_dir)[-5:]}")

    def during(proc: subprocess.Popen, sock: Path) -> None:
        since = 0.0
        trained_on(since, proc)
        since = time.time()
        _ctl(sock, "simulate-preemption", "demo-2", "--lead-s", "20")
        trained_on(since, proc)
        # node 1 killed with no notice, as the local provider's chaos does: every process of it
        instance = min((p for p in psutil.process_iter(["cmdline", "create_time"])
                        if "--node-id" in (c := p.info["cmdline"] or []) and c[c.index("--node-id") + 1] == "demo-1"
                        and any(str(tmp_path) in a for a in c)), key=lambda p: p.info["create_time"])
        _kill_instance_processes(instance.pid, instance.environ()[_INSTANCE_ENV])  # its init, and all below

    return during


@pytest.mark.usefixtures("plain_script_job")
def test_an_unmodified_ddp_script_survives_a_notice_and_a_kill(run_demo, tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    run_demo(
        module=None, args=None, grow="restart",
        command=[str(SCRIPT), "--save-dir", str(save_dir),
                 "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--step-s", "0.15"],
        chaos=[], during=_chaos_by_the_scripts_own_progress(save_dir, tmp_path),
        timeout_s=600,
    )
    [db] = (tmp_path / "state").glob("demo-*/spotvisord.db")
    store = Store(db).open()
    try:
        events = store.events()
    finally:
        store.close()
    kinds = [e.kind for e in events]

    # completed: every torchrun exited 0, and the script's own last save is its last step
    assert "job_completed" in kinds and kinds.index("job_completed") < kinds.index("pool_released")
    saves = [json.loads(line) for line in (save_dir / "events.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saves if s["event"] == "final"] == [STEPS]

    # each notice: the script on that node got SIGTERM with the deadline still ahead, and saved
    notices = [e for e in events if e.kind == "interruption_notice"]
    assert len(notices) == 1
    told = [s for s in saves if s["event"] == "sigterm" and s["notice"] is not None]
    assert {s["notice"]["id"] for s in told} == {e.data["notice_id"] for e in notices}
    for s in told:
        assert s["notice"]["seconds_left"] > 10 and s["time"] < s["notice"]["deadline"]

    # each noticed node, and the killed one, replaced in its own domain (provider and region)
    launched = {e.node: e for e in events if e.kind == "node_launch_requested"}
    lost = [e for e in events if e.kind == "node_lost"]
    assert len(lost) == 1
    for gone in [*notices, *lost]:
        later = [e for e in launched.values() if e.seq > gone.seq]
        assert later, f"no replacement for {gone.node}"
        offer = launched[gone.node].data["offer"].split("/")[:2]
        assert later[0].data["offer"].split("/")[:2] == offer, (gone.node, later[0].data)

    # the group restarted from the script's own saves: after each notice, from the step the
    # noticed node saved (nobody could train past it without that node: no step lost on it)
    starts = [s for s in saves if s["event"] == "resumed"]
    for s in told:
        after = [r for r in starts if r["time"] > s["time"]]
        assert after and after[0]["step"] == s["step"], (s, after[:1])
    assert starts[0]["world_size"] == 3 and starts[-1]["world_size"] >= 2, starts

    # the faults failed the survivors' workers (their peer gone mid-collective), and torchrun
    # counts each failure against --max-restarts: those are not the script's errors and must
    # not use up a budget (2 before: the third notice ended the survivors' torchrun, and the
    # job came back only through the daemon's restart of a stalled job)
    failures = [e for e in events if e.kind == "workers_failed"]
    assert failures and all(e.data["torchrun_restarts_left"] >= 100 for e in failures), [e.data for e in failures]
    assert "job_stalled" not in kinds

    # nothing left running or billing
    released = next(e for e in events if e.kind == "pool_released")
    assert released.data["reason"] == "job_completed"
    assert _left_running(str(tmp_path)) == []
