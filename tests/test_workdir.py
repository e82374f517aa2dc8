"""job.workdir and job.setup at the edges: the control node's packing and publishing
(daemon/controlnode/workdir.py) and the node's fetch, verify, unpack and setup
(daemon/gpunode/code.py), against real files, a file:// store and moto's S3 server."""

from __future__ import annotations

import asyncio
import io
import os
import select
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import boto3
import pytest

from daemon.config import Config, ConfigError, load_config
from daemon.controlnode.workdir import CodePin, WorkdirError, code_key, pack, publish
from daemon.gpunode.code import PrepareError, fetch, run_setup

SHA_RE = r"^[0-9a-f]{64}$"


def _tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('v1')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0" * 10)
    return root


def _names(path: Path) -> list[str]:
    with tarfile.open(path) as t:
        return t.getnames()


# -- packing --------------------------------------------------------------------------------------
def test_the_same_files_pack_to_the_same_bytes_whatever_their_times_and_order(tmp_path: Path) -> None:
    a = _tree(tmp_path / "a")
    first = pack(a, tmp_path / "out1", max_bytes=2**20)
    # a copy made later, its files written in another order, other mtimes and modes of the group
    b = tmp_path / "b"
    (b / "pkg").mkdir(parents=True)
    (b / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (b / "run.sh").chmod(0o750)
    (b / "pkg" / "__init__.py").write_text("")
    (b / "train.py").write_text("print('v1')\n")
    os.utime(b / "train.py", (1, 1))
    second = pack(b, tmp_path / "out2", max_bytes=2**20)
    assert second.sha256 == first.sha256
    assert second.path.read_bytes() == first.path.read_bytes()
    assert first.path.name == f"{first.sha256}.tar.gz" and first.files == 3
    (b / "train.py").write_text("print('v2')\n")
    assert pack(b, tmp_path / "out3", max_bytes=2**20).sha256 != first.sha256


def test_git_pycache_and_excluded_names_are_left_out(tmp_path: Path) -> None:
    root = _tree(tmp_path / "w")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 100)
    (root / "notes.log").write_text("x")
    packed = pack(root, tmp_path / "out", exclude=("data", "*.log"), max_bytes=2**20)
    names = _names(packed.path)
    assert sorted(names) == ["pkg", "pkg/__init__.py", "run.sh", "train.py"]
    with tarfile.open(packed.path) as t:
        for m in t.getmembers():
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert t.getmember("run.sh").mode == 0o755 and t.getmember("train.py").mode == 0o644


def test_a_symlink_leading_outside_is_refused_naming_job_workdir(tmp_path: Path) -> None:
    root = _tree(tmp_path / "w")
    (tmp_path / "secret").write_text("x")
    (root / "pkg" / "inside.py").symlink_to("../train.py")  # kept, as a link
    assert "pkg/inside.py" in _names(pack(root, tmp_path / "out", max_bytes=2**20).path)
    (root / "escape").symlink_to("../secret")
    with pytest.raises(WorkdirError, match=r"^job\.workdir: escape is a symlink to \.\./secret, outside"):
        pack(root, tmp_path / "out", max_bytes=2**20)
    (root / "escape").unlink()
    (root / "abs").symlink_to(root / "train.py")  # absolute: would point elsewhere on the node
    with pytest.raises(WorkdirError, match="abs is a symlink"):
        pack(root, tmp_path / "out", max_bytes=2**20)


def test_over_the_size_cap_is_one_line_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    root = _tree(tmp_path / "w")
    (root / "weights.bin").write_bytes(b"x" * 5000)
    with pytest.raises(WorkdirError) as exc:
        pack(root, tmp_path / "out", max_bytes=4096)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("job.workdir: ") and "job.workdir_max_bytes" in msg
    assert "job.workdir_exclude" in msg and "weights.bin" in msg
    assert not list((tmp_path / "out").glob("*.tar.gz"))  # nothing half-written is left


def test_a_fifo_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "w")
    os.mkfifo(root / "pipe")
    with pytest.raises(WorkdirError, match="pipe is not a file, directory or symlink"):
        pack(root, tmp_path / "out", max_bytes=2**20)


def test_config_job_workdir_must_be_a_directory_and_setup_may_be_one_string(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"job: {{workdir: {tmp_path / 'nope'}}}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(cfg)
    assert exc.value.problems[0].startswith("job.workdir: ") and "is not a directory" in exc.value.problems[0]
    c = Config.model_validate({"job": {"workdir": str(tmp_path), "setup": "pip install -e ."}})
    assert c.job.setup == ["pip install -e ."] and c.job.workdir == str(tmp_path.resolve())
    assert (c.job.setup_timeout_s, c.job.setup_max_failures) == (1800.0, 3)
    with pytest.raises(Exception, match="item 0 is empty"):
        Config.model_validate({"job": {"setup": ["  "]}})


# -- publishing and fetching ----------------------------------------------------------------------------
def _config(tmp_path: Path, uri: str, **job: object) -> Config:
    return Config.model_validate({"job": {"checkpoint_uri": uri, **job},
                                  "daemon": {"state_dir": str(tmp_path / "state")}})


def _published(tmp_path: Path):
    """The test tree packed and published to ``file://tmp_path/ckpt``: (config, packed, pin,
    the stored archive's path)."""
    config = _config(tmp_path, f"file://{tmp_path}/ckpt")
    packed = pack(_tree(tmp_path / "w"), tmp_path / "out", max_bytes=2**20)
    return config, packed, publish(config, packed), tmp_path / "ckpt" / code_key(packed.sha256)


def test_published_once_per_hash_and_fetched_verified_and_unpacked(tmp_path: Path) -> None:
    config, packed, pin, stored = _published(tmp_path)
    assert stored.read_bytes() == packed.path.read_bytes()
    assert pin.uris == {"default": f"file://{tmp_path}/ckpt/{code_key(packed.sha256)}"} or \
        list(pin.uris.values()) == [f"file://{tmp_path}/ckpt/{code_key(packed.sha256)}"]
    before = stored.stat().st_mtime_ns
    assert publish(config, packed) == pin and stored.stat().st_mtime_ns == before  # there already: not uploaded
    domain = next(iter(pin.uris))
    code = fetch(pin.spec(domain), tmp_path / "node")
    assert code == tmp_path / "node" / "code" / packed.sha256
    assert (code / "train.py").read_text() == "print('v1')\n" and os.access(code / "run.sh", os.X_OK)
    assert not (code / ".git").exists()
    assert [p.name for p in (tmp_path / "node" / "code").iterdir()] == [packed.sha256]  # no temporary left


def test_a_tampered_archive_is_refused_and_nothing_is_unpacked(tmp_path: Path) -> None:
    config, packed, pin, stored = _published(tmp_path)
    # another archive of the same size in its place (someone with write access to the bucket)
    other = tmp_path / "w2"
    _tree(other)
    (other / "train.py").write_text("print('v0')\n")  # same length: the size check alone cannot tell
    forged = pack(other, tmp_path / "out2", max_bytes=2**20)
    data = forged.path.read_bytes()
    stored.write_bytes(data[: packed.bytes].ljust(packed.bytes, b"\0"))
    spec = pin.spec(next(iter(pin.uris)))
    with pytest.raises(PrepareError) as exc:
        fetch(spec, tmp_path / "node")
    assert exc.value.stage == "verify" and f"is not the pinned {packed.sha256}" in str(exc.value)
    assert not (tmp_path / "node" / "code" / packed.sha256).exists()
    assert list((tmp_path / "node" / "code").iterdir()) == []
    stored.write_bytes(data + b"junk")  # another size: not even downloaded
    with pytest.raises(PrepareError, match="the daemon published") as exc:
        fetch(spec, tmp_path / "node")
    assert exc.value.stage == "fetch"


def test_an_archive_reaching_outside_its_directory_is_refused(tmp_path: Path) -> None:
    """Even one whose sha256 is the one in the spec (a daemon's bug, or a forged spec):
    tarfile's data filter refuses the path traversal; nothing lands outside."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        body = b"owned"
        info = tarfile.TarInfo("../../escaped.txt")
        info.size = len(body)
        t.addfile(info, io.BytesIO(body))
    data = buf.getvalue()
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "ckpt" / "code").mkdir(parents=True)
    (tmp_path / "ckpt" / "code" / f"{sha}.tar.gz").write_bytes(data)
    spec = {"uri": f"file://{tmp_path}/ckpt/code/{sha}.tar.gz", "sha256": sha, "bytes": len(data)}
    with pytest.raises(PrepareError) as exc:
        fetch(spec, tmp_path / "node")
    assert exc.value.stage == "unpack"
    assert not list(tmp_path.rglob("escaped.txt"))
    assert not (tmp_path / "node" / "code" / sha).exists()


def test_published_to_s3_and_fetched_with_the_nodes_store_classes(tmp_path: Path, s3_server: str) -> None:
    bucket = f"code-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    config = _config(tmp_path, f"s3://{bucket}/job", s3_endpoint_url=s3_server)
    packed = pack(_tree(tmp_path / "w"), tmp_path / "out", max_bytes=2**20)
    pin = publish(config, packed)
    uri = next(iter(pin.uris.values()))
    assert uri == f"s3://{bucket}/job/code/{packed.sha256}.tar.gz"
    obj = boto3.client("s3", endpoint_url=s3_server).head_object(Bucket=bucket, Key=f"job/code/{packed.sha256}.tar.gz")
    assert obj["ContentLength"] == packed.bytes
    code = fetch(pin.spec(next(iter(pin.uris))), tmp_path / "node", s3_endpoint_url=s3_server)
    assert (code / "train.py").read_text() == "print('v1')\n"


def test_an_unwritable_store_is_one_line_naming_job_workdir(tmp_path: Path, s3_server: str) -> None:
    config = _config(tmp_path, f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/job", s3_endpoint_url=s3_server)
    packed = pack(_tree(tmp_path / "w"), tmp_path / "out", max_bytes=2**20)
    with pytest.raises(WorkdirError) as exc:
        publish(config, packed)
    assert str(exc.value).startswith("job.workdir: cannot upload it to s3://no-such-bucket-")
    assert "credentials" in str(exc.value) and "\n" not in str(exc.value)


# -- setup ---------------------------------------------------------------------------------------------
def _run(coro):
    return asyncio.run(coro)


def test_setup_runs_in_order_in_the_workdir_with_the_env_and_logs(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    env = {**os.environ, "JOB_FLAVOUR": "vanilla"}
    took = _run(run_setup(["echo first > marker", "echo \"$JOB_FLAVOUR\" >> marker; echo said-so"],
                          cwd=tmp_path, env=env, log_path=log, timeout_s=30))
    assert (tmp_path / "marker").read_text() == "first\nvanilla\n"
    text = log.read_text()
    assert "[spotvisor] job.setup 1/2: echo first > marker" in text and "said-so" in text
    assert "job.setup done in" in text and took >= 0


def test_a_failing_setup_stops_at_the_command_with_its_exit_code_and_last_line(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text("an older line\n")
    with pytest.raises(PrepareError) as exc:
        _run(run_setup(["echo ok", "echo 'pip: no such package foo' >&2; exit 7", "touch never"],
                       cwd=tmp_path, env=dict(os.environ), log_path=log, timeout_s=30))
    assert (exc.value.stage, exc.value.exit_code, str(exc.value)) == ("setup", 7, "pip: no such package foo")
    assert not (tmp_path / "never").exists()


def test_a_setup_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    with pytest.raises(PrepareError) as exc:
        # a child that would outlive a plain kill of bash writes its pid, then sleeps
        _run(run_setup(["(sleep 60; touch late) & echo $! > child; echo waiting; wait"], cwd=tmp_path,
                       env=dict(os.environ), log_path=log, timeout_s=1.0))
    assert exc.value.stage == "timeout" and "job.setup_timeout_s (1 s)" in str(exc.value)
    assert "last: waiting" in str(exc.value)
    pid = int((tmp_path / "child").read_text())
    try:  # the grandchild was in the killed group: its pidfd says it has exited (no polling)
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 10.0)[0] == [fd], "the setup's grandchild outlived the timeout"
    finally:
        os.close(fd)


def test_code_pin_spec_names_the_domain_uri() -> None:
    pin = CodePin("a" * 64, 10, {"east": "s3://b/e/code/x", "west": "oss://b/w/code/x"})
    assert pin.spec("west") == {"uri": "oss://b/w/code/x", "sha256": "a" * 64, "bytes": 10}


def test_spotvisord_run_refuses_a_workdir_over_its_cap_in_one_line(tmp_path: Path, sockdir: Path) -> None:
    wd = _tree(tmp_path / "w")
    (wd / "model.safetensors").write_bytes(b"x" * 3000)
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(
        "pool: {name: sd, min_nodes: 1, target_nodes: 1, max_nodes: 1}\n"
        f"job: {{workdir: '{wd}', workdir_max_bytes: 2048}}\n"
        f"daemon: {{state_dir: '{tmp_path / 'state'}', socket: '{sockdir / 'd.sock'}'}}\n"
        "providers: {local: {launch_delay_s: 3600}}\n"
        "offers: [{provider: local, zone: local-a}]\n"
    )
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()  # the daemon's own log lines, then the one line
    assert err[-1].startswith(f"spotvisord run: job.workdir: {wd} holds over 2048 bytes"), err[-3:]
    assert "Traceback" not in r.stderr
