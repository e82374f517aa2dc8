"""The instance-store scratch snippet (daemon/providers/scratch.py), run by bash with the
disk tools replaced by PATH shims that record their arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from daemon.providers.base import NodeSpec
from daemon.providers.bootstrap import render_user_data
from daemon.providers.scratch import INSTANCE_STORE_MODEL, SCRATCH_DIR, scratch_snippet

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

_EBS = "Amazon Elastic Block Store"


def _shims(tmp: Path, disks: list[tuple[str, str]], *, fail: str | None = None, user: bool = True) -> Path:
    """A bin directory whose lsblk prints ``disks`` and whose mdadm, mkfs.ext4, mount,
    mountpoint, chown and id append their argv to calls.log (``fail``: that one exits 1)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    log = tmp / "calls.log"
    listing = "".join(f"{name} {model}\n" for name, model in disks)
    (tmp / "lsblk.out").write_text(listing)
    scripts = {
        "lsblk": f'echo "lsblk $*" >> {log}\ncat {tmp / "lsblk.out"}\n',
        "mountpoint": f'echo "mountpoint $*" >> {log}\nexit 1\n',  # nothing mounted yet
        "id": f'echo "id $*" >> {log}\nexit {0 if user else 1}\n',
    }
    for tool in ("mdadm", "mkfs.ext4", "mount", "chown"):
        scripts[tool] = f'echo "{tool} $*" >> {log}\nexit {1 if tool == fail else 0}\n'
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def _run(tmp: Path, bin_dir: Path) -> tuple[subprocess.CompletedProcess[str], list[str], Path, Path]:
    scratch, fstab = tmp / "agent" / "scratch", tmp / "fstab"
    fstab.write_text("LABEL=cloudimg-rootfs / ext4 defaults 0 1\n")
    script = "set -euo pipefail\n" + scratch_snippet(scratch_dir=str(scratch), fstab=str(fstab)) + "echo AGENT_STARTS\n"
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.run([BASH, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    log = tmp / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, scratch, fstab


def test_eight_instance_store_disks_become_one_raid0_mounted_at_scratch(tmp_path: Path) -> None:
    """p5.48xlarge: 8 instance-store NVMe disks next to the EBS root: only the 8 are striped,
    formatted once and mounted at the scratch dir; fstab keeps it over a reboot."""
    disks = [("/dev/nvme0n1", _EBS)] + [(f"/dev/nvme{i}n1", INSTANCE_STORE_MODEL) for i in range(1, 9)]
    proc, calls, scratch, fstab = _run(tmp_path, _shims(tmp_path, disks))
    assert proc.returncode == 0, proc.stderr
    assert "AGENT_STARTS" in proc.stdout
    (mdadm,) = [c for c in calls if c.startswith("mdadm")]
    assert "--level=0" in mdadm and "--raid-devices=8" in mdadm
    assert mdadm.split()[-8:] == [f"/dev/nvme{i}n1" for i in range(1, 9)]  # never the EBS root
    assert [c for c in calls if c.startswith("mkfs.ext4")] == [
        "mkfs.ext4 -q -F -L spotvisor-scr -E nodiscard,lazy_itable_init=1 /dev/md/spotvisor-scratch"]
    assert f"mount -o noatime /dev/md/spotvisor-scratch {scratch}" in calls
    assert f"chown spotvisor:spotvisor {scratch}" in calls
    assert fstab.read_text().splitlines()[-1] == f"LABEL=spotvisor-scr {scratch} ext4 noatime,nofail 0 2"
    assert scratch.is_dir()


def test_one_disk_is_formatted_without_raid(tmp_path: Path) -> None:
    disks = [("/dev/nvme0n1", _EBS), ("/dev/nvme1n1", INSTANCE_STORE_MODEL)]
    proc, calls, scratch, _ = _run(tmp_path, _shims(tmp_path, disks, user=False))
    assert proc.returncode == 0, proc.stderr
    assert not any(c.startswith("mdadm") for c in calls)
    assert "mkfs.ext4 -q -F -L spotvisor-scr -E nodiscard,lazy_itable_init=1 /dev/nvme1n1" in calls
    assert f"mount -o noatime /dev/nvme1n1 {scratch}" in calls
    assert not any(c.startswith("chown") for c in calls)  # no spotvisor user yet: the unit re-owns it


def test_no_instance_store_touches_nothing(tmp_path: Path) -> None:
    proc, calls, _, fstab = _run(tmp_path, _shims(tmp_path, [("/dev/nvme0n1", _EBS)]))
    assert proc.returncode == 0 and "AGENT_STARTS" in proc.stdout
    assert not any(c.split()[0] in ("mdadm", "mkfs.ext4", "mount") for c in calls)
    assert fstab.read_text().count("\n") == 1
    assert "scratch stays on the root volume" in proc.stderr


def test_a_failed_format_still_lets_the_agent_start(tmp_path: Path) -> None:
    """Under the bootstrap's ``set -e`` a failing mkfs must not stop the script: the node
    would never register and be replaced in a loop."""
    disks = [("/dev/nvme1n1", INSTANCE_STORE_MODEL), ("/dev/nvme2n1", INSTANCE_STORE_MODEL)]
    proc, calls, _, fstab = _run(tmp_path, _shims(tmp_path, disks, fail="mkfs.ext4"))
    assert proc.returncode == 0 and "AGENT_STARTS" in proc.stdout
    assert not any(c.startswith("mount ") for c in calls)
    assert "spotvisor-scr" not in fstab.read_text()
    assert "instance-store scratch not set up" in proc.stderr


def test_user_data_carries_the_snippet_only_when_asked() -> None:
    node = NodeSpec(node_id="n1", pool="p", token="tok", daemon_url="http://10.0.0.5:7480")
    with_scratch = render_user_data(node, dialect="aws", scratch=True)
    assert SCRATCH_DIR in with_scratch
    assert with_scratch.index("spotvisor_scratch ||") < with_scratch.index("systemctl enable --now")
    assert "spotvisor_scratch" not in render_user_data(node, dialect="aws")
    assert len(with_scratch.encode()) < 16 * 1024  # EC2's user-data limit
