"""Chaos cells: the rendezvous store is killed and restarted empty under a running job.

A real run: ``spotvisord demo`` on ``configs/local.yaml`` (the local provider, three
nodes, real node agents, real torchrun elastic, the reference trainer), shortened. The
chaos schedule's ``kill_store`` SIGKILLs the store the demo started and starts it again,
empty, ``restart_after_s`` later, as its unit's ``Restart=`` would.

Issue 25 made such a loss recoverable (every torchrun exited 1 within 5 s; the daemon
said ``job_stalled`` and restarted the job in place from its newest commit). Issue 29
makes it cost nothing: the workers' collectives never touch the store, so the torchrun
agents (``--rdzv-backend=spotvisor``, :mod:`trainer.rendezvous`) and the trainer's own
store users (rank 0's join check, the loss watch, a joiner's ticket) ride the outage out
and reconnect to the restarted store. The cells: mid-training (the issue's floor: 0 lost
steps, 0 worker restarts, no new torchrun, no ``job_stalled``), during a notice's commit
and its in-process shrink, and during a replacement's in-process grow.

Measured from what the run left: its event log (``spotvisord.db``), the demo's summary,
the checkpoint directory, the step logs and the processes still carrying a local
instance's id. Each cell prints its timeline (store killed → store back → the first
membership change after it, seconds): ``pytest -s -m slow tests/chaos/test_store_restart.py``.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos.conftest import Matrix, lost_events
from chaos.test_mass_notice import _instance_processes
from daemon.model import Event
from e2e.conftest import ROOT, SMALL_MODEL, _run_demo_config
from trainer.checkpoint import FileStore, list_committed

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

#: what a worker restart (or a new torchrun) would show in the event log
RESTARTS = ("job_stalled", "job_resumed", "trainer_exited", "node_lost", "node_terminated")


#: the small model, each step at least 0.4 s at any world size and 0.6 s while the world is
#: short of 3 (e2e.paced_trainer): the job trains on across the store's outage (about
#: 10 s under load) and a replacement's boot without burning the cores
PACED = {"module": "e2e.paced_trainer",
         "args": [*SMALL_MODEL, "--full-world", "3", "--pace-s", "0.6", "--min-step-s", "0.4"]}


def _run(tmp_path: Path, chaos: list[dict[str, Any]], *, target_steps: int = 150, timeout_s: float = 400,
         pg_timeout_s: float | None = None, join_timeout_s: float | None = None, paced: bool = True,
         hold_last: int = 0) -> tuple[dict[str, Any], list[Event], Path]:
    """configs/local.yaml's job with ``chaos``: with ``paced``, the small model paced
    (:data:`PACED`); without, the config's own model (a few tenths of a second a step
    here, so the store is back long before the end). ``pg_timeout_s``: the trainer's
    ``--pg-timeout-s`` (how long a new group waits for the store); ``join_timeout_s``:
    torchrun's rendezvous ``join_timeout``; ``hold_last``: the paced trainer's last steps
    wait for the world of 3 (``--hold-last``: a cell that needs the replacement's grow
    before the end ends a few steps after it, not after slack steps sized for a slow day)."""
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    job = PACED if paced else {"args": raw["job"]["args"]}
    raw["job"].update({**job, "target_steps": target_steps, "args": [
        *job["args"], "--keep-checkpoints", "1000", *(["--hold-last", str(hold_last)] if hold_last else []),
        *(["--pg-timeout-s", f"{pg_timeout_s:g}"] if pg_timeout_s else [])]})
    if join_timeout_s:
        raw["rendezvous"]["join_timeout_s"] = join_timeout_s
    raw["providers"]["local"]["launch_delay_s"] = 0.5
    raw["chaos"] = chaos
    s = _run_demo_config(raw, tmp_path, timeout_s=timeout_s)
    (run_dir,) = (tmp_path / "state").glob("demo-*")
    with closing(sqlite3.connect(f"file:{run_dir / 'spotvisord.db'}?mode=ro", uri=True)) as db:
        stored = [Event(q, t, k, n, json.loads(d))
                  for q, t, k, n, d in db.execute("SELECT seq, time, kind, node, data FROM events ORDER BY seq")]
    return s, stored, run_dir


def _first(stored: list[Event], kind: str, after: int = 0, **data: Any) -> Event | None:
    return next((e for e in stored if e.kind == kind and e.seq > after
                 and all(e.data.get(k) == v for k, v in data.items())), None)


def _record(matrix: Matrix, scenario: str, s: dict[str, Any], stored: list[Event], run_dir: Path) -> None:
    instances = {e.data["instance_id"] for e in stored if e.kind == "node_launched"}
    commits = {e.data["step"] for e in stored if e.kind == "checkpoint_committed"}
    on_disk = {m.step for m in list_committed(FileStore(run_dir / "checkpoints"))}
    row = matrix.row(scenario, job_completed=s["steps_completed"] == s["target_steps"]
                     and _first(stored, "job_completed") is not None,
                     lost_checkpoints=len(commits - on_disk),
                     leaked_instances=len(_instance_processes(instances))
                     + (0 if stored[-1].kind == "pool_released" else 1),
                     lost_events=lost_events(stored))
    assert row.clean(), (row, s["_stdout"][-4000:])


def _attempts(run_dir: Path) -> dict[str, float]:
    """Every worker attempt in the run's step logs: its id and the time of its first step."""
    first: dict[str, float] = {}
    for path in run_dir.rglob("steps-*-rank*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            first[r["attempt"]] = min(first.get(r["attempt"], r["time"]), r["time"])
    return first


def _no_restart(stored: list[Event], killed: Event, completed: Event) -> None:
    """No stall and no resume from a commit after ``killed``: every new attempt was an
    in-process resize (a shrink or a grow), no trainer exited but a leaving node's."""
    assert [e.kind for e in stored if e.kind == "job_stalled"] == []
    resumes = [e for e in stored if e.kind == "job_resumed" and killed.seq < e.seq < completed.seq]
    assert [e.data.get("resized") for e in resumes] == ["in_process"] * len(resumes)
    drained = {e.node for e in stored if e.kind == "node_terminated" and e.data.get("reason") == "drained"}
    assert {e.node for e in stored if e.kind == "trainer_exited" and killed.seq < e.seq < completed.seq} <= drained


def _timeline(stored: list[Event], killed: Event, restarted: Event, **more: Event | None) -> dict[str, Any]:
    done = _first(stored, "job_completed")
    out: dict[str, Any] = {"killed_at_step": killed.data["step"], "store_back_s": restarted.time - killed.time}
    out.update({k: (e.time - killed.time if e is not None else None) for k, e in more.items()})
    out["job_completed_s"] = done.time - killed.time if done else None
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def test_a_store_restart_costs_no_step_and_no_worker_restart(tmp_path: Path, matrix: Matrix) -> None:
    # 60 steps: 35 after the kill, long past the store's return (about 10 s); the kill after
    # the commit at step 20
    s, stored, run_dir = _run(tmp_path, [{"action": "kill_store", "at_step": 25, "restart_after_s": 3}],
                              target_steps=60, paced=False)  # the run: configs/local.yaml's model
    _record(matrix, "rendezvous store SIGKILLed mid-training, back empty 3 s later (real demo, 3 nodes)",
            s, stored, run_dir)
    killed = _first(stored, "chaos_injected", action="kill_store")
    restarted = _first(stored, "chaos_injected", action="store_restarted")
    completed = _first(stored, "job_completed")
    assert killed is not None and restarted is not None and completed is not None, s["_stdout"][-4000:]
    print(f"\nstore restart timeline (seconds after the kill): {json.dumps(_timeline(stored, killed, restarted))}")

    # nothing restarted: no trainer exited before the job's end, no stall, no resume, no node lost
    assert [e.kind for e in stored if e.kind in RESTARTS and killed.seq < e.seq < completed.seq] == []
    # the same workers: no attempt (a worker incarnation) started after the kill
    assert [a for a, t in _attempts(run_dir).items() if t > killed.time] == []
    assert s["restarts"] == 0 and s["resizes_in_process"] == 0
    assert s["lost_steps_total"] == 0 and s["resumes_before_their_commit"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["world_sizes"] == [3]
    _trained_on(stored, restarted, completed)


def _trained_on(stored: list[Event], restarted: Event, completed: Event, steps: int = 5) -> None:
    """The job trained ``steps`` or more after the store was back: the cell tested a
    reconnect, not a job that ended during the outage."""
    assert completed.data["step"] - restarted.data["step"] >= steps, (restarted, completed)


def test_a_store_killed_during_a_notice_commit_costs_no_step(tmp_path: Path, matrix: Matrix) -> None:
    # the store dies right after the notice is published: the notice's commit and the
    # survivors' in-process shrink (a new group through the store) land in its outage
    s, stored, run_dir = _run(tmp_path, [
        {"action": "notice", "node": 2, "at_step": 30, "lead_s": 30},
        {"action": "kill_store", "at_step": 30, "restart_after_s": 3, "wait_full_pool": False},
    ], target_steps=50, hold_last=15)  # the grow lands about 10 steps after the notice (80: 17 s after it)
    _record(matrix, "rendezvous store SIGKILLed during a notice's commit (real demo, 3 nodes)", s, stored, run_dir)
    killed = _first(stored, "chaos_injected", action="kill_store")
    restarted = _first(stored, "chaos_injected", action="store_restarted")
    completed = _first(stored, "job_completed")
    assert killed is not None and restarted is not None and completed is not None, s["_stdout"][-4000:]
    changes = [e for e in stored if e.kind == "world_size_changed" and e.seq > killed.seq]
    print("\nstore killed during a notice's commit (seconds after the kill): " + json.dumps(_timeline(
        stored, killed, restarted, committed=_first(stored, "checkpoint_committed", after=killed.seq),
        first_membership_change=changes[0] if changes else None)))
    _no_restart(stored, killed, completed)
    _trained_on(stored, restarted, completed)
    assert s["lost_steps_total"] == 0 and s["lost_steps_on_notice"] == 0
    assert s["restarts"] == 0 and s["resizes_in_process"] >= 1  # the shrink (and the replacement's grow)
    assert s["resumes_before_their_commit"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0


def test_a_store_killed_during_a_grow_costs_no_step(tmp_path: Path, matrix: Matrix) -> None:
    # node 2 leaves on a notice at step 20; its replacement boots, queues its join ticket
    # and is admitted at a step boundary: the store is down for 6 s from step 26 on,
    # across the replacement's start, its ticket and (on this machine) its admission
    s, stored, run_dir = _run(tmp_path, [
        {"action": "notice", "node": 2, "at_step": 20, "lead_s": 30},
        {"action": "kill_store", "at_step": 26, "restart_after_s": 6, "wait_full_pool": False},
    ], target_steps=55, hold_last=20)  # the grow lands 9-13 s after the kill, about 15 steps on (90: 22 s after)
    _record(matrix, "rendezvous store SIGKILLed during a replacement's grow (real demo, 3 nodes)",
            s, stored, run_dir)
    killed = _first(stored, "chaos_injected", action="kill_store")
    restarted = _first(stored, "chaos_injected", action="store_restarted")
    completed = _first(stored, "job_completed")
    assert killed is not None and restarted is not None and completed is not None, s["_stdout"][-4000:]
    grew = [e for e in stored if e.kind == "world_size_changed" and e.seq > killed.seq]
    print("\nstore killed during a grow (seconds after the kill): " + json.dumps(_timeline(
        stored, killed, restarted, first_membership_change=grew[0] if grew else None)))
    _no_restart(stored, killed, completed)
    _trained_on(stored, restarted, completed)
    assert s["lost_steps_total"] == 0 and s["restarts"] == 0
    assert s["world_sizes"][-1] == 3  # the replacement joined, in-process
    assert s["resumes_before_their_commit"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0


def test_a_store_down_longer_than_every_timeout_with_a_node_lost_meanwhile_costs_no_step(
        tmp_path: Path, matrix: Matrix) -> None:
    # a node lost without notice while the store stays down 25 s: longer than the survivors'
    # collective and store timeouts (--pg-timeout-s 8) and torchrun's rendezvous join_timeout
    # (5 s). Each survivor waits for the store on a fixed beat (--store-wait-s, 300 s; before,
    # c10d's own connect retries decided, and one survivor could give up while the other
    # waited, a split that ended in a restart, or in a group re-formed from the commit), so
    # once the store is back they re-form together, in process, at the step they hold.
    s, stored, run_dir = _run(tmp_path, [
        {"action": "kill_store", "at_step": 25, "restart_after_s": 25},
        {"action": "kill", "node": 3, "at_step": 25, "wait_full_pool": False},
    ], pg_timeout_s=8, join_timeout_s=5, target_steps=50)  # about 25 steps past the re-form
    _record(matrix, "rendezvous store down 25 s with a node lost meanwhile (real demo, 3 nodes)", s, stored, run_dir)
    killed = _first(stored, "chaos_injected", action="kill_store")
    restarted = _first(stored, "chaos_injected", action="store_restarted")
    completed = _first(stored, "job_completed")
    assert killed is not None and restarted is not None and completed is not None, s["_stdout"][-4000:]
    resumed = _first(stored, "job_resumed", after=killed.seq)
    print("\nstore down longer than every timeout, a node lost meanwhile (seconds after the kill): "
          + json.dumps(_timeline(stored, killed, restarted, job_resumed=resumed)))
    # the job's membership cannot change while the store is down: the first resize after the
    # kill comes after the store is back, in process, at the step the survivors held
    assert resumed is not None and resumed.time > restarted.time, s["_stdout"][-4000:]
    assert resumed.data.get("resized") == "in_process" and resumed.data["lost_steps"] == 0, resumed.data
    assert resumed.data["step"] >= killed.data["step"]
    _no_restart(stored, killed, completed)
    lost = _first(stored, "node_lost", after=killed.seq)
    assert lost is not None and lost.node == "demo-3"
    assert s["lost_steps_total"] == 0 and s["lost_steps_on_notice"] == 0
    assert s["resumes_before_their_commit"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
