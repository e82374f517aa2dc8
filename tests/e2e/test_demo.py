"""End to end: a shortened `make demo` (real torchrun elastic, real agents, real
IMDSv2 endpoints, two interruption notices and one node killed without notice).

Asserts the summary invariants the issue promises: every step done, zero lost
steps on notice, no sample seen twice or skipped, the world shrank and grew back.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, *, with_kill: bool) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    raw["job"].update(
        target_steps=200,
        checkpoint_interval_steps=10,
        args=["--seq-len", "64", "--n-layer", "2", "--n-embd", "128", "--n-head", "4"],
    )
    raw["rendezvous"]["port"] = _free_port()
    raw["daemon"]["state_dir"] = str(tmp / "state")
    raw["daemon"]["socket"] = str(tmp / "d.sock")
    raw["chaos"] = [
        {"action": "notice", "node": 2, "at_step": 20, "lead_s": 20},
        {"action": "notice", "node": 3, "at_step": 60, "lead_s": 20},
    ]
    if with_kill:
        raw["chaos"].append({"action": "kill", "node": 1, "at_step": 105})
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_shortened_demo_survives_notices_and_a_kill(tmp_path: Path) -> None:
    cfg = _config(tmp_path, with_kill=True)
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "demo", "--config", str(cfg), "--summary-json", str(out),
         "--timeout-s", "420"],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads(out.read_text())
    for key in ("target_steps", "steps_completed", "preemptions_with_notice", "nodes_lost_without_notice",
                "lost_steps_on_notice", "lost_steps_total", "world_sizes", "checkpoints_committed",
                "notice_to_commit_s", "notice_to_resume_s", "loss_first", "loss_last",
                "samples_seen_twice", "samples_skipped"):
        assert key in s, key
    assert s["steps_completed"] == s["target_steps"] == 200
    assert s["lost_steps_on_notice"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["preemptions_with_notice"] == 2
    assert s["nodes_lost_without_notice"] == 1
    ws = s["world_sizes"]
    assert ws[0] == 3 and 2 in ws and ws[-1] == 3, ws
    assert s["loss_last"] < s["loss_first"]
    assert len(s["notice_to_commit_s"]) == 2 and all(t < 10 for t in s["notice_to_commit_s"])
    assert s["checkpoints_committed"] >= 6
