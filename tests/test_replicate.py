"""trainer.replicate: a committed checkpoint copied between stores, verified, resumable.

Real stores throughout: directories, moto's S3 server (``s3_server``) and the OSS fake
spoken to by the real oss2 SDK (``oss_server``). A :class:`CountingStore` proxy
counts the bytes that really move, and cuts a copy by failing an upload.
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

import boto3
import pytest

from conftest import new_bucket
from trainer.checkpoint import (
    MANIFEST_NAME,
    FileStore,
    Manifest,
    S3Store,
    commit,
    latest_committed,
    load_shard,
    record_answered,
    scan,
    scan_step,
    step_dir,
    write_shard,
)
from trainer.oss_store import OssStore
from trainer.replicate import JOURNAL_NAME, Progress, ReplicationError, main, open_store_for, replicate
from trainer.storage import CheckpointStore, StorageError

KIB, MIB = 1024, 1024 * 1024
OSS_REGION = "cn-hangzhou"  # the region the oss_server fixture verifies signatures for
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


class CountingStore(CheckpointStore):
    """A real store behind a proxy that counts the bytes moved through it.

    ``cut_after_puts``: the upload after that many ``put_file`` calls fails with a
    StorageError before anything reaches the store (a copy cut mid-way).
    """

    def __init__(self, inner: CheckpointStore, *, cut_after_puts: int | None = None) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.cut_after_puts = cut_after_puts
        self.bytes_put = 0
        self.bytes_got = 0
        self.files_put: list[str] = []
        self.bytes_puts: list[str] = []

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)
        self.bytes_puts.append(key)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def list(self, prefix: str = "") -> dict[str, int]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def put_file(self, key: str, path) -> None:
        if self.cut_after_puts is not None and len(self.files_put) >= self.cut_after_puts:
            raise StorageError(f"uploading {path} to {self.uri}/{key}: connection reset (test cut)")
        self.inner.put_file(key, path)
        self.files_put.append(key)
        self.bytes_put += os.path.getsize(path)

    def get_file(self, key: str, path) -> None:
        self.inner.get_file(key, path)
        self.bytes_got += os.path.getsize(path)


def _checkpoint(store: CheckpointStore, step: int, sizes: dict[str, int]) -> Manifest:
    """Commit step ``step`` with random shards of ``sizes`` (name -> bytes)."""
    infos = [write_shard(store, step, name, os.urandom(size)) for name, size in sizes.items()]
    commit(store, Manifest(step=step, world_size=len(infos), global_batch_size=8,
                           data_position={"consumed_samples": 8 * step}, shards=infos, extra={"notice_ids": ["n-1"]}))
    manifest = scan_step(store, step)
    assert manifest is not None
    return manifest


def _same_bytes(a: CheckpointStore, b: CheckpointStore, manifest: Manifest) -> None:
    for s in manifest.shards:
        assert load_shard(b, manifest, s.name) == load_shard(a, manifest, s.name), s.name


@functools.cache
def _s3_client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")  # building one costs ~0.3 s


def _s3_store(endpoint: str) -> S3Store:
    return S3Store(f"s3://{new_bucket(endpoint, 'repl')}/job", client=_s3_client(endpoint), multipart_threshold=5 * MIB,
                   multipart_chunksize=5 * MIB)


def _oss_store(oss_server, resume_dir: Path, **kw) -> OssStore:
    bucket = f"repl-{uuid.uuid4().hex[:12]}"
    oss_server.create_bucket(bucket)
    options = dict(endpoint=oss_server.endpoint, region=OSS_REGION, multipart_threshold=100 * KIB,
                   part_size=100 * KIB, num_threads=4, checkpoint_dir=resume_dir)
    return OssStore(f"oss://{bucket}/job", **{**options, **kw})


SIZES = {"rank-0.pt": 1000, "rank-1.pt": 2000, "rank-2.pt": 4000, "dcp/rank-3.pt": 8000, "dcp/rank-4.pt": 16000}


@pytest.fixture
def files(tmp_path):
    """(src, dst, work_dir): two directory stores, src holding committed step 3 (SIZES) and a torn step 4."""
    src, dst = FileStore(tmp_path / "src"), FileStore(tmp_path / "dst")
    _checkpoint(src, 3, SIZES)
    write_shard(src, 4, "rank-0.pt", b"torn: no manifest")
    return src, dst, tmp_path / "work"


# --------------------------------------------------------------------------- copies


def test_file_to_file_takes_the_newest_committed_step_and_commits_it_last(files, tmp_path):
    src, dst, work = files
    seen: list[Progress] = []

    result = replicate(src, dst, work_dir=work, on_progress=seen.append)

    assert latest_committed(dst) == latest_committed(src) == result.manifest  # same manifest, time included
    _same_bytes(src, dst, result.manifest)
    total = sum(SIZES.values())
    assert (result.step, result.shards_copied, result.shards_skipped) == (3, 5, 0)
    assert result.bytes_copied == result.bytes_total == result.bytes_read_back == total
    assert result.seconds >= 0
    assert [p.shard for p in seen] == list(SIZES) and [p.action for p in seen] == ["copied"] * 5
    assert [p.bytes_done for p in seen] == [sum(list(SIZES.values())[: i + 1]) for i in range(5)]
    assert seen[-1].shards_done == seen[-1].shards_total == 5 and seen[-1].bytes_total == total
    assert sorted(p.name for p in work.iterdir()) == [".lock", JOURNAL_NAME]  # no staging left behind
    assert "replicated step 3" in result.summary() and "5 shards copied" in result.summary()

    older = _checkpoint(src, 1, {"a.pt": 10, "empty.pt": 0})
    assert replicate(src, dst, step=1, work_dir=work).manifest == older
    assert [d.step for d in scan(dst)] == [3, 1] and latest_committed(dst).step == 3


def test_s3_to_oss_and_back(s3_server, oss_server, tmp_path):
    """AWS -> Alibaba -> AWS: multipart on both sides, the manifest written last."""
    s3 = _s3_store(s3_server)
    # an empty shard too (e.g. a rank with no optimizer state)
    manifest = _checkpoint(s3, 7, {"model.pt": 6 * MIB, "optim/rank-0.pt": 3000, "optim/rank-1.pt": 0})
    oss = _oss_store(oss_server, tmp_path / "work" / "oss-resume", multipart_threshold=MIB, part_size=MIB)

    to_oss = replicate(s3, oss, work_dir=tmp_path / "work")

    assert (to_oss.step, to_oss.shards_copied, to_oss.bytes_copied) == (7, 3, 6 * MIB + 3000)
    assert latest_committed(oss) == manifest
    _same_bytes(s3, oss, manifest)
    writes = [s for s in oss_server.requests
              if s.bucket == oss.bucket and s.op in ("PutObject", "CompleteMultipartUpload") and s.status == 200]
    assert len([s for s in oss_server.ops("UploadPart") if s.bucket == oss.bucket]) == 6  # 6 MiB / 1 MiB
    assert writes[-1].key == f"job/{step_dir(7)}/{MANIFEST_NAME}" and len(writes) == 4

    back = _s3_store(s3_server)
    to_s3 = replicate(oss, back, work_dir=tmp_path / "work")

    assert (to_s3.step, to_s3.shards_copied, to_s3.shards_skipped) == (7, 3, 0)
    assert latest_committed(back) == manifest
    _same_bytes(s3, back, manifest)
    etag = _s3_client(s3_server).head_object(
        Bucket=back.bucket, Key=f"job/{step_dir(7)}/model.pt")["ETag"]
    assert etag.strip('"').endswith("-2")  # 6 MiB went up in two 5 MiB-sized parts


def test_the_migrations_copy_takes_a_commit_newer_than_the_recorded_one(tmp_path):
    """A migration asks for the recorded commit (step 60) but the drain's commit (step 67)
    is in the source's store, its report lost with the node that wrote it (HA job trial 23
    of seed 29 lost 7 steps this way): the copy moves step 67, verified. A newer torn step
    does not count."""
    from daemon.config import Config
    from daemon.controlnode.migrator import copy_checkpoint

    state = tmp_path / "state"
    state.mkdir()
    config = Config.model_validate({
        "pool": {"name": "mig", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "j", "checkpoint_uri": "file://{state_dir}/ck-a"},
        "daemon": {"state_dir": str(state)},
        "providers": {"local": {}},
        "domains": [{"name": "a", "provider": "local", "region": "a"},
                    {"name": "b", "provider": "local", "region": "b", "checkpoint_uri": "file://{state_dir}/ck-b",
                     "rendezvous": {"host": "127.0.0.1", "port": 29411}}],
        "offers": [{"provider": "local", "region": r, "zone": f"{r}-1", "instance_type": "local.cpu"} for r in "ab"],
    })
    src, dst = FileStore(state / "ck-a"), FileStore(state / "ck-b")
    _checkpoint(src, 60, SIZES)
    drain = _checkpoint(src, 67, SIZES)
    write_shard(src, 68, "rank-0.pt", b"torn: no manifest")
    result = copy_checkpoint(config, "a", "b", 60)
    assert result["step"] == 67 and result["shards_copied"] == len(SIZES)
    assert latest_committed(dst) == drain
    _same_bytes(src, dst, drain)
    assert copy_checkpoint(config, "a", "b", 67)["step"] == 67  # the recorded one when it is the newest


# --------------------------------------------------------------------------- resume


def _cut_after_two(src, dst, work, how: str) -> None:
    """Replicate SIZES' step, cut after 2 of 5 shards are at dst."""
    if how == "progress":
        def stop(p: Progress) -> None:
            if p.shards_done == 2:
                raise KeyboardInterrupt("cut")

        with pytest.raises(KeyboardInterrupt):
            replicate(src, dst, work_dir=work, on_progress=stop)
    else:
        with pytest.raises(StorageError, match="test cut"):
            replicate(src, CountingStore(dst, cut_after_puts=2), work_dir=work)


@pytest.mark.parametrize("how", ["progress", "upload"])
def test_a_cut_copy_resumes_with_only_the_remainder(files, how):
    src, dst, work = files
    _cut_after_two(src, dst, work, how)
    sizes = list(SIZES.values())
    remainder = sum(sizes[2:])

    src_count, dst_count = CountingStore(src), CountingStore(dst)
    result = replicate(src_count, dst_count, work_dir=work)

    assert (result.shards_copied, result.shards_skipped) == (3, 2)
    assert dst_count.bytes_put == result.bytes_copied == remainder
    assert dst_count.bytes_got == result.bytes_read_back == remainder  # the journal vouches for the first two
    # Cut inside the third upload: its staging copy is reused, the source is not read again for it.
    assert src_count.bytes_got == (remainder if how == "progress" else sum(sizes[3:]))
    assert latest_committed(dst) == result.manifest
    _same_bytes(src, dst, result.manifest)


def test_without_the_journal_a_resume_reads_back_but_does_not_upload_again(files, tmp_path):
    src, dst, work = files
    _cut_after_two(src, dst, work, "progress")
    dst_count = CountingStore(dst)

    result = replicate(src, dst_count, work_dir=tmp_path / "another-work-dir")

    sizes = list(SIZES.values())
    assert (result.shards_copied, result.shards_skipped) == (3, 2)
    assert dst_count.bytes_put == sum(sizes[2:])
    assert dst_count.bytes_got == result.bytes_read_back == sum(sizes)
    _same_bytes(src, dst, result.manifest)


def test_a_torn_copy_is_never_resumed_from(s3_server, tmp_path):
    src = FileStore(tmp_path / "src")
    _checkpoint(src, 1, {"rank-0.pt": 500})
    manifest = _checkpoint(src, 2, SIZES)
    dst = _s3_store(s3_server)
    replicate(src, dst, step=1, work_dir=tmp_path / "work")

    with pytest.raises(StorageError, match="test cut"):
        replicate(src, CountingStore(dst, cut_after_puts=2), work_dir=tmp_path / "work")

    keys = dst.list(step_dir(2) + "/")
    assert sorted(keys) == [f"{step_dir(2)}/rank-0.pt", f"{step_dir(2)}/rank-1.pt"]  # no manifest
    assert latest_committed(dst).step == 1
    assert scan_step(dst, 2) is None
    assert [(d.step, d.reason) for d in scan(dst)] == [(2, "no manifest"), (1, None)]

    replicate(src, dst, work_dir=tmp_path / "work")
    assert latest_committed(dst) == manifest


@pytest.mark.timeout(60)
def test_a_big_shard_cut_in_its_oss_upload_resumes_at_the_part_level(oss_server, tmp_path):
    src = FileStore(tmp_path / "src")
    manifest = _checkpoint(src, 5, {"model.pt": MIB + 5})  # 11 parts of 100 KiB
    work = tmp_path / "work"
    dst = _oss_store(oss_server, work / "oss-resume", max_attempts=1)

    def parts_sent() -> int:
        return len([s for s in oss_server.ops("UploadPart") if s.bucket == dst.bucket and s.status == 200])

    oss_server.fail_next(1, status=500, op="CompleteMultipartUpload")
    try:
        with pytest.raises(StorageError, match="InternalError"):
            replicate(src, dst, work_dir=work)
    finally:
        oss_server.reset_faults()
    assert parts_sent() == 11 and len(oss_server.uploads(dst.bucket)) == 1
    assert dst.list(step_dir(5)) == {}

    src_count = CountingStore(src)
    result = replicate(src_count, dst, work_dir=work)

    assert parts_sent() == 11  # every part was already there: only the complete went out
    assert src_count.bytes_got == 0  # the staging copy in work_dir was reused
    assert result.shards_copied == 1 and oss_server.uploads(dst.bucket) == {}
    _same_bytes(src, dst, manifest)


def test_open_store_for_keeps_oss_part_records_in_the_work_dir(oss_server, tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTVISOR_OSS_REGION", OSS_REGION)
    oss_server.create_bucket("repl-open-for")
    store = open_store_for("oss://repl-open-for/job", tmp_path / "work", oss_endpoint=oss_server.endpoint)
    assert isinstance(store, OssStore) and Path(store._record_root) == tmp_path / "work" / "oss-resume"
    assert store.list() == {}
    assert isinstance(open_store_for((tmp_path / "d").as_uri(), tmp_path / "work"), FileStore)


# --------------------------------------------------------------------------- refusals and repairs


def test_a_corrupt_source_is_refused(files):
    src, dst, work = files
    src.put_bytes(f"{step_dir(3)}/rank-1.pt", os.urandom(SIZES["rank-1.pt"]))  # same size, other bytes

    with pytest.raises(ReplicationError, match=r"source is corrupt: step 3 shard rank-1.pt .* refusing") as info:
        replicate(src, dst, work_dir=work)

    assert "\n" not in str(info.value)
    assert sorted(dst.list()) == [f"{step_dir(3)}/rank-0.pt"]  # nothing of the bad shard, no manifest
    assert latest_committed(dst) is None
    assert list((work / "staging").iterdir()) == []


def test_a_wrong_leftover_at_dst_is_overwritten_never_trusted(files):
    src, dst, work = files
    prefix = step_dir(3) + "/"
    dst.put_bytes(prefix + "rank-0.pt", os.urandom(SIZES["rank-0.pt"]))  # right size, wrong bytes
    dst.put_bytes(prefix + "rank-1.pt", b"short")  # torn
    manifest = latest_committed(src)
    dst.put_bytes(prefix + "rank-2.pt", load_shard(src, manifest, "rank-2.pt"))  # a good leftover

    result = replicate(src, dst, work_dir=work)

    assert (result.shards_copied, result.shards_skipped) == (4, 1)
    _same_bytes(src, dst, manifest)
    assert latest_committed(dst) == manifest

    # A journaled shard that changed size at dst since is copied again.
    dst.put_bytes(prefix + "dcp/rank-4.pt", b"truncated")
    again = replicate(src, dst, work_dir=work)
    assert (again.shards_copied, again.shards_skipped, again.bytes_copied) == (1, 4, SIZES["dcp/rank-4.pt"])
    _same_bytes(src, dst, manifest)


def test_a_rerun_on_a_complete_step_is_a_no_op(files, tmp_path):
    src, dst, work = files
    first = replicate(src, dst, work_dir=work)
    dst_count = CountingStore(dst)

    again = replicate(src, dst_count, work_dir=work)

    assert (again.step, again.shards_copied, again.shards_skipped, again.bytes_copied) == (3, 0, 5, 0)
    assert dst_count.bytes_put == dst_count.bytes_got == 0 and dst_count.bytes_puts == []  # manifest untouched
    assert latest_committed(dst) == first.manifest

    fresh = replicate(src, dst_count, work_dir=tmp_path / "fresh")  # no journal: verified by reading back
    assert (fresh.shards_copied, fresh.shards_skipped) == (0, 5)
    assert dst_count.bytes_put == 0 and dst_count.bytes_got == sum(SIZES.values())


def test_a_newer_extra_at_the_source_updates_the_manifest_alone(files):
    src, dst, work = files
    first = replicate(src, dst, work_dir=work)
    newer = record_answered(src, first.manifest, ["n-1", "n-2"])

    again = replicate(src, dst, work_dir=work)

    assert again.shards_copied == 0 and latest_committed(dst) == newer
    assert latest_committed(dst).extra["notice_ids"] == ["n-1", "n-2"]


def test_another_checkpoint_at_that_step_in_dst_is_refused_untouched(files):
    src, dst, work = files
    other = _checkpoint(dst, 3, {"rank-0.pt": 1000})

    with pytest.raises(ReplicationError, match="step 3 in .* is already committed with another checkpoint"):
        replicate(src, dst, work_dir=work)

    assert latest_committed(dst) == other and sorted(dst.list()) == [f"{step_dir(3)}/{MANIFEST_NAME}",
                                                                      f"{step_dir(3)}/rank-0.pt"]


def test_nothing_committed_or_a_bad_request_is_refused(tmp_path):
    src, dst, work = FileStore(tmp_path / "src"), FileStore(tmp_path / "dst"), tmp_path / "work"
    with pytest.raises(ReplicationError, match="^no committed checkpoint in file://"):
        replicate(src, dst, work_dir=work)
    write_shard(src, 2, "rank-0.pt", b"torn")
    with pytest.raises(ReplicationError, match="^no committed checkpoint"):
        replicate(src, dst, work_dir=work)
    _checkpoint(src, 1, {"rank-0.pt": 10})
    with pytest.raises(ReplicationError, match="^step 2 is not committed in"):
        replicate(src, dst, step=2, work_dir=work)
    with pytest.raises(ValueError, match="same store"):
        replicate(src, FileStore(tmp_path / "src"), work_dir=work)
    with pytest.raises(ValueError, match="step must be"):
        replicate(src, dst, step=-1, work_dir=work)
    assert dst.list() == {}


def test_one_replication_at_a_time_per_work_dir(files):
    src, dst, work = files
    work.mkdir()
    with open(work / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ReplicationError, match="in use by another replication"):
            replicate(src, dst, work_dir=work)
    assert replicate(src, dst, work_dir=work).shards_copied == 5


# --------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.replicate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cli_copies_and_prints_one_line(files, capsys):
    src, dst, work = files
    proc = _cli(src.uri, dst.uri, "--work-dir", str(work))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"replicated step 3 from {src.uri} to {dst.uri}: 5 shards copied, 0 already there")
    assert proc.stdout.count("\n") == 1 and proc.stderr == ""
    assert latest_committed(dst).step == 3

    assert main([src.uri, dst.uri, "--step", "9", "--work-dir", str(work)]) == 1
    err = capsys.readouterr().err
    assert err == f"python -m trainer.replicate: replication failed: step 9 is not committed in {src.uri}\n"


def test_cli_bad_uri_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPOTVISOR_OSS_ENDPOINT", raising=False)
    proc = _cli("ftp://host/x", "file:///tmp/x", "--work-dir", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("python -m trainer.replicate: error: unsupported checkpoint URI 'ftp://host/x': "
                           "use file:///abs/path, s3://bucket/prefix or oss://bucket/prefix\n")
    for uris in (["file:///tmp/x", "s3://"], ["file:///tmp/x", "file://relative/x"], ["oss://b/x", "file:///tmp/x"]):
        assert main([*uris, "--work-dir", str(tmp_path)]) == 2, uris
        err = capsys.readouterr().err
        assert err.startswith("python -m trainer.replicate: error: ") and err.count("\n") == 1, err
