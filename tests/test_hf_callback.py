"""The one-line HF path: ``trainer.add_callback(SpotvisorCallback())`` on a vanilla script.

The script is tests/e2e/hf_user/train.py (the user's own ``Trainer``, ``TrainingArguments``
and dataset), run under real ``torchrun`` (gloo, CPU) through
``trainer.integrations.hf_launch`` as the daemon starts a ``job.command`` job with
``job.output_dir``. ``SPOTVISOR_LOG_INPUTS=1``: each step log line carries a digest of
every ``input_ids`` row the model was really fed, so "exact data position" is checked
from the model's side.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.config import Config, load_config
from daemon.controlnode.jobspec import job_spec
from daemon.model import Node
from trainer.checkpoint import FileStore, latest_committed, step_dir
from trainer.contract import HOLD_TIMEOUT_ENV
from trainer.integrations.hf_launch import LaunchError, accelerate_env

REPO = Path(__file__).resolve().parents[1]
USER = REPO / "tests" / "e2e" / "hf_user"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_the_script_is_the_vanilla_one_plus_the_import_and_add_callback() -> None:
    vanilla = (USER / "vanilla_train.py").read_text().splitlines()
    ours = (USER / "train.py").read_text().splitlines()
    added = [l for l in difflib.ndiff(vanilla, ours) if l.startswith(("+ ", "- "))]
    assert [l for l in added if l.strip("+- ")] == [
        "+ from trainer.integrations.hf import SpotvisorCallback",
        "+     trainer.add_callback(SpotvisorCallback())",
    ]


def _job(**job: object) -> Config:
    config = load_config(REPO / "configs" / "local.yaml")
    return Config.model_validate({**config.model_dump(mode="json", exclude_unset=True),
                                  "job": {**config.job.model_dump(mode="json", exclude_unset=True,
                                                                  exclude={"module", "args", "grow"}), **job}})


def test_output_dir_and_accelerate_config_run_the_script_through_the_restore() -> None:
    node = Node(id="n1", ordinal=1, provider="local", region="local", zone=None, instance_type="t", gpus=2,
                price_usd_h=0.0, token="x")
    # job.workdir: each local node runs in its own copy of it, so "out" is each node's own
    config = _job(command="train.py --lr 3e-4", output_dir="out", accelerate_config="ds_zero2.yaml",
                  hold_timeout_s=45, workdir=str(USER))
    spec = job_spec(config, node, "abc")
    argv = spec["argv"]
    assert argv[argv.index("--monitor-interval=0.5") + 1:] == [
        "-m", "trainer.integrations.hf_launch", "--output-dir", "out", "--accelerate-config", "ds_zero2.yaml", "--",
        "train.py", "--lr", "3e-4"]
    assert spec["env"][HOLD_TIMEOUT_ENV] == "45"
    plain = job_spec(_job(command="train.py"), node, "abc")["argv"]  # no HF field: the script alone
    assert plain[plain.index("--monitor-interval=0.5") + 1:] == ["train.py"]


def test_output_dir_without_a_command_is_one_config_error() -> None:
    with pytest.raises(ValueError, match="output_dir: needs job.command"):
        Config.model_validate({**load_config(REPO / "configs" / "local.yaml").model_dump(mode="json",
                                                                                        exclude_unset=True),
                               "job": {"output_dir": "out"}})


def test_accelerate_config_gives_the_environment_accelerate_launch_would() -> None:
    env = accelerate_env(USER / "ds_zero2.yaml", base={})
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert not {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PYTHONPATH"} & set(env)  # torchrun's
    with pytest.raises(LaunchError, match="job.accelerate_config: nope.yaml not found"):
        accelerate_env("nope.yaml", base={})


# --------------------------------------------------------------------------- torchrun


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "SPOTVISOR_NOTICE_FILE": str(tmp / "notices.json"), "SPOTVISOR_STATUS_FILE": str(tmp / "status.jsonl"),
            "SPOTVISOR_LOG_DIR": str(tmp / "logs"), "SPOTVISOR_SCRATCH_DIR": str(tmp / "scratch"),
            "SPOTVISOR_CHECKPOINT_URI": f"file://{tmp / 'ckpt'}", "SPOTVISOR_LOG_INPUTS": "1",
            "SPOTVISOR_HOLD_TIMEOUT_S": "1", **extra}


def _argv(nproc: int, steps: int, *, restore: bool = True) -> list[str]:
    launch = ["-m", "trainer.integrations.hf_launch", "--output-dir", "out", "--"] if restore else []
    return [str(TORCHRUN), f"--nproc-per-node={nproc}", "--standalone", *launch, str(USER / "train.py"),
            "--max-steps", str(steps), "--save-steps", "4"]


def _run(tmp: Path, nproc: int, steps: int, *, restore: bool = True) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(_argv(nproc, steps, restore=restore), cwd=tmp, env=_env(tmp), capture_output=True,
                          text=True, timeout=240)


def _lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _fed(tmp: Path) -> dict[int, list[str]]:
    """Step → the input rows (digests) the model was fed at it, every rank, in rank order;
    for a step run twice, its last execution (the lineage)."""
    by_attempt: dict[tuple[float, str], dict[int, dict[int, list[str]]]] = {}
    for f in sorted((tmp / "logs").glob("steps-*.jsonl")):
        for r in _lines(f):
            key = next((k for k in by_attempt if k[1] == r["attempt"]), None) or (r["time"], r["attempt"])
            by_attempt.setdefault(key, {}).setdefault(r["step"], {})[r["rank"]] = r["inputs"]
    out: dict[int, list[str]] = {}
    for key in sorted(by_attempt):
        for step, ranks in by_attempt[key].items():
            out[step] = [d for rank in sorted(ranks) for d in ranks[rank]]
    return out


@pytest.mark.slow
def test_sigterm_saves_on_every_rank_at_one_step_and_resume_feeds_the_exact_rows(tmp_path: Path) -> None:
    # the reference: 16 steps, never interrupted
    ref = _run(tmp_path / "ref", 2, 16)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = _fed(tmp_path / "ref")
    assert sorted(want) == list(range(1, 17)) and all(len(v) == 8 for v in want.values())
    assert len({d for v in want.values() for d in v}) == 128  # distinct rows: a repeat would show

    # SIGTERM to torchrun mid-run (what the agent does for a job.command on a notice): it
    # forwards it to every worker and waits for them (the daemon sets its shutdown timeout
    # past any cloud's lead)
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen(_argv(2, 8), cwd=run, env=_env(run, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="120"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = run / "status.jsonl"
    deadline = time.monotonic() + 120
    while not any(l["event"] == "step" for l in _lines(status)):  # polls the status file the worker writes
        assert proc.poll() is None and time.monotonic() < deadline, "no step"
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    # every worker committed at one step boundary and ended (143) there: none held for a
    # restart its own stopping torchrun would never start (the node then waited for the cloud
    # to take it, the whole notice lead), none trained on
    assert time.monotonic() - t0 < 60, err[-3000:]
    assert proc.returncode != 0, err[-3000:]  # torchrun stopped by the signal: never 0 mid-job
    commits = [l for l in _lines(status) if l["event"] == "checkpoint_committed"]
    noticed = [c for c in commits if any(n.startswith("sigterm-") for n in c["notice_ids"])]
    # one commit answers both workers' signals (each its own sigterm notice id)
    assert len(noticed) == 1 and set(noticed[0]["kinds"]) == {"interruption"}, commits
    n = noticed[0]["step"]
    assert not [l for l in _lines(status) if l["event"] == "holding"]
    assert max(l["step"] for l in _lines(status) if l["event"] == "step") == n  # nobody trained past it
    assert "answered by the commit of step" in err, err[-3000:]
    store = FileStore(f"file://{run / 'ckpt'}")
    last = latest_committed(store)
    assert last is not None and last.step == n and last.world_size == 2 and last.extra["format"] == "hf-trainer"
    names = {s.name for s in last.shards}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= names  # every rank's files

    # a torn newer one (no manifest) in the store and an uncommitted folder in output_dir
    torn = run / "ckpt" / step_dir(12)
    torn.mkdir(parents=True)
    (torn / "trainer_state.json").write_text("{}")
    (run / "out" / "checkpoint-11").mkdir(parents=True)

    resumed = _run(run, 2, 16)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"restored committed step {n}" in resumed.stderr
    assert _fed(run) == want  # the same rows at every step: nothing seen twice, nothing skipped


@pytest.mark.slow
def test_fail_closed_without_resume_or_at_another_global_batch(tmp_path: Path) -> None:
    first = _run(tmp_path, 2, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    # no restore (no job.output_dir): the script finds no checkpoint and would start over
    again = _run(tmp_path, 1, 8, restore=False)
    assert again.returncode != 0
    line = next(l for l in again.stderr.splitlines() if l.startswith("spotvisor:"))
    assert "step 4 is committed" in line and "resume_from_checkpoint=True" in line and "job.output_dir" in line
    assert "hf_env.py" not in again.stderr  # one line, no worker traceback (torchrun's own summary follows)
    # restored, but at world size 1 the user's fixed accumulation makes a global batch of 4, not 8
    other = _run(tmp_path, 1, 8)
    assert other.returncode != 0
    line = next(l for l in other.stderr.splitlines() if l.startswith("spotvisor:"))
    assert "global batch of 8" in line and "pool.min_nodes = pool.max_nodes" in line
    assert latest_committed(FileStore(f"file://{tmp_path / 'ckpt'}")).step == 4  # nothing committed over it
