"""One CheckpointStore suite for every backend: file:// (a directory), s3:// (moto) and
oss:// (fakes/oss.py, a local OSS endpoint spoken to by the real oss2 SDK).

Each backend's store is built with a small multipart threshold, so "a large file"
really moves in parts (S3 parts are >= 5 MiB, OSS parts >= 100 KiB), and with a list
page size of 2, so listings really follow continuation tokens.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import boto3
import oss2
import pytest
from botocore.config import Config
from conftest import new_bucket
from fakes.aws_faults import AwsFaultProxy

from trainer.checkpoint import (
    Manifest,
    commit,
    fetch_dir,
    latest_committed,
    load_shard,
    open_store,
    scan,
    step_dir,
    write_dir,
    write_shard,
)
from trainer.storage import (
    CheckpointStore,
    FileStore,
    ObjectNotFoundError,
    S3Store,
    StorageError,
)
from trainer.oss_store import OssStore

KIB, MIB = 1024, 1024 * 1024
OSS_REGION = "cn-hangzhou"  # the region the oss_server fixture verifies signatures for


@dataclass
class Backend:
    name: str
    store: CheckpointStore
    big: int
    """Bytes of a file above the store's multipart threshold."""
    part_size: int | None
    """Bytes per part of a multipart upload (None: the backend has no parts)."""
    parts: Callable[[str], int]
    """How many parts the object at a store key went up in."""


def _oss_store(oss_server, tmp_path: Path, bucket: str | None = None, **kw) -> OssStore:
    if bucket is None:
        bucket = f"suite-{uuid.uuid4().hex[:12]}"
        oss_server.create_bucket(bucket)
    options = dict(endpoint=oss_server.endpoint, region=OSS_REGION, multipart_threshold=100 * KIB,
                   part_size=100 * KIB, num_threads=4, checkpoint_dir=tmp_path / "oss-resume", list_page_size=2)
    return OssStore(f"oss://{bucket}/job", **{**options, **kw})


@pytest.fixture(params=["file", "s3", "oss"])
def backend(request, tmp_path) -> Backend:
    if request.param == "file":
        return Backend("file", FileStore((tmp_path / "store").as_uri()), 1 * MIB, None, lambda key: 1)
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = new_bucket(endpoint, "suite")
        store = S3Store(f"s3://{bucket}/job", endpoint_url=endpoint, multipart_threshold=5 * MIB,
                        multipart_chunksize=5 * MIB, list_page_size=2)

        def s3_parts(key: str) -> int:
            etag = boto3.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key=f"job/{key}")["ETag"]
            return int(etag.strip('"').partition("-")[2] or 1)

        return Backend("s3", store, 6 * MIB, 5 * MIB, s3_parts)
    oss_server = request.getfixturevalue("oss_server")
    store = _oss_store(oss_server, tmp_path)

    def oss_parts(key: str) -> int:
        sent = [s for s in oss_server.ops("UploadPart") if s.status == 200]
        return len([s for s in sent if (s.bucket, s.key) == (store.bucket, f"job/{key}")]) or 1

    return Backend("oss", store, 1 * MIB + 5, 100 * KIB, oss_parts)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------------------- the contract


def test_bytes_round_trip_under_any_key_and_replace(backend):
    store = backend.store
    keys = {"step-00000001/rank-0.pt": os.urandom(3000), "step-00000001/dcp/a b+c%d/ü.distcp": b"odd key",
            "step-00000001/empty": b""}
    for key, data in keys.items():
        store.put_bytes(key, data)

    assert {key: store.get_bytes(key) for key in keys} == keys
    store.put_bytes("step-00000001/rank-0.pt", b"new")
    assert store.get_bytes("step-00000001/rank-0.pt") == b"new"


def test_large_file_goes_up_in_parts_and_comes_back_whole(backend, tmp_path):
    data = os.urandom(backend.big)
    src = tmp_path / "big.pt"
    src.write_bytes(data)

    backend.store.put_file("step-00000002/big.pt", src)
    target = tmp_path / "restore" / "deep" / "big.pt"
    backend.store.get_file("step-00000002/big.pt", target)

    assert target.read_bytes() == data
    assert _leftovers(target.parent) == ["big.pt"]  # no temporary file left behind
    assert backend.store.list("step-00000002/") == {"step-00000002/big.pt": backend.big}
    if backend.part_size is not None:
        assert backend.parts("step-00000002/big.pt") == math.ceil(backend.big / backend.part_size)


def test_list_is_a_plain_prefix_match_with_sizes(backend):
    store = backend.store
    for key, size in {"step-00000001/a": 1, "step-00000001/b/c": 3, "step-00000010/a": 2, "other": 4}.items():
        store.put_bytes(key, b"x" * size)

    assert store.list("step-00000001/") == {"step-00000001/a": 1, "step-00000001/b/c": 3}
    assert store.list("step-0000001") == {"step-00000010/a": 2}
    assert store.list() == {"step-00000001/a": 1, "step-00000001/b/c": 3, "step-00000010/a": 2, "other": 4}
    assert store.list("nothing/") == {}


def test_delete_is_idempotent_and_takes_more_keys_than_one_request_holds(backend):
    store = backend.store
    present = [f"step-00000001/k{i}" for i in range(3)]
    for key in present:
        store.put_bytes(key, b"x")
    absent = [f"step-00000001/gone-{i}" for i in range(1000)]  # S3 and OSS take 1000 keys a request

    store.delete(present + absent + present)
    assert store.list() == {}
    store.delete(present)  # again: nothing to do, no error
    store.delete([])


def test_a_missing_key_is_object_not_found(backend, tmp_path):
    with pytest.raises(ObjectNotFoundError, match="step-00000009/nope"):
        backend.store.get_bytes("step-00000009/nope")
    (tmp_path / "restore").mkdir()
    with pytest.raises(ObjectNotFoundError, match="step-00000009/nope"):
        backend.store.get_file("step-00000009/nope", tmp_path / "restore" / "nope")
    assert _leftovers(tmp_path / "restore") == []


def test_a_torn_checkpoint_is_never_resumed_from(backend, tmp_path):
    store = backend.store
    infos = [write_shard(store, 1, f"rank-{r}.pt", os.urandom(1000)) for r in range(2)]
    commit(store, Manifest(step=1, world_size=2, global_batch_size=8, data_position={"consumed_samples": 8},
                           shards=infos))
    # Step 2: every shard written (one through the multipart path), the node dies before the manifest.
    folder = tmp_path / "save-2"
    folder.mkdir()
    (folder / "model.pt").write_bytes(os.urandom(backend.big))
    write_dir(store, 2, folder)
    write_shard(store, 2, "rank-1.pt", b"optim")

    assert latest_committed(store).step == 1
    assert sorted((d.step, d.committed) for d in scan(store)) == [(1, True), (2, False)]
    assert load_shard(store, latest_committed(store), "rank-1.pt") == store.get_bytes("step-00000001/rank-1.pt")


# --------------------------------------------------------------------------- a failing backend


_S3_INTERNAL_ERROR = (  # https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    "<Message>We encountered an internal error. Please try again.</Message>"
    "<RequestId>4442587FB7D0A2F9</RequestId></Error>"
)


def _every_operation(store: CheckpointStore, src: Path, out: Path, *, file_key: str) -> dict[str, Callable[[], object]]:
    """Each store operation once, in an order that succeeds on a healthy store: bytes under
    ``step-00000001/a.pt``, ``src`` up and down under ``file_key`` (into ``out``), a list,
    and the delete of ``a.pt``."""
    return {
        "put_bytes": lambda: store.put_bytes("step-00000001/a.pt", b"x"),
        "get_bytes": lambda: store.get_bytes("step-00000001/a.pt"),
        "put_file": lambda: store.put_file(file_key, src),
        "get_file": lambda: store.get_file(file_key, out / Path(file_key).name),
        "list": lambda: store.list("step-00000001/"),
        "delete": lambda: store.delete(["step-00000001/a.pt"]),
    }


@pytest.fixture(params=["s3", "oss"])
def failing(request, tmp_path) -> Iterator[tuple[CheckpointStore, Callable[[], None]]]:
    """A store whose backend answers every request with HTTP 500 until the returned heal() is called."""
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = new_bucket(endpoint, "suite")
        proxy = AwsFaultProxy(endpoint)  # S3 requests carry no EC2 Action: they match action ""
        url = proxy.start()
        try:
            proxy.reply_next("", _S3_INTERNAL_ERROR, status=500, n=1000)
            client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                                  config=Config(retries={"mode": "standard", "max_attempts": 1}))
            yield (S3Store(f"s3://{bucket}/job", client=client, multipart_threshold=5 * MIB,
                           multipart_chunksize=5 * MIB), proxy.reset)
        finally:
            proxy.close()
        return
    oss_server = request.getfixturevalue("oss_server")
    store = _oss_store(oss_server, tmp_path, max_attempts=1)  # no retries, as the S3 client above
    oss_server.fail_next(1000, status=500)
    try:
        yield store, oss_server.reset_faults
    finally:
        oss_server.reset_faults()


@pytest.mark.timeout(60)
def test_a_5xx_backend_is_a_one_line_storage_error_then_recovers(failing, tmp_path):
    store, heal = failing
    src = tmp_path / "big.pt"
    src.write_bytes(os.urandom(6 * MIB))
    calls = {**_every_operation(store, src, tmp_path / "out", file_key="step-00000001/a.pt"),
             "latest_committed": lambda: latest_committed(store)}
    for name, call in calls.items():
        with pytest.raises(StorageError) as info:
            call()
        assert type(info.value) is StorageError, name  # a 5xx is not "not found"
        assert "\n" not in str(info.value) and store.uri in str(info.value), name
        assert "500" in str(info.value) or "InternalError" in str(info.value), name

    heal()
    store.put_file("step-00000001/a.pt", src)
    assert store.list("step-00000001/") == {"step-00000001/a.pt": 6 * MIB}


# --------------------------------------------------------------------------- OSS specifics


@pytest.mark.timeout(60)
def test_oss_retries_server_errors_not_client_errors(oss_server, tmp_path):
    """Two 500s / 503s in a row (what the S3 store's botocore retries ride out) cost a
    notice's flush a second, not the commit; a 404 is answered at once."""
    store = _oss_store(oss_server, tmp_path)
    src = tmp_path / "big.pt"
    src.write_bytes(os.urandom(MIB + 5))  # multipart: parts and the complete can fail too
    calls = _every_operation(store, src, tmp_path / "out", file_key="step-00000001/b.pt")
    def server_errors() -> int:
        return sum(1 for r in oss_server.requests if r.status >= 500)

    for name, call in calls.items():
        before = server_errors()
        oss_server.fail_next(2, status=500 if name != "list" else 503)
        call()
        assert server_errors() == before + 2, f"{name}: it did not meet both armed faults"
    assert (tmp_path / "out" / "b.pt").read_bytes() == src.read_bytes()
    assert store.list("step-00000001/") == {"step-00000001/b.pt": MIB + 5}

    oss_server.fail_next(3, status=500)  # more than max_attempts: reported, one line
    with pytest.raises(StorageError, match="InternalError"):
        store.put_bytes("step-00000001/c.pt", b"x")
    oss_server.reset_faults()
    before = len(oss_server.ops("GetObject"))
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("step-00000001/absent.pt")
    assert len(oss_server.ops("GetObject")) == before + 1


def test_oss_upload_killed_mid_way_is_invisible_and_a_retry_sends_only_the_missing_parts(oss_server, tmp_path):
    store = _oss_store(oss_server, tmp_path, num_threads=2)
    bucket = store.bucket
    info = write_shard(store, 1, "rank-0.pt", b"step one")
    commit(store, Manifest(step=1, world_size=1, global_batch_size=8, data_position={}, shards=(info,)))
    folder = tmp_path / "save-2"
    folder.mkdir()
    data = os.urandom(MIB + 5)  # 11 parts of 100 KiB
    (folder / "model.pt").write_bytes(data)

    oss_server.hang_next(op="UploadPart")
    with ThreadPoolExecutor(1) as pool:
        upload = pool.submit(write_dir, store, 2, folder)
        held = oss_server.wait_hanging()
        # Mid-upload: parts are on OSS, the object is not.
        assert held.key == "job/step-00000002/model.pt"
        assert store.list(step_dir(2)) == {}
        with pytest.raises(ObjectNotFoundError):
            store.get_bytes("step-00000002/model.pt")
        assert latest_committed(store).step == 1
        oss_server.release(drop=True)  # the connection dies: the node was reclaimed
        with pytest.raises(StorageError, match="step-00000002/model.pt"):
            upload.result(timeout=30)

    [(key, done)] = oss_server.uploads(bucket).values()
    assert key == "job/step-00000002/model.pt" and 0 < len(done) < 11
    assert latest_committed(store).step == 1 and store.list(step_dir(2)) == {}

    def parts_sent() -> int:
        return len([s for s in oss_server.ops("UploadPart") if s.bucket == bucket])

    sent_before = parts_sent()
    shards = write_dir(store, 2, folder)
    assert parts_sent() - sent_before == 11 - len(done)
    assert oss_server.uploads(bucket) == {}
    commit(store, Manifest(step=2, world_size=1, global_batch_size=8, data_position={}, shards=shards))
    [path] = fetch_dir(store, latest_committed(store), tmp_path / "restore")
    assert path.read_bytes() == data


def test_oss_refuses_a_wrong_secret_or_missing_credentials(oss_server, tmp_path, monkeypatch):
    bucket = f"suite-{uuid.uuid4().hex[:12]}"
    oss_server.create_bucket(bucket)
    wrong = _oss_store(oss_server, tmp_path, bucket, auth=oss2.AuthV4(oss_server.access_key_id, "not-the-secret"))

    with pytest.raises(StorageError, match="403 SignatureDoesNotMatch"):
        wrong.put_bytes("step-00000001/a.pt", b"x")
    monkeypatch.delenv("OSS_ACCESS_KEY_SECRET")
    with pytest.raises(StorageError, match="(?i)secret access key"):
        _oss_store(oss_server, tmp_path, bucket).put_bytes("step-00000001/a.pt", b"x")
    assert oss_server.objects(bucket) == {}


def test_open_store_builds_an_oss_store(oss_server, monkeypatch):
    bucket = f"suite-{uuid.uuid4().hex[:12]}"
    oss_server.create_bucket(bucket)
    monkeypatch.setenv("SPOTVISOR_OSS_REGION", OSS_REGION)  # a 127.0.0.1 endpoint names no region

    store = open_store(f"oss://{bucket}/some/prefix/", oss_endpoint=oss_server.endpoint)
    store.put_bytes("step-00000001/a.pt", b"via open_store")

    assert isinstance(store, OssStore) and store.uri == f"oss://{bucket}/some/prefix"
    assert oss_server.objects(bucket) == {"some/prefix/step-00000001/a.pt": b"via open_store"}
    monkeypatch.setenv("SPOTVISOR_OSS_ENDPOINT", oss_server.endpoint)  # what the supervisor sets
    assert open_store(f"oss://{bucket}/some/prefix").get_bytes("step-00000001/a.pt") == b"via open_store"


def test_open_store_refuses_oss_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("SPOTVISOR_OSS_ENDPOINT", raising=False)
    with pytest.raises(ValueError) as info:
        open_store("oss://bucket/prefix")
    assert "\n" not in str(info.value) and "oss://bucket/prefix" in str(info.value)


@pytest.mark.parametrize(
    ("endpoint", "region"),
    [("https://oss-cn-hangzhou.aliyuncs.com", "cn-hangzhou"),
     ("oss-cn-beijing-internal.aliyuncs.com", "cn-beijing"),
     ("http://oss-ap-southeast-1.aliyuncs.com", "ap-southeast-1")],
)
def test_oss_store_takes_the_region_from_a_public_endpoint(endpoint, region, monkeypatch):
    monkeypatch.delenv("SPOTVISOR_OSS_REGION", raising=False)
    store = OssStore("oss://ckpt-bucket/job", endpoint=endpoint)  # no I/O: nothing listens there
    assert store.region == region and store.endpoint.startswith(("https://", "http://"))
    assert OssStore("oss://ckpt-bucket/job", endpoint=endpoint, region="eu-central-1").region == "eu-central-1"


@pytest.mark.parametrize(
    ("uri", "kw", "match"),
    [("oss://ckpt-bucket/job", {"endpoint": "https://oss-accelerate.aliyuncs.com"}, "region"),
     ("oss://ckpt-bucket/job", {"endpoint": "http://127.0.0.1:9"}, "SPOTVISOR_OSS_REGION"),
     ("oss://x/job", {"endpoint": "https://oss-cn-hangzhou.aliyuncs.com"}, "bucket"),
     ("s3://ckpt-bucket/job", {"endpoint": "https://oss-cn-hangzhou.aliyuncs.com"}, "oss://bucket"),
     ("oss://ckpt-bucket/job", {"endpoint": "https://oss-cn-hangzhou.aliyuncs.com", "part_size": 1000}, "part_size")],
    ids=["accelerate-endpoint", "ip-endpoint", "short-bucket", "wrong-scheme", "tiny-parts"],
)
def test_oss_store_refuses_bad_settings_with_one_line(uri, kw, match, monkeypatch):
    monkeypatch.delenv("SPOTVISOR_OSS_REGION", raising=False)
    with pytest.raises(ValueError, match=match) as info:
        OssStore(uri, **kw)
    assert "\n" not in str(info.value)


def test_an_unreadable_file_store_fails_loudly_rather_than_looking_empty(tmp_path):
    # A root that is not a directory, or an unreadable one (a dropped NFS mount), must not
    # read as "no checkpoint": resume would silently start again from step 0.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(StorageError):
        FileStore(not_a_dir.as_uri()).list("")
    assert FileStore((tmp_path / "absent").as_uri()).list("") == {}
    root = tmp_path / "ckpt"
    (root / "step-00000001").mkdir(parents=True)
    (root / "step-00000001" / "model.pt").write_bytes(b"x")
    store = FileStore(root.as_uri())
    assert store.list("step-") == {"step-00000001/model.pt": 1}
    (root / "step-00000001").chmod(0)
    try:
        if os.access(root / "step-00000001", os.R_OK):
            pytest.skip("running as root: directory permissions are not enforced")
        with pytest.raises(StorageError):
            store.list("step-")
    finally:
        (root / "step-00000001").chmod(0o755)
