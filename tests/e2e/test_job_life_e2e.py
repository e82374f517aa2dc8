"""The job's life end to end on the local provider (real agents, real torchrun, real
spotctl over the daemon's socket): a crash-looping ``job.command`` script ends ``failed``
after ``job.max_restarts_on_errors`` tries with its log tail in the feed and no instance
left; ``spotctl down`` mid-run commits, leaves no instance and ends the job
``cancelled``; ``spotctl resume`` continues from the committed step.

The daemon runs in the test's event loop (``running_daemon``); every wait is a condition
re-checked on each new event, with a deadline."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from chaos.test_mass_notice import _instance_processes
from conftest import spotctl
from daemon.config import Config
from daemon.controlnode.supervisor import Supervisor
from daemon.interfaces.cli import rendezvous_process, running_daemon
from daemon.model import Event, JobState
from bench.ports import free_port
from e2e.conftest import ROOT, SMALL_MODEL
from trainer.checkpoint import FileStore, list_committed

pytestmark = pytest.mark.slow

CRASH = 'import sys\nprint("loading the dataset from /data/shards", flush=True)\n' \
        'print("FileNotFoundError: /data/shards/train-00000.bin", flush=True)\nsys.exit(1)\n'


def _config(tmp_path: Path, job: dict[str, Any]) -> Config:
    return Config.model_validate(_raw(tmp_path, job))


def _raw(tmp_path: Path, job: dict[str, Any]) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    raw["pool"].update({"target_nodes": 1, "max_nodes": 1})
    raw["job"] = {**{k: raw["job"][k] for k in ("id", "global_batch_size", "micro_batch_size", "checkpoint_uri")},
                  **job}
    raw["rendezvous"]["port"] = free_port()
    raw["daemon"].update({"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "d.sock"),
                          "rejoin_timeout_s": 30})
    raw["providers"]["local"]["launch_delay_s"] = 0.2
    raw["chaos"] = []
    return raw


async def _until(sup: Supervisor, cond: Callable[[], Any], what: str, timeout_s: float = 90.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while not (found := cond()):
            await sup.wait_for_events(sup.store.last_seq(), 1.0)
    return found


def _events(sup: Supervisor, kind: str) -> list[Event]:
    return sup.store.events(kinds=[kind])


def _instances(sup: Supervisor) -> set[str]:
    return {e.data["instance_id"] for e in _events(sup, "node_launched")}


@pytest.mark.usefixtures("plain_script_job")
@pytest.mark.parametrize("runner", ["in_process", "outside"])
def test_a_demo_whose_job_fails_exits_1_once_the_pool_is_released(tmp_path: Path, runner: str) -> None:
    """``spotvisord demo`` of a script that cannot start ends with exit 1 as soon as the job
    failed and its pool is released, in the demo's own process and as the outside runner
    (a chaos schedule that kills the daemon, never reached here). It waited for a
    completion that could not come, to its ``--timeout-s`` (900 s by default)."""
    script = tmp_path / "train.py"
    script.write_text(CRASH)
    raw = _raw(tmp_path, {"command": [str(script)], "target_steps": 100})
    if runner == "outside":
        raw["chaos"] = [{"action": "kill_daemon", "at_step": 50, "restart_after_s": 1}]
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "demo", "--config", str(path),
                           "--timeout-s", "600"], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "job_failed" in proc.stdout and "pool_released" in proc.stdout, proc.stdout[-3000:]
    assert "the job ended without completing" in proc.stdout and "did not complete within" not in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.usefixtures("plain_script_job")
async def test_a_crash_looping_script_fails_after_three_tries_and_releases_everything(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(CRASH)
    config = _config(tmp_path, {"command": [str(script)], "target_steps": 100})
    sock = ["--socket", str(config.daemon.socket)]
    with rendezvous_process(config) as store:
        async with running_daemon(config, rendezvous=store, with_chaos=False) as sup:
            (failed,) = await _until(sup, lambda: _events(sup, "job_failed"), "job_failed")
            await _until(sup, lambda: _events(sup, "pool_released"), "pool_released")
            assert failed.data["failed_tries"] == 3
            # each failure of the workers came from the node's launcher (torchrun keeps its large budget,
            # which preemptions must not use up), the last one's error line with it
            assert "3 tries without progress" in failed.data["why"] and "the last workers_failed" in failed.data["why"]
            assert "FileNotFoundError: /data/shards" in failed.data["why"], failed.data["why"]
            assert any("FileNotFoundError: /data/shards" in ln for ln in failed.data["log_tail"]), failed.data["log_tail"]
            assert len(failed.data["log_tail"]) <= 20 and all(len(ln) <= 240 for ln in failed.data["log_tail"])
            # torchrun ran the script three times (its own restarts), then the daemon gave up: one node, once
            assert len(_instances(sup)) == 1 and len(_events(sup, "workers_failed")) >= 3
            assert _instance_processes(_instances(sup)) == [] and all(n.state.is_terminal() for n in sup.nodes.values())
            rc, out, err = await spotctl(*sock, "status")
            assert rc == 0 and "FAILED: 3 tries without progress" in out, out + err
            assert "failed: no capacity held (spotctl resume starts it again)" in out
            rc, out, err = await spotctl(*sock, "down")
            assert rc == 2 and err.strip().startswith("spotctl") and "the job is failed" in err, err
            assert len(err.strip().splitlines()) == 1

            rc, out, err = await spotctl(*sock, "resume", "--json")
            assert rc == 0, err
            assert json.loads(out)["was"] == "failed"
            await _until(sup, lambda: len(_instances(sup)) == 2, "a node bought again")
            assert sup.job.state is not JobState.FAILED and sup.store.get("job_end") is None


@pytest.mark.usefixtures("plain_script_job")
async def test_workers_failing_before_they_report_fail_the_job_at_the_third_failure(tmp_path: Path) -> None:
    """A status-reporting job whose workers fail before their first started line (here a
    module that does not import; on the H200 trial of 2026-12-04, NCCL refusing two ranks
    on one GPU): torchrun would restart them 1,000 times unseen, the first stall check
    15 minutes away. Each failure is reported with its error, and the third ends the job."""
    config = _config(tmp_path, {"module": "trainer.no_such_module", "target_steps": 100})
    with rendezvous_process(config) as store:
        async with running_daemon(config, rendezvous=store, with_chaos=False) as sup:
            (failed,) = await _until(sup, lambda: _events(sup, "job_failed"), "job_failed")
            reports = _events(sup, "workers_failed")
            assert [(r.data["failed_tries"], r.data["max_restarts_on_errors"], r.data["torchrun_restarts_left"])
                    for r in reports[:3]] == [(1, 3, 999), (2, 3, 998), (3, 3, 997)]
            assert "No module named trainer.no_such_module" in reports[0].data["last_line"], reports[0].data
            assert failed.data["failed_tries"] == 3 and "the last workers_failed" in failed.data["why"], failed.data
            assert not _events(sup, "job_stalled")
            await _until(sup, lambda: _events(sup, "pool_released"), "pool_released")
            rc, out, err = await spotctl("--socket", str(config.daemon.socket), "status")  # the cause, at a glance
            assert rc == 0 and "No module named trainer.no_such_module" in out, out + err


async def test_down_commits_releases_and_resume_continues_from_the_commit(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH"))
                                                      if p))
    config = _config(tmp_path, {"module": "e2e.paced_trainer", "target_steps": 100_000,
                                "checkpoint_interval_steps": 1000, "hold_timeout_s": 60,
                                "args": [*SMALL_MODEL, "--full-world", "1"]})
    sock = ["--socket", str(config.daemon.socket)]
    with rendezvous_process(config) as store:
        async with running_daemon(config, rendezvous=store, with_chaos=False) as sup:
            await _until(sup, lambda: (sup.job.step or 0) >= 5, "the job training", timeout_s=120)
            rc, out, err = await spotctl(*sock, "down", "--json")
            assert rc == 0, err
            reply = json.loads(out)
            assert reply["state"] == "cancelling" and reply["committing"] == ["demo-1"]
            (cancelled,) = await _until(sup, lambda: _events(sup, "job_cancelled"), "job_cancelled")
            await _until(sup, lambda: _events(sup, "pool_released"), "pool_released")
            (down,) = _events(sup, "job_cancelling")
            commit = cancelled.data["last_commit_step"]
            assert cancelled.data["committed"] is True and commit >= down.data["step"] >= 5
            on_disk = {m.step for m in list_committed(FileStore(config.daemon.state_path() / "checkpoints"))}
            assert commit in on_disk  # the commit is in the store, verified
            assert _instance_processes(_instances(sup)) == [] and all(n.state.is_terminal() for n in sup.nodes.values())
            rc, out, err = await spotctl(*sock, "status")
            assert "CANCELLED: spotctl down" in out, out

            rc, out, err = await spotctl(*sock, "resume", "--json")
            assert rc == 0, err
            assert json.loads(out) == {"state": "pending", "was": "cancelled", "target_nodes": 1,
                                       "resume_from_step": commit, "trainer_reports": True}
            resumed = await _until(sup, lambda: [e for e in _events(sup, "job_resumed") if e.seq > cancelled.seq],
                                   "job_resumed", timeout_s=120)
            assert resumed[0].data["resumed_from"] == commit and resumed[0].data["step"] == commit
            await _until(sup, lambda: (sup.job.step or 0) > commit, "steps past the commit", timeout_s=60)
