"""Chaos cell: the rendezvous store is killed and restarted empty under a running job (issue 25).

A real run: ``spotvisord demo`` on ``configs/local.yaml`` (the local provider, three
nodes, real node agents, real torchrun elastic, the reference trainer), shortened. The
chaos schedule's ``kill_store`` SIGKILLs the store the demo started and starts it again,
empty, 3 s later, as its unit's ``Restart=`` would. Every node's torchrun loses its
rendezvous and exits 1; before, nothing happened after that (no event, no restart,
every node up: the job silent for good). Now the daemon reports ``job_stalled``
(``trainers_exited``) once every trainer has exited for ``daemon.stall.exit_grace_s``,
restarts the three trainers in place under a new rendezvous id, and the job resumes
from its newest commit (``job_resumed``) and completes, on the same three nodes.

Measured from what the run left: its event log (``spotvisord.db``), the demo's summary,
the checkpoint directory and the processes still carrying a local instance's id. The
timeline (store killed → trainers exited → job_stalled → job_resumed, seconds) is
printed: ``pytest -s -m slow tests/chaos/test_store_restart.py``.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import yaml

from chaos.conftest import Matrix, lost_events
from chaos.test_mass_notice import _instance_processes
from daemon.model import Event
from e2e.conftest import ROOT, SMALL_MODEL, _run_demo_config
from trainer.checkpoint import FileStore, list_committed

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def test_a_store_restart_is_reported_and_the_job_restarted_in_place(tmp_path: Path, matrix: Matrix) -> None:
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    raw["job"].update({"target_steps": 80, "checkpoint_interval_steps": 10,
                       "args": [*SMALL_MODEL, "--keep-checkpoints", "1000"]})
    raw["providers"]["local"]["launch_delay_s"] = 0.5
    raw["chaos"] = [{"action": "kill_store", "at_step": 25, "restart_after_s": 3}]
    s = _run_demo_config(raw, tmp_path, timeout_s=400)

    (run_dir,) = (tmp_path / "state").glob("demo-*")
    with closing(sqlite3.connect(f"file:{run_dir / 'spotvisord.db'}?mode=ro", uri=True)) as db:
        stored = [Event(q, t, k, n, json.loads(d))
                  for q, t, k, n, d in db.execute("SELECT seq, time, kind, node, data FROM events ORDER BY seq")]
    instances = {e.data["instance_id"] for e in stored if e.kind == "node_launched"}
    commits = [e for e in stored if e.kind == "checkpoint_committed"]
    on_disk = {m.step for m in list_committed(FileStore(run_dir / "checkpoints"))}
    row = matrix.row("rendezvous store SIGKILLed, restarted empty 3 s later (real demo, 3 nodes)",
                     job_completed=s["steps_completed"] == s["target_steps"] and any(
                         e.kind == "job_completed" for e in stored),
                     lost_checkpoints=len({c.data["step"] for c in commits} - on_disk),
                     leaked_instances=len(_instance_processes(instances))
                     + (0 if stored[-1].kind == "pool_released" else 1),
                     lost_events=lost_events(stored))

    def first(kind: str, after: int = 0, **data) -> Event | None:
        return next((e for e in stored if e.kind == kind and e.seq > after
                     and all(e.data.get(k) == v for k, v in data.items())), None)

    killed = first("chaos_injected", action="kill_store")
    restarted = first("chaos_injected", action="store_restarted")
    completed = first("job_completed")
    assert killed is not None and restarted is not None and completed is not None, s["_stdout"][-4000:]
    stalled = [e for e in stored if e.kind == "job_stalled"]
    until = stalled[0].seq if stalled else stored[-1].seq + 1
    exits = [e for e in stored if e.kind == "trainer_exited" and killed.seq < e.seq < until]  # not the job's end
    resumed = first("job_resumed", after=stalled[0].seq) if stalled else None
    timeline = {"store_restarted_s": restarted.time - killed.time,
                "trainers_exited_s": [round(e.time - killed.time, 1) for e in exits],
                "job_stalled_s": stalled[0].time - killed.time if stalled else None,
                "job_resumed_s": resumed.time - killed.time if resumed else None,
                "job_completed_s": completed.time - killed.time}
    print(f"\nstore restart timeline (seconds after the kill at step {killed.data['step']}): "
          + json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in timeline.items()}))

    assert row.clean(), (row, s["_stdout"][-4000:])
    # every node's torchrun lost its rendezvous and exited non-zero; nothing was left running
    assert sorted(e.node for e in exits) == sorted({e.node for e in stored if e.kind == "node_admitted"})
    assert all(e.data["exit_code"] != 0 for e in exits)
    # reported once, with its reason, after the last exit; then the job resumed from its newest commit
    (stall,) = stalled
    assert stall.data["reason"] == "trainers_exited" and stall.seq > max(e.seq for e in exits)
    assert sorted(stall.data["restart"]) == sorted(e.node for e in exits)
    assert resumed is not None and resumed.seq > stall.seq
    newest = max(c.data["step"] for c in commits if c.seq < stall.seq)
    assert resumed.data["resumed_from"] == newest
    assert s["world_sizes"][-1] == 3  # (a torchrun late to the restart's rendezvous joins it one round later)
    # in place: the same three nodes, none lost, none launched again
    assert len(instances) == 3 and not [e for e in stored if e.kind in ("node_lost", "node_terminated")
                                         and e.seq < completed.seq]
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["resumes_before_their_commit"] == 0
