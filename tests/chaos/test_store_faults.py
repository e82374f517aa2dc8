"""Chaos cells: the object store fails during a notice's flush, and a notice arrives
during an upload.

**Store faults during the flush** (S3: moto behind ``fakes.aws_faults.AwsFaultProxy``;
OSS: ``fakes.oss.FakeOss``), through the real commit path
(:class:`trainer.integrations.common.DirCheckpointer`, one rank). Step 10 is committed;
a notice comes; the flush of step 20 meets the fault:

- ``5xx``: the next two requests answer 500 InternalError;
- ``timeout``: the shard upload gets no answer (the client's read timeout is 1 s);
- ``outage``: every request fails until after the notice's deadline.

The flush either retries within the notice's deadline and commits step 20 (S3:
botocore's own retries; OSS: ``OssStore``'s, on a server error), or fails, and then the previous checkpoint (10) stays the
latest committed, never the torn step 20: the worker exits, torchrun starts a new
one, which resumes from step 10 and answers the notice there (what a restarted
worker does, done here in-process). Either way the notice is answered before its
deadline (``outage``: it cannot be; step 10 stays the latest), the job then runs to
its final step, and every commit that was reported stays committed.

**A notice during an upload**: the reference trainer (``python -m trainer.run``) on OSS;
the upload of its periodic checkpoint is held at the store, the notice is written
meanwhile, then the upload goes through. The periodic commit does not claim the notice
(its node must not leave on it); the next step boundary commits for the notice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import torch
from botocore.config import Config as BotoConfig

from conftest import new_bucket
from chaos.conftest import Matrix
from fakes.aws_faults import AwsFaultProxy
from trainer.checkpoint import CheckpointError, CheckpointStore, S3Store, latest_committed, list_committed, scan
from trainer.guard import Decision, PreemptionGuard
from trainer.integrations.common import DirCheckpointer
from trainer.oss_store import OssStore
from trainer.runtime import DistContext, StatusWriter

pytestmark = pytest.mark.chaos

OSS_REGION = "cn-hangzhou"
S3_INTERNAL_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
                     "<Message>We encountered an internal error. Please try again.</Message>"
                     "<RequestId>C4A1A0S0F4U1L7T0</RequestId></Error>")
DEADLINE_S = 20.0  # the notice's lead in these cells (AWS gives 120 s, GCP 30 s)


class S3FaultProxy(AwsFaultProxy):
    """``AwsFaultProxy`` in front of moto's S3: S3 requests carry no EC2 ``Action``, so
    faults armed for action ``""`` hit the next S3 requests (a HEAD's ``Content-Length``,
    the object's size, passes through as boto3's downloads need)."""


@dataclass
class Faulty:
    """A store and its faults: ``arm(kind)`` before the flush, ``heal()`` after it."""

    name: str
    store: CheckpointStore
    arm: Callable[[str], None]
    heal: Callable[[], None]


@pytest.fixture(params=["s3", "oss"])
def faulty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Faulty]:
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = new_bucket(endpoint, "chaos")
        proxy = S3FaultProxy(endpoint)
        url = proxy.start()
        # the trainer's S3Store client (boto3's default retries), its read timeout cut to 1 s
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              config=BotoConfig(read_timeout=1, connect_timeout=1))

        def arm(kind: str) -> None:
            if kind == "5xx":
                proxy.reply_next("", S3_INTERNAL_ERROR, status=500, n=2)
            elif kind == "timeout":
                proxy.delay_next("", 3.0, after_forward=False)  # held, then it lands late
            else:
                proxy.reply_next("", S3_INTERNAL_ERROR, status=500, n=10_000)

        try:
            yield Faulty("s3", S3Store(f"s3://{bucket}/job", client=client), arm, proxy.reset)
        finally:
            proxy.close()
        return
    oss = request.getfixturevalue("oss_server")
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    oss.create_bucket(bucket)
    store = OssStore(f"oss://{bucket}/job", endpoint=oss.endpoint, region=OSS_REGION, timeout_s=1.0,
                     checkpoint_dir=tmp_path / "oss-resume")

    def arm_oss(kind: str) -> None:
        if kind == "5xx":
            oss.fail_next(2, status=500)
        elif kind == "timeout":
            oss.hang_next(1, op="PutObject")
        else:
            oss.fail_next(10_000, status=503)

    def heal_oss() -> None:
        oss.reset_faults()
        oss.release(drop=True)  # a held upload never lands

    try:
        yield Faulty("oss", store, arm_oss, heal_oss)
    finally:
        heal_oss()


def _save(step: int) -> Callable[[Path], None]:
    def save(folder: Path) -> None:  # what a framework leaves: a model file and a small one
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.pt").write_bytes(step.to_bytes(4, "big") * 50_000)
        (folder / "latest").write_text(f"step{step}")
    return save


def _worker(tmp_path: Path, store: CheckpointStore, attempt: str) -> DirCheckpointer:
    """One incarnation of a one-rank worker (a restart is a new one: a new guard)."""
    ctx = DistContext(0, 0, 1, None, torch.device("cpu"), False)
    return DirCheckpointer(ctx, store, tmp_path / "scratch", StatusWriter(str(tmp_path / "status.jsonl"), ctx, attempt),
                           PreemptionGuard(None), keep=10)


def _status_commits(tmp_path: Path) -> list[dict]:
    lines = [json.loads(x) for x in (tmp_path / "status.jsonl").read_text().splitlines()]
    return [x for x in lines if x["event"] == "checkpoint_committed"]


@pytest.mark.parametrize("fault", ["5xx", "timeout", "outage"])
def test_store_fault_during_the_notice_flush(faulty: Faulty, fault: str, tmp_path: Path, matrix: Matrix) -> None:
    store = faulty.store
    w = _worker(tmp_path, store, "a1")
    w.commit(10, _save(10), reason="periodic", decision=None, global_batch_size=8, data_position={"consumed": 80})
    reported = {10}
    decision = Decision(checkpoint=True, hold=True, notice_ids=("n-1",), kinds=("interruption",))
    deadline = time.monotonic() + DEADLINE_S

    faulty.arm(fault)
    try:
        w.commit(20, _save(20), reason="notice", decision=decision, global_batch_size=8,
                 data_position={"consumed": 160})
        reported.add(20)
        flushed = 20
    except CheckpointError:
        if fault == "outage":  # down past the deadline: the node is reclaimed with its step-20 state
            assert latest_committed_when_healed(faulty).step == 10
        else:
            faulty.heal()
        # never the torn one: the previous checkpoint stays the one resume takes
        assert latest_committed(store).step == 10
        assert not any(d.committed for d in scan(store) if d.step == 20)
        # the worker exits non-zero; its restart resumes from step 10 and answers the notice there
        w = _worker(tmp_path, store, "a2")
        manifest, local = w.fetch_latest()
        w.cleanup(local)
        assert manifest.step == 10
        if fault != "outage":  # the notice is still in the notice file: the new worker commits for it
            w.commit(10, _save(10), reason="notice", decision=decision, global_batch_size=8,
                     data_position={"consumed": 80})
        flushed = 10
    answered_in_time = time.monotonic() < deadline
    faulty.heal()

    # the job goes on from what resume takes, and completes
    w = _worker(tmp_path, store, "a3")
    manifest, local = w.fetch_latest()
    w.cleanup(local)
    resumed = manifest.step
    w.commit(30, _save(30), reason="final", decision=None, global_batch_size=8, data_position={"consumed": 240})
    reported.add(30)

    stored = {m.step: m for m in list_committed(store)}
    statuses = {c["step"] for c in _status_commits(tmp_path)}
    row = matrix.row(f"object store {fault} during the notice flush ({faulty.name})",
                     job_completed=latest_committed(store).step == 30,
                     lost_checkpoints=len(reported - set(stored)) + (resumed != flushed),
                     leaked_instances=0,
                     lost_events=len(set(stored) ^ statuses))  # a commit with no status line, or the reverse
    assert row.clean(), (row, sorted(stored), sorted(statuses), resumed, flushed)
    assert all(d.committed or d.step == 20 for d in scan(store))  # only the failed flush left a torn dir
    if fault == "outage":
        assert flushed == 10 and "n-1" not in stored[10].extra["notice_ids"]
    else:
        assert answered_in_time, "the notice was answered after its deadline"
        assert "n-1" in stored[flushed].extra["notice_ids"]
    if fault == "5xx" or (faulty.name == "s3" and fault == "timeout"):
        assert flushed == 20  # the store retried within the flush itself (botocore; OssStore's retries)


def latest_committed_when_healed(faulty: Faulty):
    """After an outage: the store comes back; what resume takes."""
    faulty.heal()
    return latest_committed(faulty.store)


# -- a notice arrives while the periodic checkpoint uploads -------------------------------------

REPO = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]


def test_notice_arriving_during_a_checkpoint_upload(oss_server, tmp_path: Path, matrix: Matrix) -> None:
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    oss_server.create_bucket(bucket)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", SPOTVISOR_NOTICE_FILE=str(tmp_path / "notices.json"),
               SPOTVISOR_STATUS_FILE=str(tmp_path / "status.jsonl"), SPOTVISOR_LOG_DIR=str(tmp_path / "logs"),
               SPOTVISOR_OSS_ENDPOINT=oss_server.endpoint, SPOTVISOR_OSS_REGION=OSS_REGION)
    uri = f"oss://{bucket}/job"
    oss_server.hang_next(1, op="PutObject")  # the first upload: step 3's shard (periodic)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.run", "--checkpoint-uri", uri, *TINY, "--target-steps", "6",
         "--checkpoint-interval", "3", "--keep-checkpoints", "10", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--hold-timeout-s", "0.3"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        held = oss_server.wait_hanging(timeout_s=90)
        assert held.key == "job/step-00000003/model.pt"
        notice = {"id": "n-upload", "kind": "interruption", "time": time.time(), "deadline": time.time() + 120}
        tmp = tmp_path / "notices.json.tmp"
        tmp.write_text(json.dumps([notice]))
        os.replace(tmp, tmp_path / "notices.json")  # as the agent writes it, mid-upload
        oss_server.release()  # the upload goes through
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        oss_server.reset_faults()
    assert proc.returncode == 0, out[-3000:]

    store = OssStore(uri, endpoint=oss_server.endpoint, region=OSS_REGION)
    stored = {m.step: m for m in list_committed(store)}
    commits = _status_commits(tmp_path)
    row = matrix.row("notice arriving during a checkpoint upload (trainer.run, OSS)",
                     job_completed=any(x["event"] == "completed" for x in
                                       map(json.loads, (tmp_path / "status.jsonl").read_text().splitlines())),
                     lost_checkpoints=len({c["step"] for c in commits} - set(stored)),
                     leaked_instances=0, lost_events=len(set(stored) ^ {c["step"] for c in commits}))
    assert row.clean(), (row, sorted(stored), commits)
    assert [(c["step"], c["reason"], c["notice_ids"]) for c in commits] == [
        (3, "periodic", []), (4, "notice", ["n-upload"]), (6, "final", [])]
    assert "n-upload" not in stored[3].extra["notice_ids"]  # the upload in flight did not claim it
    assert "n-upload" in stored[4].extra["notice_ids"]
    assert all(d.committed for d in scan(store))  # nothing torn
