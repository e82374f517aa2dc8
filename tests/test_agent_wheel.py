"""The agent's wheel and what a node is handed: the agent's requirements, the packaged unit,
the daemon's publication before its first launch (and its refusal to buy without one), the
user data's size, and ``job.python`` reaching the trainer's interpreter.

The rendered script itself is run in tests/test_bootstrap_run.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import boto3
import pytest

from conftest import RecordingProvider, started_daemon
from daemon.config import Config
from daemon.controlnode import tls
from daemon.controlnode.jobspec import job_spec
from daemon.gpunode.trainer_process import TrainerProcess
from daemon.model import Node
from daemon.providers.agent_wheel import AGENT_REQUIREMENTS, KEY_PREFIX, signed_url
from daemon.providers.base import AgentWheelRef, NodeSpec
from daemon.providers.bootstrap import MAX_USER_DATA_BYTES, render_user_data
from daemon.control.lifecycle import TrainerState
from test_bootstrap_run import requirement_closure
from trainer.contract import TRAINER_PYTHONPATH_ENV
from trainer.storage import S3Store

ROOT = Path(__file__).resolve().parent.parent

# what the agent process does at run time beyond its import: parse its flags, make each
# dialect's metadata client, the GPU sampler; then the distributions of every module loaded
_AGENT_IMPORTS = """
import asyncio, importlib.metadata as md, json, sys
import daemon.gpunode.agent as agent
from daemon.gpunode.gpu import NvmlSampler
from daemon.gpunode.metadata.registry import DEFAULT_URLS, DIALECTS, make_client
agent._parse(["run", "--daemon-url", "http://127.0.0.1:1", "--node-id", "n"])
async def clients():
    for d in DIALECTS:
        await make_client(d, DEFAULT_URLS[d], timeout_s=1).aclose()
asyncio.run(clients())
owners = md.packages_distributions()
tops = {m.split(".")[0] for m in sys.modules if not m.startswith("_")}  # _distutils_hack: site's, not ours
tops -= set(sys.stdlib_module_names) | {"daemon", "trainer"}
print(json.dumps(sorted({d for t in tops for d in owners.get(t, [])})))
"""
# structlog imports these for its console renderer when they are installed (not needed)
_OPTIONAL = {"rich", "Pygments", "colorama", "better-exceptions"}


def test_the_agent_imports_nothing_but_its_requirements() -> None:
    r = subprocess.run([sys.executable, "-c", _AGENT_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    imported = set(json.loads(r.stdout))
    assert imported - _OPTIONAL <= requirement_closure(AGENT_REQUIREMENTS), imported
    assert "torch" not in imported and "transformers" not in imported
    # each requirement is pyproject's own specifier, so the venv gets what the daemon was tested with
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert set(AGENT_REQUIREMENTS) <= set(deps)


def test_the_packaged_unit_is_the_systemd_unit() -> None:
    import importlib.resources

    packaged = importlib.resources.files("daemon.gpunode").joinpath("spotvisor-agent.service").read_text()
    assert packaged == (ROOT / "systemd/spotvisor-agent.service").read_text()
    assert "ExecStart=/usr/local/bin/spotvisor-agent run" in packaged  # where the bootstrap links the venv's


def test_the_user_data_of_a_realistic_node_fits_ec2_and_alibaba(tmp_path: Path, monkeypatch) -> None:
    """A TLS daemon's CA and an S3 presigned URL signed with an instance role's session
    token (long), as a node on the Deep Learning AMI gets them."""
    _, _, ca_pem = tls.ensure_own_ca(tmp_path / "tls", "10.0.0.5")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ASIA" + "X" * 16)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s" * 40)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "IQoJb3JpZ2luX2VjE" + "A" * 1100)  # an instance role's, ~1.1 KB
    store = S3Store("s3://my-training-bucket/jobs/llama", client=boto3.client("s3", region_name="us-west-2"))
    key = f"{KEY_PREFIX}/{'a' * 64}/spotvisor-0.1.0-py3-none-any.whl"
    url = signed_url(store, key, 780)  # offline: signing needs no request
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in url and "X-Amz-Expires=780" in url
    node = NodeSpec(node_id="llama-pool-0007", pool="llama-pool", token="t" * 43, daemon_url="https://10.0.0.5:7480",
                    ca_cert_pem=ca_pem.decode(), agent_wheel=AgentWheelRef(url=url, sha256="a" * 64, version="0.1.0"))
    script = render_user_data(node, dialect="aws").encode()
    print(f"user data: {len(script)} bytes, {len(base64.b64encode(script))} in base64")
    assert len(script) < 8 * 1024  # half of EC2's 16 KiB: room for the scratch mount and what else comes
    assert len(base64.b64encode(script)) < 32 * 1024  # Alibaba's limit is on the base64


def test_the_user_data_refuses_a_malformed_wheel_reference() -> None:
    base = dict(node_id="p-1", pool="p", token="t", daemon_url="http://127.0.0.1:1")
    good = AgentWheelRef(url="https://b/k?a=1&b='x'", sha256="0" * 64, version="0.1.0")
    assert "URL='https://b/k?a=1&b='\"'\"'x'\"'\"''" in render_user_data(NodeSpec(**base, agent_wheel=good),
                                                                       dialect="aws")
    for bad, field in ((AgentWheelRef(url=good.url, sha256="0" * 63, version="0.1.0"), "sha256"),
                       (AgentWheelRef(url=good.url, sha256="0" * 64, version="0.1.0; rm -rf /"), "version"),
                       (AgentWheelRef(url="ftp://h/x", sha256="0" * 64, version="0.1.0"), "url"),
                       (AgentWheelRef(url="https://h/x\nrm -rf /", sha256="0" * 64, version="0.1.0"), "url")):
        with pytest.raises(ValueError, match=f"agent_wheel.{field}"):
            render_user_data(NodeSpec(**base, agent_wheel=bad), dialect="aws")
    huge = AgentWheelRef(url="https://h/x?" + "a" * MAX_USER_DATA_BYTES, sha256="0" * 64, version="0.1.0")
    with pytest.raises(ValueError, match="over EC2's 16384"):
        render_user_data(NodeSpec(**base, agent_wheel=huge), dialect="aws")


class CloudProvider(RecordingProvider):
    """A provider whose nodes boot from the bootstrap's user data (as aws and aliyun)."""

    installs_agent = True


def _config(tmp_path: Path, sockdir: Path, **daemon) -> Config:
    return Config.model_validate({
        "pool": {"name": "w", "min_nodes": 1, "target_nodes": 2, "max_nodes": 2},
        "job": {"id": "j", "module": "standin_trainer", "global_batch_size": 16, "micro_batch_size": 1},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": str(sockdir / "d.sock"),
                   "reconcile_interval_s": 0.05, **daemon},
    })


async def test_the_daemon_publishes_its_wheel_once_before_the_first_launch(tmp_path: Path, sockdir: Path,
                                                                            store) -> None:
    config = _config(tmp_path, sockdir)
    provider = CloudProvider()
    async with started_daemon(config, provider, store, str(sockdir / "d.sock")) as (sup, _):
        async with asyncio.timeout(120):  # a wheel build from this tree: seconds
            while len(provider.launched) < 2:
                await sup.wait_for_events(sup.store.last_seq(), timeout_s=0.05)
    refs = [spec.agent_wheel for spec, _ in provider.launched]
    assert refs[0] == refs[1] and refs[0] is not None
    published = sorted((tmp_path / "state/checkpoints" / KEY_PREFIX).rglob("*.whl"))
    assert len(published) == 1  # once, for both launches
    assert refs[0].url == published[0].as_uri()
    assert hashlib.sha256(published[0].read_bytes()).hexdigest() == refs[0].sha256
    assert refs[0].version == sup.fleet.agent_wheels._wheel.version  # the daemon's own version
    assert published[0].parent.name == refs[0].sha256  # content-addressed


async def test_a_daemon_without_its_wheel_buys_nothing_and_says_why(tmp_path: Path, sockdir: Path, store) -> None:
    config = _config(tmp_path, sockdir, agent_wheel=str(tmp_path / "missing.whl"))
    provider = CloudProvider()
    async with started_daemon(config, provider, store, str(sockdir / "d.sock")) as (sup, _):
        async with asyncio.timeout(60):
            while not sup.store.events(kinds=["node_launch_failed"]):
                await sup.wait_for_events(sup.store.last_seq(), timeout_s=0.05)
        failed = sup.store.events(kinds=["node_launch_failed"])[0]
    assert provider.launched == []
    assert failed.data["error"] == "agent_wheel"
    assert failed.data["message"] == f"daemon.agent_wheel: {tmp_path / 'missing.whl'}: no such file (build one with " \
                                     "`pip wheel --no-deps .`)"


async def test_an_image_that_carries_the_agent_gets_no_wheel(tmp_path: Path, sockdir: Path, store) -> None:
    config = _config(tmp_path, sockdir, agent_install="image", agent_wheel=str(tmp_path / "missing.whl"))
    provider = CloudProvider()
    async with started_daemon(config, provider, store, str(sockdir / "d.sock")) as (sup, _):
        async with asyncio.timeout(60):
            while len(provider.launched) < 2:
                await sup.wait_for_events(sup.store.last_seq(), timeout_s=0.05)
    assert [spec.agent_wheel for spec, _ in provider.launched] == [None, None]
    assert "command -v spotvisor-agent" in render_user_data(provider.launched[0][0], dialect="aws")


# -- job.python ------------------------------------------------------------------------------

def test_job_python_is_in_the_spec_the_agent_runs(tmp_path: Path, sockdir: Path) -> None:
    config = Config.model_validate({"job": {"python": "/opt/conda/bin/python"},
                                    "daemon": {"state_dir": str(tmp_path / "s")}})
    node = Node(id="n-1", ordinal=1, provider="local", region="r", zone=None, instance_type="t", gpus=1,
                price_usd_h=0.0, token="t")
    assert job_spec(config, node, "abcd")["python"] == "/opt/conda/bin/python"
    assert "python" not in job_spec(Config.model_validate({"daemon": {"state_dir": str(tmp_path / "s")}}), node, "ab")
    with pytest.raises(Exception, match="(?s)job.python.*not an absolute path"):
        Config.model_validate({"job": {"python": "python3"}})


async def test_the_trainer_runs_on_job_python_with_the_trainer_package_first(tmp_path: Path, monkeypatch) -> None:
    """The image's interpreter (here a script that records how it was run) runs torchrun;
    no prewarmed launcher (that is spotvisor's own module, in the agent's venv only)."""
    record = tmp_path / "ran.json"
    image_python = tmp_path / "python"
    image_python.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                            f"json.dump({{'argv': sys.argv[1:], 'PYTHONPATH': os.environ.get('PYTHONPATH')}}, "
                            f"open({str(record)!r}, 'w'))\n")
    image_python.chmod(0o755)
    pythonpath = tmp_path / "pythonpath"
    (pythonpath / "trainer").mkdir(parents=True)
    monkeypatch.setenv(TRAINER_PYTHONPATH_ENV, str(pythonpath))
    monkeypatch.setenv("PYTHONPATH", "/the/users/own")
    changes: list[TrainerState] = []
    runner = TrainerProcess(workdir=tmp_path, node_id="n-1", on_change=lambda: changes.append(runner.state))
    runner.job = {"argv": ["-m", "torch.distributed.run", "--nnodes=1:2", "-m", "trainer.run"], "env": {},
                  "python": str(image_python)}
    await runner.prewarm()
    assert runner.warm is None and runner.state is TrainerState.NOT_STARTED
    await runner.start()
    assert await runner.proc.wait() == 0
    ran = json.loads(record.read_text())
    assert ran["argv"] == ["-m", "torch.distributed.run", "--nnodes=1:2", "-m", "trainer.run"]
    assert ran["PYTHONPATH"] == f"{pythonpath}{os.pathsep}/the/users/own"
    assert changes == [TrainerState.RUNNING]


def _counting_builds(monkeypatch, cache: Path) -> list[Path]:
    from daemon.providers import agent_wheel

    builds: list[Path] = []
    real = agent_wheel._build_from_source

    def counting(source: Path, out_dir: Path) -> Path:
        builds.append(out_dir)
        return real(source, out_dir)

    monkeypatch.setattr(agent_wheel, "_build_from_source", counting)
    monkeypatch.setattr(agent_wheel, "_MADE", {})
    monkeypatch.setenv("SPOTVISOR_CACHE_DIR", str(cache))
    return builds


def test_the_wheel_is_made_once_per_process_for_the_same_place(tmp_path: Path, monkeypatch) -> None:
    """An HA standby builds the wheel while it waits; the leader it becomes asks again with
    the same arguments and gets that wheel at once, with no second build (4-30 s)."""
    from daemon.providers import agent_wheel

    builds = _counting_builds(monkeypatch, tmp_path / "cache")
    first = agent_wheel.own_wheel(None, tmp_path / "w")
    again = agent_wheel.own_wheel(None, tmp_path / "w")
    assert again is first and len(builds) == 1
    first.path.unlink()  # gone from the daemon's folder: taken again from the cache, not built
    assert agent_wheel.own_wheel(None, tmp_path / "w").path.is_file() and len(builds) == 1


def test_a_restarted_daemon_takes_the_wheel_built_from_the_same_code(tmp_path: Path, monkeypatch) -> None:
    """A daemon restarted on the same code (crash, takeover, redeploy) takes the cached
    wheel: the same bytes and key, into its own folder, with no build; a cache that others
    can write is not trusted (its wheel would run on every node): built anew, into the
    daemon's folder."""
    from daemon.providers import agent_wheel

    cache = tmp_path / "cache" / "agent-wheels"
    builds = _counting_builds(monkeypatch, tmp_path / "cache")
    first = agent_wheel.own_wheel(None, tmp_path / "a")
    monkeypatch.setattr(agent_wheel, "_MADE", {})  # a new process
    second = agent_wheel.own_wheel(None, tmp_path / "b")
    assert len(builds) == 1 and builds[0].parent == cache
    assert (second.sha256, second.key) == (first.sha256, first.key) and second.path.parent == tmp_path / "b"
    entries = [p for p in cache.iterdir() if p.is_dir()]
    assert len(entries) == 1 and [w.name for w in entries[0].iterdir()] == [first.path.name]
    cache.chmod(0o777)
    monkeypatch.setattr(agent_wheel, "_MADE", {})
    third = agent_wheel.own_wheel(None, tmp_path / "c")
    assert len(builds) == 2 and builds[1] == tmp_path / "c" and third.sha256 == first.sha256  # reproducible


def test_the_source_digest_follows_the_code_and_ignores_bytecode(tmp_path: Path) -> None:
    """The cache key changes with any file the wheel is built from (a package's module, the
    build's pyproject.toml, the version) and not with what the build never reads."""
    from daemon.providers.agent_wheel import source_digest

    src = tmp_path / "src"
    for rel in ("pyproject.toml", "daemon/__init__.py", "daemon/x.py", "trainer/__init__.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(f"# {rel}\n")
    base = source_digest(src, "1.0")
    (src / "daemon" / "__pycache__").mkdir()
    (src / "daemon" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (src / "notes.txt").write_text("not built")
    assert source_digest(src, "1.0") == base
    assert source_digest(src, "1.1") != base
    (src / "daemon" / "x.py").write_text("# changed\n")
    changed = source_digest(src, "1.0")
    assert changed != base
    (src / "pyproject.toml").write_text("# changed\n")
    assert source_digest(src, "1.0") not in (base, changed)


def test_two_builds_of_one_checkout_at_once_leave_it_as_it_was(tmp_path: Path) -> None:
    """Two daemons with caches of their own build the same checkout at once (the suite's
    workers did, and one build failed): each builds a private copy of exactly the files
    the digest hashes, so both succeed, a stale ``build/lib`` module (left by an old in-tree
    build) never reaches a wheel, and the checkout gains no ``build/`` or ``*.egg-info``."""
    import zipfile
    from concurrent.futures import ThreadPoolExecutor

    from daemon.providers.agent_wheel import _build_from_source

    src = tmp_path / "src"
    files = {"pyproject.toml": '[project]\nname = "spotvisor"\nversion = "0.0.1"\n'
                               '[tool.setuptools.packages.find]\ninclude = ["daemon*", "trainer*"]\n',
             "daemon/__init__.py": "", "daemon/x.py": "X = 1\n", "trainer/__init__.py": "",
             "build/lib/daemon/stale.py": "GONE = 1\n"}
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    before = sorted(p.relative_to(src).as_posix() for p in src.rglob("*"))
    with ThreadPoolExecutor(2) as pool:
        wheels = list(pool.map(lambda out: _build_from_source(src, tmp_path / out), ("a", "b")))
    for wheel in wheels:
        names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
        assert names == {"daemon/__init__.py", "daemon/x.py", "trainer/__init__.py"}, (wheel, names)
    assert sorted(p.relative_to(src).as_posix() for p in src.rglob("*")) == before
