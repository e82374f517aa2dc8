"""End to end: an unmodified torchrun DDP script (trainer/examples/plain_ddp.py: torchrun's
environment, ``init_process_group()``, its own ``--save-dir``; nothing of spotvisor's)
runs as ``job.command`` under ``spotvisord demo`` through the demo's chaos schedule: two
interruption notices and one node killed without notice.

What a user cares about: the job completes (every step of the script done, from its
own saves), each notice reached the script as a SIGTERM with its deadline before the
node went, each noticed node was replaced in its own placement domain, and nothing is
left running or billing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon.controlnode.store import Store

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "trainer" / "examples" / "plain_ddp.py"
STEPS = 500


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


def test_an_unmodified_ddp_script_survives_two_notices_and_a_kill(run_demo, tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    run_demo(
        module=None, args=None, grow="restart",
        command=[str(SCRIPT), "--save-dir", str(save_dir),
                 "--steps", str(STEPS), "--save-every", "20", "--step-s", "0.25"],
        # by time: the script reports no step (and no world size, which wait_full_pool needs)
        # by time: the script reports no step (and no world size, which wait_full_pool needs);
        # from the job's start, its workers' import and rendezvous take ~20 s on 2 loaded cores
        chaos=[{"action": "notice", "node": 2, "at_s": 40, "lead_s": 20, "wait_full_pool": False},
               {"action": "notice", "node": 3, "at_s": 80, "lead_s": 20, "wait_full_pool": False},
               {"action": "kill", "node": 1, "at_s": 120, "wait_full_pool": False}],
        timeout_s=480,
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
    assert len(notices) == 2
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

    # nothing left running or billing
    released = next(e for e in events if e.kind == "pool_released")
    assert released.data["reason"] == "job_completed"
    assert _left_running(str(tmp_path)) == []
