"""Chaos cell: the daemon, then the whole control node, SIGKILLed under a local demo.

A real run: ``spotvisord demo`` on ``configs/local.yaml`` (the local provider, three
nodes, real node agents, real torchrun elastic, the reference trainer), shortened. The
schedule holds ``kill_daemon`` and ``kill_control_node``, so the demo is an outside runner
(:mod:`daemon.interfaces.demo_runner`): it runs the daemon as its child (``spotvisord
run``), holds the local instances' lifeline, and restarts what a chaos action killed with
a real SIGKILL ``restart_after_s`` later, on the same state directory, as systemd's
``Restart=`` would. The instances outlive the daemon (their own metadata endpoints, their
records adopted by the restarted daemon), as a cloud's do (tests/chaos/test_daemon_kill.py
and test_control_node_kill.py, the same with EC2 in moto).

One run covers three faults: ``kill_daemon`` mid-training at the full pool, ``kill_store``
(the store is the runner's child: the daemon kills it by the pid the runner wrote, the
runner restarts it), then a notice on node 2, and ``kill_control_node`` (the daemon and the
rendezvous store) while its replacement boots and is admitted. The floor: the job completes with 0 lost steps, no
sample seen twice or skipped, no resume before its commit, no instance left once the demo
exited, no gap in the event log's seq, and neither the daemon's kill nor the store's
restarts a worker (no ``job_stalled``, no new worker attempt until the notice). The timeline (kill → daemon back
→ its first act, seconds) is printed: ``pytest -s -m slow tests/chaos/test_local_daemon_kill.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.conftest import Matrix
from chaos.test_store_restart import RESTARTS, _attempts, _first, _no_restart, _record, _run
from daemon.model import Event

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def _first_act(stored: list[Event], back: Event) -> Event | None:
    """The restarted daemon's first event of its own after it said it is back."""
    return next((e for e in stored if e.seq > back.seq and e.kind != "chaos_injected"), None)


def _since(killed: Event, *events: Event | None) -> list[float | None]:
    return [None if e is None else round(e.time - killed.time, 1) for e in events]


def test_a_daemon_kill_and_a_control_node_kill_cost_no_step(tmp_path: Path, matrix: Matrix) -> None:
    s, stored, run_dir = _run(tmp_path, [
        {"action": "kill_daemon", "at_step": 12, "restart_after_s": 2},
        {"action": "kill_store", "at_step": 20, "restart_after_s": 2},
        {"action": "notice", "node": 2, "at_step": 30, "lead_s": 30},
        {"action": "kill_control_node", "at_step": 36, "restart_after_s": 3, "wait_full_pool": False},
    ], target_steps=50, hold_last=12, timeout_s=500)  # the grow lands about 5 steps after the last kill
    _record(matrix, "daemon, then store SIGKILLed mid-training, then both during a grow (local demo, 3 nodes)",
            s, stored, run_dir)
    out = s["_stdout"][-4000:]
    killed = _first(stored, "chaos_injected", action="kill_daemon")
    back = _first(stored, "chaos_injected", action="daemon_restarted", index=0)
    store_killed = _first(stored, "chaos_injected", action="kill_store")
    store_back = _first(stored, "chaos_injected", action="store_restarted", index=1)
    notice = _first(stored, "chaos_injected", action="notice")
    cn_killed = _first(stored, "chaos_injected", action="kill_control_node")
    cn_back = _first(stored, "chaos_injected", action="daemon_restarted", index=3)
    completed = _first(stored, "job_completed")
    assert None not in (killed, back, store_killed, store_back, notice, cn_killed, cn_back, completed), out
    assert not any(e.data.get("skipped") for e in stored if e.kind == "chaos_injected"), out
    assert "SIGKILLed by chaos #0" in s["_stdout"] and "SIGKILLed by chaos #3 with the rendezvous store" in s["_stdout"]
    assert "the rendezvous store was SIGKILLed by chaos #1; restarting it in 2 s" in s["_stdout"]
    grew = [e for e in stored if e.kind == "world_size_changed" and e.seq > cn_killed.seq]
    timeline = {
        "kill_daemon": {"at_step": killed.data["step"], **dict(zip(
            ("daemon_back_s", "first_act_s"), _since(killed, back, _first_act(stored, back))))},
        "kill_store": {"at_step": store_killed.data["step"], "store_back_s": store_back.data["down_s"]},
        "kill_control_node": {"at_step": cn_killed.data["step"], **dict(zip(
            ("daemon_back_s", "first_act_s", "first_membership_change_s", "job_completed_s"),
            _since(cn_killed, cn_back, _first_act(stored, cn_back), grew[0] if grew else None, completed)))},
    }
    print(f"\nlocal daemon kills, timeline (seconds after each kill): {json.dumps(timeline)}")

    # each fault fired once, whatever the restarts: one record per index (plus its restart's)
    fired = [e.data["index"] for e in stored if e.kind == "chaos_injected"
             and e.data["action"] not in ("daemon_restarted", "store_restarted")]
    assert sorted(fired) == [0, 1, 2, 3]
    # the daemon's kill and the store's restarted nothing: no stall anywhere, and until the notice no worker
    # restart of any kind and no new worker attempt (the same workers trained through it)
    assert [e.kind for e in stored if e.kind == "job_stalled"] == []
    assert [e.kind for e in stored if e.kind in RESTARTS and killed.seq < e.seq < notice.seq] == []
    assert [a for a, t in _attempts(run_dir).items() if killed.time < t < notice.time] == []
    # the control node's kill: the shrink and the replacement's grow stay in process
    _no_restart(stored, cn_killed, completed)
    assert s["lost_steps_total"] == 0 and s["restarts"] == 0
    assert s["resumes_before_their_commit"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["world_sizes"][-1] == 3, out  # the replacement joined
