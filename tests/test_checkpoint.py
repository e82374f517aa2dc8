"""Checkpoint commit protocol, against a local directory and a real (moto) S3 server."""

from __future__ import annotations

import contextlib
import json
import os

import boto3
import pytest
from botocore.exceptions import ClientError

from conftest import new_bucket
from trainer.checkpoint import (
    CheckpointError,
    CommitConflictError,
    CorruptCheckpointError,
    FileStore,
    Manifest,
    MissingShardError,
    ObjectNotFoundError,
    S3Store,
    ShardInfo,
    StorageError,
    commit,
    discard,
    gc,
    latest_committed,
    list_committed,
    load_shard,
    open_store,
    scan,
    step_dir,
    write_shard,
)

MIB = 1024 * 1024


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    """Each test runs against a fresh FileStore and a fresh S3 bucket (with a key prefix)."""
    if request.param == "file":
        return FileStore(tmp_path.as_uri())
    endpoint = request.getfixturevalue("s3_server")
    return S3Store(f"s3://{new_bucket(endpoint, 'ckpt')}/runs/job-1", endpoint_url=endpoint)


def _shard_bytes(step: int, rank: int, size: int = 1000) -> bytes:
    seed = f"step {step} rank {rank} ".encode()
    return (seed * (size // len(seed) + 1))[:size]


def save(store, step: int, *, world_size: int = 2, data_position: dict | None = None, commit_it: bool = True):
    """What a 2-rank job does at a checkpoint: each rank writes its shard, rank 0 commits."""
    shards = tuple(write_shard(store, step, f"rank-{r}.pt", _shard_bytes(step, r)) for r in range(world_size))
    manifest = Manifest(
        step=step,
        world_size=world_size,
        global_batch_size=64,
        data_position={"consumed_samples": 64 * step, "seed": 0} if data_position is None else data_position,
        shards=shards,
        time=1_700_000_000.0 + step,
        extra={"notice_ids": [f"n-{step}"]},
    )
    if commit_it:
        commit(store, manifest)
    return manifest


def key(step: int, name: str) -> str:
    return f"{step_dir(step)}/{name}"


# --------------------------------------------------------------------------- round trip and selection


def test_round_trip_commit_and_load(store):
    written = save(store, 7)

    got = latest_committed(store)

    assert got == written
    assert got.data_position == {"consumed_samples": 448, "seed": 0}
    assert got.extra == {"notice_ids": ["n-7"]}
    for rank in range(2):
        assert load_shard(store, got, f"rank-{rank}.pt") == _shard_bytes(7, rank)


def test_empty_store_has_no_checkpoint(store):
    assert latest_committed(store) is None
    assert list_committed(store) == []


def test_latest_is_newest_by_number_not_by_name(store):
    # 100000000 sorts before 99999999 as a string; resume must still take it.
    for step in (3, 100_000_000, 99_999_999, 5):
        save(store, step)

    assert latest_committed(store).step == 100_000_000
    assert [m.step for m in list_committed(store)] == [100_000_000, 99_999_999, 5, 3]


def _tear_shard_missing(store, m):
    store.put_bytes(key(2, "manifest.json"), m.to_json().encode())
    store.delete([key(2, "rank-1.pt")])


def _tear_short_shard(store, m):
    store.put_bytes(key(2, "manifest.json"), m.to_json().encode())
    store.put_bytes(key(2, "rank-1.pt"), _shard_bytes(2, 1)[:-1])


def _tear_no_manifest(store, m):
    pass  # shards written, rank 0 died before commit


def _tear_garbage_manifest(store, m):
    store.put_bytes(key(2, "manifest.json"), b"\x00\xffnot json{")


def _tear_truncated_manifest(store, m):
    text = m.to_json().encode()
    store.put_bytes(key(2, "manifest.json"), text[: len(text) // 2])


def _tear_manifest_of_other_step(store, m):
    other = Manifest(**{**m.__dict__, "step": 3})
    store.put_bytes(key(2, "manifest.json"), other.to_json().encode())


@pytest.mark.parametrize(
    "tear",
    [
        _tear_shard_missing,
        _tear_short_shard,
        _tear_no_manifest,
        _tear_garbage_manifest,
        _tear_truncated_manifest,
        _tear_manifest_of_other_step,
    ],
    ids=lambda f: f.__name__.removeprefix("_tear_"),
)
def test_torn_checkpoint_is_never_selected(store, tear):
    good = save(store, 1)
    torn = save(store, 2, commit_it=False)
    tear(store, torn)

    assert latest_committed(store) == good
    assert [m.step for m in list_committed(store)] == [1]
    assert load_shard(store, good, "rank-0.pt") == _shard_bytes(1, 0)
    # A torn directory newer than the newest committed one may be in progress: gc leaves it.
    assert gc(store) == []
    assert store.list(step_dir(2) + "/")


def test_corrupted_shard_same_size_fails_at_load(store):
    m = save(store, 4)
    data = bytearray(_shard_bytes(4, 1))
    data[500] ^= 0xFF
    store.put_bytes(key(4, "rank-1.pt"), bytes(data))

    # Listing only checks sizes (cheap), so the checkpoint still looks committed ...
    assert latest_committed(store) == m
    # ... but loading the bad shard refuses, and the good one still loads.
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        load_shard(store, m, "rank-1.pt")
    assert load_shard(store, m, "rank-0.pt") == _shard_bytes(4, 0)


def test_shard_deleted_after_listing_fails_at_load(store):
    m = save(store, 4)
    store.delete([key(4, "rank-0.pt")])

    with pytest.raises(CorruptCheckpointError, match="missing"):
        load_shard(store, m, "rank-0.pt")


def test_load_unknown_shard_names_the_real_ones(store):
    m = save(store, 4)

    with pytest.raises(KeyError, match="rank-0.pt"):
        load_shard(store, m, "rank-9.pt")


# --------------------------------------------------------------------------- commit


def test_commit_refuses_when_a_shard_is_missing_or_short(store):
    m = save(store, 2, commit_it=False)
    store.delete([key(2, "rank-1.pt")])

    with pytest.raises(MissingShardError, match="rank-1.pt"):
        commit(store, m)
    assert key(2, "manifest.json") not in store.list()

    store.put_bytes(key(2, "rank-1.pt"), b"short")
    with pytest.raises(MissingShardError, match="5 bytes"):
        commit(store, m)
    assert latest_committed(store) is None


def test_commit_is_idempotent(store):
    m = save(store, 3)
    stored = store.get_bytes(key(3, "manifest.json"))

    commit(store, m)
    # A retry that rebuilt the manifest (new commit time) is the same checkpoint.
    commit(store, Manifest(**{**m.__dict__, "time": m.time + 60}))

    assert store.get_bytes(key(3, "manifest.json")) == stored
    assert [x.step for x in list_committed(store)] == [3]


def test_commit_conflict_keeps_the_first_manifest(store):
    m = save(store, 3)
    other = Manifest(**{**m.__dict__, "data_position": {"consumed_samples": 1, "seed": 0}})

    with pytest.raises(CommitConflictError, match="step 3"):
        commit(store, other)
    assert latest_committed(store) == m


def test_commit_over_an_unparsable_manifest(store):
    # Step 2 was torn with a garbage manifest; the resumed job reaches step 2 again.
    save(store, 1)
    m = save(store, 2, commit_it=False)
    store.put_bytes(key(2, "manifest.json"), b"garbage")

    commit(store, m)

    assert latest_committed(store) == m


def test_discard_removes_a_committed_step(store):
    save(store, 1)
    save(store, 2)

    assert discard(store, 2) is True
    assert discard(store, 2) is False
    assert latest_committed(store).step == 1
    assert store.list(step_dir(2) + "/") == {}


# --------------------------------------------------------------------------- gc


def test_gc_keeps_newest_and_leaves_in_progress_alone(store):
    save(store, 5, commit_it=False)
    store.put_bytes(key(5, "manifest.json"), b"{")  # torn, older
    save(store, 10)
    save(store, 20, commit_it=False)  # torn, older (no manifest)
    save(store, 30)
    save(store, 40)
    save(store, 50, commit_it=False)  # newer than newest committed: maybe in progress

    assert gc(store, keep=2) == ["step-00000005", "step-00000010", "step-00000020"]

    remaining = {k.split("/")[0] for k in store.list()}
    assert remaining == {"step-00000030", "step-00000040", "step-00000050"}
    assert store.get_bytes(key(50, "rank-1.pt")) == _shard_bytes(50, 1)
    assert [m.step for m in list_committed(store)] == [40, 30]
    assert gc(store, keep=2) == []

    assert gc(store, keep=1) == ["step-00000030"]
    assert latest_committed(store).step == 40


class _DeleteFailsAfter:
    """Wraps a store; the (n+1)-th delete() call raises StorageError, as a crash mid-gc would stop it."""

    def __init__(self, inner, n: int) -> None:
        self._inner, self._left = inner, n
        self.uri = inner.uri

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def delete(self, keys):
        if self._left == 0:
            raise StorageError("injected failure")
        self._left -= 1
        self._inner.delete(keys)


def test_interrupted_gc_never_leaves_a_committed_looking_torn_dir(store):
    save(store, 1)
    save(store, 2)

    with pytest.raises(StorageError, match="injected"):
        gc(_DeleteFailsAfter(store, 1), keep=1)  # first delete succeeds, second fails

    # Step 1 lost something; whatever it lost, it must no longer look committed.
    assert [m.step for m in list_committed(store)] == [2]
    assert gc(store, keep=1) == ["step-00000001"]
    assert store.list(step_dir(1) + "/") == {}


def test_gc_without_committed_checkpoint_deletes_nothing(store):
    save(store, 1, commit_it=False)
    save(store, 2, commit_it=False)

    assert gc(store, keep=1) == []
    assert len(store.list()) == 4


@pytest.mark.parametrize("keep", [0, -1])
def test_gc_refuses_keep_below_one(store, keep):
    save(store, 1)

    with pytest.raises(ValueError, match="keep"):
        gc(store, keep=keep)
    assert latest_committed(store).step == 1


def test_scan_says_why_a_dir_is_not_committed(store):
    save(store, 1)
    save(store, 2, commit_it=False)

    dirs = scan(store)

    assert [(d.step, d.committed, d.reason) for d in dirs] == [(2, False, "no manifest"), (1, True, None)]


# --------------------------------------------------------------------------- store behaviour


def test_store_list_prefix_and_sizes(store):
    store.put_bytes("step-00000001/a", b"12345")
    store.put_bytes("step-00000001/sub/b", b"")
    store.put_bytes("step-00000010/a", b"x")
    store.put_bytes("other", b"yy")

    assert store.list("step-00000001/") == {"step-00000001/a": 5, "step-00000001/sub/b": 0}
    assert store.list("step-0000001") == {"step-00000010/a": 1}
    assert store.list() == {"step-00000001/a": 5, "step-00000001/sub/b": 0, "step-00000010/a": 1, "other": 2}


def test_store_put_replaces_and_get_missing_raises(store):
    store.put_bytes("k", b"old")
    store.put_bytes("k", b"new")

    assert store.get_bytes("k") == b"new"
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("nope")
    store.delete(["k", "nope"])  # absent keys are ignored
    assert store.list() == {}


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", "a\\b"])
def test_store_rejects_bad_keys(store, bad):
    with pytest.raises(ValueError, match="key"):
        store.put_bytes(bad, b"x")


def test_filestore_leaves_no_temp_files_or_empty_dirs(tmp_path):
    store = FileStore(tmp_path.as_uri())
    save(store, 1)
    save(store, 2)
    save(store, 3)

    names = sorted(p.name for p in (tmp_path / "step-00000003").iterdir())
    assert names == ["manifest.json", "rank-0.pt", "rank-1.pt"]
    gc(store, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


def test_filestore_io_failure_is_storage_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    store = FileStore(tmp_path / "file")  # root is a regular file

    with pytest.raises(StorageError) as info:
        store.put_bytes("step-00000001/x", b"data")
    assert isinstance(info.value.__cause__, OSError)


def test_filestore_skips_what_is_not_a_regular_file_and_resume_takes_the_newest_verified(tmp_path, monkeypatch):
    """Issue 25, item 10: a symlink loop in the store made resume raise, and a FIFO named
    ``manifest.json`` blocked it forever. Such entries (and a dangling symlink, a socket)
    are skipped with one log line each; resume takes the newest verified checkpoint."""
    import socket
    import structlog
    import threading

    import trainer.storage as storage_mod

    monkeypatch.setattr(storage_mod, "log", structlog.get_logger("trainer.storage"))  # uncached: captured
    store = FileStore(tmp_path.as_uri())
    for step in (1, 2, 3, 4):
        save(store, step)
    # step 4: its manifest replaced by a symlink to itself (a loop); step 3: by a FIFO
    (tmp_path / key(4, "manifest.json")).unlink()
    os.symlink("manifest.json", tmp_path / key(4, "manifest.json"))
    (tmp_path / key(3, "manifest.json")).unlink()
    os.mkfifo(tmp_path / key(3, "manifest.json"))
    os.symlink(tmp_path / "nowhere", tmp_path / key(2, "dangling"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / key(2, "sock")))

    got: list = []
    done = threading.Event()

    def resume() -> None:
        try:
            got.append(latest_committed(store))
        except BaseException as exc:  # noqa: BLE001 - what resume raised is the finding
            got.append(exc)
        finally:
            done.set()

    with structlog.testing.capture_logs() as logs:
        threading.Thread(target=resume, daemon=True).start()
        try:
            # generous: a FIFO read blocks until a writer comes, so a wait that ends at all is the test
            assert done.wait(60), "resume blocked on the FIFO named manifest.json"
        finally:
            with contextlib.suppress(OSError):  # free a reader blocked on the FIFO (only if it is)
                os.close(os.open(tmp_path / key(3, "manifest.json"), os.O_WRONLY | os.O_NONBLOCK))
            sock.close()
    (result,) = got
    assert not isinstance(result, BaseException), repr(result)
    assert result is not None and result.step == 2  # the newest that verifies
    skipped = sorted(e["key"] for e in logs if e["event"] == "checkpoint_store_entry_skipped")
    assert skipped == [key(2, "dangling"), key(2, "sock"), key(3, "manifest.json"), key(4, "manifest.json")]
    for k in (key(3, "manifest.json"), key(4, "manifest.json")):  # read by name: not found, never blocking
        with pytest.raises(ObjectNotFoundError):
            store.get_bytes(k)
    assert load_shard(store, result, "rank-0.pt") == _shard_bytes(2, 0)


def test_s3_multipart_round_trip(s3_server):
    bucket = new_bucket(s3_server, "ckpt")
    store = S3Store(
        f"s3://{bucket}/mp", endpoint_url=s3_server, multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB
    )
    big = os.urandom(9 * MIB)

    info = write_shard(store, 1, "rank-0.pt", big)
    commit(store, Manifest(step=1, world_size=1, global_batch_size=8, data_position={}, shards=(info,)))

    s3 = boto3.client("s3", endpoint_url=s3_server)
    head = s3.head_object(Bucket=bucket, Key="mp/step-00000001/rank-0.pt")
    assert head["ETag"].strip('"').endswith("-2")  # uploaded in 2 parts
    assert load_shard(store, latest_committed(store), "rank-0.pt") == big


def test_s3_list_follows_pagination(s3_server):
    store = S3Store(f"s3://{new_bucket(s3_server, 'ckpt')}", endpoint_url=s3_server, list_page_size=2)
    for i in range(5):
        store.put_bytes(f"step-00000001/k{i}", b"x" * i)

    assert store.list("step-") == {f"step-00000001/k{i}": i for i in range(5)}


def test_s3_backend_failure_is_storage_error(s3_server):
    store = S3Store("s3://no-such-bucket-here/p", endpoint_url=s3_server)

    with pytest.raises(StorageError) as info:
        store.list()
    assert isinstance(info.value.__cause__, ClientError)
    with pytest.raises(StorageError):
        store.put_bytes("k", b"x")
    with pytest.raises(StorageError):
        latest_committed(store)


# --------------------------------------------------------------------------- manifest and URIs


def test_manifest_json_round_trip():
    m = Manifest(
        step=12,
        world_size=3,
        global_batch_size=96,
        data_position={"consumed_samples": 1152, "seed": 0, "epoch": 1},
        shards=[ShardInfo.of("rank-0.pt", b"abc"), ShardInfo.of("dcp/__0_0.distcp", b"")],
        time=1_700_000_123.5,
        extra={"notice_ids": ["a", "b"]},
    )

    back = Manifest.from_json(m.to_json())

    assert back == m
    assert isinstance(back.shards, tuple)
    assert json.loads(m.to_json())["format"] == 1


def _manifest_dict() -> dict:
    shards = (ShardInfo.of("a", b"x"),)
    m = Manifest(step=1, world_size=1, global_batch_size=1, data_position={}, shards=shards)
    return json.loads(m.to_json())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: "not json",
        lambda d: "[1, 2]",
        lambda d: {**d, "format": 2},
        lambda d: {k: v for k, v in d.items() if k != "shards"},
        lambda d: {**d, "step": -1},
        lambda d: {**d, "world_size": "2"},
        lambda d: {**d, "shards": [{**d["shards"][0], "sha256": "abc"}]},
        lambda d: {**d, "shards": [{**d["shards"][0], "size": -1}]},
        lambda d: {**d, "shards": [d["shards"][0], d["shards"][0]]},
        lambda d: {**d, "shards": [{**d["shards"][0], "name": "../escape"}]},
        lambda d: {**d, "data_position": [1]},
    ],
    ids=[
        "not_json", "not_object", "future_format", "no_shards", "negative_step", "string_world_size",
        "bad_sha", "negative_size", "duplicate_shard", "escaping_name", "data_position_not_dict",
    ],
)
def test_manifest_from_json_rejects_bad_input(mutate):
    body = mutate(_manifest_dict())
    text = body if isinstance(body, str) else json.dumps(body)

    with pytest.raises(CheckpointError, match="bad manifest"):
        Manifest.from_json(text)


def test_open_store_picks_backend(tmp_path, s3_server):
    fs = open_store(tmp_path.as_uri())
    s3 = open_store("s3://bucket/some/prefix/", s3_endpoint_url=s3_server)

    assert isinstance(fs, FileStore) and fs.uri == tmp_path.as_uri()
    assert isinstance(s3, S3Store) and s3.uri == "s3://bucket/some/prefix"


@pytest.mark.parametrize("uri", ["gs://bucket/x", "/abs/path", "file://host/path", "s3:///no-bucket"])
def test_open_store_refuses_unsupported_uri(uri):
    with pytest.raises(ValueError) as info:
        open_store(uri)
    assert "\n" not in str(info.value)
    assert uri in str(info.value)


def test_step_dir():
    assert step_dir(42) == "step-00000042"
    with pytest.raises(ValueError):
        step_dir(-1)
