"""End to end: ``python -m trainer.run`` as real processes (single process and torchrun/gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_files import status_lines, step_records, write_notices
from trainer.checkpoint import latest_committed, list_committed, open_store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(
        OMP_NUM_THREADS="1",
        SPOTVISOR_NOTICE_FILE=str(tmp / "notices.json"),
        SPOTVISOR_STATUS_FILE=str(tmp / "status.jsonl"),
        SPOTVISOR_LOG_DIR=str(tmp / "logs"),
    )
    env.update(extra)
    return env


def _trainer(tmp: Path, *args: str, torchrun: list[str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ([str(TORCHRUN), *torchrun, "-m", "trainer.run"] if torchrun else [sys.executable, "-m", "trainer.run"])
    cmd += ["--checkpoint-uri", (tmp / "ckpt").as_uri(), *TINY, *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


def test_single_process_periodic_and_final(tmp_path: Path) -> None:
    p = _trainer(tmp_path, "--target-steps", "12", "--checkpoint-interval", "5",
                 "--global-batch-size", "8", "--micro-batch-size", "2")
    assert p.returncode == 0, p.stderr
    status = status_lines(tmp_path)
    for rec in status:
        assert {"event", "time", "attempt", "rank", "world_size", "step"} <= rec.keys()
        assert rec["attempt"] == status[0]["attempt"] and rec["world_size"] == 1
    assert status[0]["event"] == "started" and status[0]["resumed_from"] is None
    assert [r["step"] for r in status if r["event"] == "step"] == list(range(1, 13))
    commits = [r for r in status if r["event"] == "checkpoint_committed"]
    assert [(c["step"], c["reason"]) for c in commits] == [(5, "periodic"), (10, "periodic"), (12, "final")]
    assert all(c["bytes"] > 0 and c["seconds"] >= 0 and c["notice_ids"] == [] for c in commits)
    assert status[-1]["event"] == "completed" and status[-1]["step"] == 12
    losses = [r["loss"] for r in status if r["event"] == "step"]
    assert losses[-1] < losses[0]
    store = open_store((tmp_path / "ckpt").as_uri())
    assert [m.step for m in list_committed(store)] == [12, 10, 5]
    m = latest_committed(store)
    assert m.data_position["consumed_samples"] == 12 * 8 and m.global_batch_size == 8
    steps = step_records(tmp_path)
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert [p for s in steps for p in s["positions"]] == list(range(12 * 8))


def test_notice_commit_hold_and_exact_resume(tmp_path: Path) -> None:
    common = ["--checkpoint-interval", "0", "--global-batch-size", "8", "--micro-batch-size", "4",
              "--hold-timeout-s", "0.5"]
    write_notices(tmp_path, ("c-1", "checkpoint"), ("i-1", "interruption"))
    a = _trainer(tmp_path, "--target-steps", "4", *common)
    assert a.returncode == 0, a.stderr
    sa = status_lines(tmp_path)
    events = [(r["event"], r["step"]) for r in sa if r["event"] != "step"]
    assert events == [("started", 0), ("checkpoint_committed", 0), ("holding", 0),
                      ("checkpoint_committed", 4), ("completed", 4)]
    first = sa[1]
    assert first["reason"] == "notice" and first["notice_ids"] == ["c-1", "i-1"]
    assert first["kinds"] == ["checkpoint", "interruption"]

    # A new notice waits at resume: step 4 is committed already, so nothing is
    # rewritten, but the manifest learns the id; the old ones are not acted on again.
    write_notices(tmp_path, ("c-1", "checkpoint"), ("i-1", "interruption"), ("c-2", "checkpoint"))
    b = _trainer(tmp_path, "--target-steps", "8", *common)
    assert b.returncode == 0, b.stderr
    sb = [r for r in status_lines(tmp_path)[len(sa):]]
    assert sb[0]["event"] == "started" and sb[0]["resumed_from"] == 4 and sb[0]["attempt"] != sa[0]["attempt"]
    commits = [r for r in sb if r["event"] == "checkpoint_committed"]
    assert [(c["step"], c["reason"], c["notice_ids"], c["reused"]) for c in commits] == [
        (4, "notice", ["c-2"], True), (8, "final", [], False)]
    assert not [r for r in sb if r["event"] == "holding"]
    store = open_store((tmp_path / "ckpt").as_uri())
    by_step = {m.step: m for m in list_committed(store)}
    assert "c-2" in by_step[4].extra["notice_ids"]
    assert by_step[8].extra["notice_ids"] == ["c-1", "i-1", "c-2"]
    steps = sorted(step_records(tmp_path), key=lambda s: s["time"])
    assert [s["step"] for s in steps] == list(range(1, 9))
    positions = [p for s in steps for p in s["positions"]]
    assert positions == list(range(8 * 8))  # continues exactly: no gap, no repeat


def test_refuses_changed_global_batch_and_bad_data(tmp_path: Path) -> None:
    ok = _trainer(tmp_path, "--target-steps", "1", "--global-batch-size", "4", "--micro-batch-size", "2")
    assert ok.returncode == 0, ok.stderr
    bad = _trainer(tmp_path, "--target-steps", "2", "--global-batch-size", "8", "--micro-batch-size", "2")
    assert bad.returncode == 2
    assert "global_batch_size 4, not 8" in bad.stderr and "Traceback" not in bad.stderr
    missing = _trainer(tmp_path, "--target-steps", "2", "--data", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].startswith("error: data file not found")


def test_torchrun_two_ranks_disjoint(tmp_path: Path) -> None:
    p = _trainer(tmp_path, "--target-steps", "6", "--checkpoint-interval", "3",
                 "--global-batch-size", "8", "--micro-batch-size", "2",
                 torchrun=["--standalone", "--nproc-per-node", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    steps = step_records(tmp_path)
    assert {s["rank"] for s in steps} == {0, 1} and {s["world_size"] for s in steps} == {2}
    assert len({s["attempt"] for s in steps}) == 1
    r0 = {p for s in steps if s["rank"] == 0 for p in s["positions"]}
    r1 = {p for s in steps if s["rank"] == 1 for p in s["positions"]}
    assert not r0 & r1 and sorted(r0 | r1) == list(range(6 * 8))
    status = status_lines(tmp_path)
    assert {r["rank"] for r in status} == {0}  # LOCAL_RANK 0 writes the node's status
    assert [(r["step"], r["reason"]) for r in status if r["event"] == "checkpoint_committed"] == [(3, "periodic"), (6, "final")]
    assert status[-1]["event"] == "completed" and status[-1]["world_size"] == 2


def test_torchrun_refuses_impossible_world_size(tmp_path: Path) -> None:
    p = _trainer(tmp_path, "--target-steps", "2", "--global-batch-size", "12", "--micro-batch-size", "2",
                 torchrun=["--standalone", "--nproc-per-node", "4"])
    assert p.returncode != 0
    assert "world size 4 cannot keep global_batch_size 12" in p.stderr
    assert "valid world sizes: 1, 2, 3, 6" in p.stderr


def test_torchrun_commits_to_s3_and_resumes(tmp_path: Path, s3_server: str) -> None:
    """The reference trainer's checkpoints over the real S3 protocol (moto's server)."""
    import boto3

    bucket = f"ckpt-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/job-1"
    env = _env(tmp_path, SPOTVISOR_S3_ENDPOINT_URL=s3_server)
    base = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "trainer.run", "--checkpoint-uri", uri,
            *TINY, "--global-batch-size", "8", "--micro-batch-size", "2", "--checkpoint-interval", "3"]
    first = subprocess.run(base + ["--target-steps", "4"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    store = open_store(uri, s3_endpoint_url=s3_server)
    assert [m.step for m in list_committed(store)] == [4, 3]
    second = subprocess.run(base + ["--target-steps", "6"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    assert latest_committed(store).step == 6
    started = [s for s in status_lines(tmp_path) if s["event"] == "started"]
    assert [s["resumed_from"] for s in started] == [None, 4]
    positions = sorted(p for r in step_records(tmp_path) for p in r["positions"])
    assert positions == list(range(6 * 8))  # no sample skipped or repeated across the resume
