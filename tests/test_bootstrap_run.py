"""The node bootstrap, run: the user data the daemon renders, executed by bash on this machine.

What is real: the wheel (built from this tree by the daemon's own code), its publication
to moto's S3 server and the presigned URL the node fetches it through (curl), the sha256
check, the virtualenv (``python -m venv`` of a Python standing in for the image's), pip
installing the wheel and the agent's requirements, the unit file and the env file.

What is not: ``systemctl``, ``useradd`` and ``getent`` are shims on ``PATH`` that record
their arguments; every path the script writes is under ``$SPOTVISOR_ROOT`` (a tmp
directory); pip installs offline (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``: pip's own
settings, which the script leaves alone) from a wheelhouse of the agent's requirements,
packed from this test's own installed distributions (:func:`repack_installed`), so
nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
from packaging.requirements import Requirement

from daemon.providers.agent_wheel import AGENT_REQUIREMENTS, own_wheel, publish, repack_installed, signed_url
from daemon.providers.base import AgentWheelRef, NodeSpec
from daemon.providers.bootstrap import render_user_data
from trainer.storage import S3Store

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # a wheel build, two virtualenvs and pip: ~30 s on 2 cores


def requirement_closure(requirements: tuple[str, ...]) -> set[str]:
    """The distributions ``requirements`` install (names as installed), their
    dependencies' included, markers evaluated for this interpreter, no extras."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        dist = importlib.metadata.distribution(req.name)
        name = dist.metadata["Name"]
        if name in seen:
            continue
        seen.add(name)
        for spec in dist.requires or []:
            dep = Requirement(spec)
            if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                todo.append(dep)
    return seen


def _shim(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path``: relative name -> (size, mtime_ns)."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    house = tmp_path_factory.mktemp("wheelhouse")
    for name in sorted(requirement_closure(AGENT_REQUIREMENTS)):
        repack_installed(name, house)
    return house


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory):
    return own_wheel(None, tmp_path_factory.mktemp("built"))


class Node:
    """A directory standing for a fresh instance: its root, shims and the image's Python."""

    def __init__(self, tmp: Path, wheelhouse: Path) -> None:
        self.root = tmp / "root"
        self.root.mkdir()
        self.log = tmp / "calls.log"
        bin_dir = tmp / "shims"
        bin_dir.mkdir()
        for name in ("systemctl", "useradd"):
            _shim(bin_dir, name, f'echo "{name} $*" >> {self.log}')
        _shim(bin_dir, "getent", "exit 2")  # no spotvisor user yet
        # the image's Python: this interpreter's base installation, never a virtualenv
        self.image_python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
        _shim(bin_dir, "python3", f'exec {self.image_python} "$@"')
        self.env = {"PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(tmp), "SPOTVISOR_ROOT": str(self.root),
                    "TMPDIR": str(tmp), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse),
                    "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", script], env=self.env, capture_output=True, text=True, timeout=600)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


def _image_site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return Path(out.stdout.strip())


def _s3_ref(s3_server: str, wheel, data: bytes | None = None) -> AgentWheelRef:
    bucket = f"boot-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    store = S3Store(f"s3://{bucket}/job", endpoint_url=s3_server)
    assert publish(store, wheel) is True
    assert publish(store, wheel) is False  # once per version: the content-addressed key is there
    if data is not None:  # someone replaced the object in the bucket
        store.put_bytes(wheel.key, data)
    url = signed_url(store, wheel.key, 480)
    assert "X-Amz-Signature=" in url and url.startswith(s3_server)
    return AgentWheelRef(url=url, sha256=wheel.sha256, version=wheel.version)


def _node_spec(ref: AgentWheelRef) -> NodeSpec:
    return NodeSpec(node_id="p-1", pool="p", token="tok123", daemon_url="http://127.0.0.1:1", agent_wheel=ref)


def test_the_user_data_installs_the_agent_into_its_own_venv_from_the_published_wheel(
        tmp_path: Path, s3_server: str, wheel, wheelhouse: Path) -> None:
    node = Node(tmp_path, wheelhouse)
    image_site = _image_site_packages(node.image_python)
    before = _tree(image_site)
    script = render_user_data(_node_spec(_s3_ref(s3_server, wheel)), dialect="aws")

    r = node.run(script)
    assert r.returncode == 0, r.stdout + r.stderr
    root = node.root
    agent = root / "usr/local/bin/spotvisor-agent"
    assert os.readlink(agent) == str(root / "opt/spotvisor/venv/bin/spotvisor-agent")

    # the console script works from the new venv, and says the daemon's version
    h = subprocess.run([str(agent), "--help"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert h.returncode == 0 and "spotvisor node agent" in h.stdout, h.stderr
    v = subprocess.run([str(agent), "--version"], capture_output=True, text=True, timeout=60)
    assert v.stdout.strip() == f"spotvisor-agent {wheel.version}"
    # the agent's runtime imports (aiohttp client, a metadata dialect) are there: a probe of a
    # closed port fails as a probe does, with one line, no ImportError
    p = subprocess.run([str(agent), "probe", "--dialect", "aliyun", "--metadata-url", "http://127.0.0.1:9",
                        "--timeout-s", "1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stderr.startswith("spotvisor-agent probe:"), \
        p.stderr
    venv_py = root / "opt/spotvisor/venv/bin/python"
    assert subprocess.run([str(venv_py), "-c", "import torch"], capture_output=True, timeout=60).returncode != 0
    listed = subprocess.run([str(venv_py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            timeout=120, env={**node.env}).stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert installed - {"pip", "setuptools"} == \
        {n.lower() for n in requirement_closure(AGENT_REQUIREMENTS)} | {"spotvisor"}

    # the unit (the package's copy of systemd/spotvisor-agent.service) and the env file
    unit = root / "etc/systemd/system/spotvisor-agent.service"
    assert unit.read_text() == (ROOT / "systemd/spotvisor-agent.service").read_text()
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    env_file = root / "etc/spotvisor/agent.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "etc/spotvisor").stat().st_mode) == 0o700
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert env["SPOTVISOR_AGENT_TOKEN"] == "tok123"
    assert env["SPOTVISOR_TRAINER_PYTHONPATH"] == "/opt/spotvisor/pythonpath"
    # the agent (user spotvisor) can run what root installed
    assert stat.S_IMODE(venv_py.resolve().stat().st_mode) & 0o005 == 0o005
    assert stat.S_IMODE((root / "opt/spotvisor/venv").stat().st_mode) == 0o755
    # only trainer/ for the image's Python, which then imports it from there
    pythonpath = root / "opt/spotvisor/pythonpath"
    assert sorted(p.name for p in pythonpath.iterdir()) == ["trainer"]
    t = subprocess.run([str(node.image_python), "-c", "import trainer.contract; print(trainer.contract.__file__)"],
                       capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(pythonpath)}, cwd=tmp_path)
    assert t.stdout.strip() == str(pythonpath / "trainer/contract.py"), t.stderr

    calls = node.calls()
    assert any(c.startswith("useradd --system") and c.endswith(" spotvisor") for c in calls), calls
    assert calls[-2:] == ["systemctl daemon-reload", "systemctl enable --now spotvisor-agent.service"]
    assert _tree(image_site) == before  # the image's Python: not a file added, changed or removed

    # run again (a baked image with this version): nothing fetched or installed
    venv_files = _tree(root / "opt/spotvisor/venv")
    again = node.run(script)
    assert again.returncode == 0 and "skipping the install" in again.stderr, again.stderr
    assert _tree(root / "opt/spotvisor/venv") == venv_files


def test_a_tampered_wheel_installs_nothing(tmp_path: Path, s3_server: str, wheel, wheelhouse: Path) -> None:
    data = bytearray(wheel.path.read_bytes())
    data[-100] ^= 0xFF  # one byte changed in the bucket after the daemon published it
    node = Node(tmp_path, wheelhouse)
    r = node.run(render_user_data(_node_spec(_s3_ref(s3_server, wheel, bytes(data))), dialect="aws"))
    assert r.returncode == 1
    got = hashlib.sha256(bytes(data)).hexdigest()
    assert f"agent wheel sha256 {got}, expected {wheel.sha256}: refusing to install it" in r.stderr
    assert not (node.root / "opt").exists() and not (node.root / "usr").exists()
    assert not (node.root / "etc/systemd").exists()
    assert not any(c.startswith("systemctl") for c in node.calls())
