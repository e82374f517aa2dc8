"""The docs' walkthroughs run as written: every ``sh`` block of ``docs/first-pool-aws.md``
(the AWS CLI, then ``spotvisord``), in order, in one bash, against moto's server; every
``sh`` block of ``docs/first-pool-aliyun.md`` against the ECS and OSS fakes.

What the test arranges is what a real account already has and the reader is told to
have: the AWS Deep Learning AMI in each region (an image owned by ``amazon``), the control
node (an instance tagged ``Name=spotvisor-control``), a Hugging Face token in the
environment. Nothing else: the docs' own commands make the bucket, the roles, the
security group, the config, and run the checks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def sh_blocks(doc: Path) -> list[str]:
    """The ``sh`` fenced blocks of a markdown file, in order."""
    return re.findall(r"^```sh\n(.*?)^```$", doc.read_text(), flags=re.S | re.M)


def _run_doc(doc: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = "set -euo pipefail\n" + "\n".join(sh_blocks(doc))
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _workspace(tmp_path: Path) -> Path:
    """A directory like the reader's clone: the commands read ``configs/`` relative to it."""
    ws = tmp_path / "clone"
    ws.mkdir()
    shutil.copytree(REPO / "configs", ws / "configs")
    return ws


def _dlami(region: str) -> str:
    """A Deep Learning AMI (owner alias ``amazon``, as AWS publishes it) in ``region`` of
    moto's account, with its own id there: AMI ids are per region."""
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.amis import Ami
    from moto.ec2.utils import random_ami_id

    backend = ec2_backends["123456789012"][region]
    ami_id = random_ami_id()
    backend.amis[ami_id] = Ami(backend, ami_id=ami_id, owner_alias="amazon", public=True,
                               name="Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Ubuntu 24.04) 20261120",
                               root_device_name="/dev/sda1", architecture="x86_64")
    return ami_id


def _control_node(endpoint: str) -> str:
    import boto3

    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    inst = ec2.run_instances(ImageId=image, InstanceType="m7i.large", MinCount=1, MaxCount=1,
                             TagSpecifications=[{"ResourceType": "instance",
                                                 "Tags": [{"Key": "Name", "Value": "spotvisor-control"}]}])
    return inst["Instances"][0]["InstanceId"]


def test_first_pool_on_aws_runs_as_written(tmp_path: Path, ec2_server: str) -> None:
    ami = _dlami("us-east-1")
    control = _control_node(ec2_server)
    ws = _workspace(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    token = "hf_" + uuid.uuid4().hex
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(home), "AWS_ENDPOINT_URL": ec2_server,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "HF_TOKEN": token, "LANG": "C.UTF-8"}
    done = _run_doc(REPO / "docs" / "first-pool-aws.md", ws, env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "Traceback" not in out
    assert f"image: {ami}" in done.stdout
    config = (ws / "llama-ft.yaml").read_text()
    assert f"image_id: {ami}" in config and "$" not in config  # every variable was filled in
    checks = [ln for ln in done.stdout.splitlines() if ln.startswith(("ok ", "FAIL"))]
    assert checks and not [ln for ln in checks if ln.startswith("FAIL")], "\n".join(checks)
    for what in ("credentials resolve", f"image {ami}", "dry-run launch of offers.0", "dry-run launch of offers.1",
                 "store s3://spotvisor-ckpt-123456789012/llama-ft"):
        assert any(what in ln for ln in checks), (what, checks)
    assert re.search(r"^all \d+ checks ok$", done.stdout, re.M)
    assert token not in out  # the secret went to SSM, not to any output

    import boto3

    iam = boto3.client("iam", endpoint_url=ec2_server, region_name="us-east-1")
    profile = iam.get_instance_profile(InstanceProfileName="spotvisor-node")["InstanceProfile"]
    assert [r["RoleName"] for r in profile["Roles"]] == ["spotvisor-node"]
    ec2 = boto3.client("ec2", endpoint_url=ec2_server, region_name="us-east-1")
    assoc = ec2.describe_iam_instance_profile_associations(
        Filters=[{"Name": "instance-id", "Values": [control]}])["IamInstanceProfileAssociations"]
    assert assoc and assoc[0]["IamInstanceProfile"]["Arn"].endswith("/spotvisor-control")
    ssm = boto3.client("ssm", endpoint_url=ec2_server, region_name="us-east-1")
    assert ssm.get_parameter(Name="/llama-ft/hf-token", WithDecryption=True)["Parameter"]["Value"] == token
    assert not ec2.describe_instances(Filters=[{"Name": "tag:spotvisor-pool", "Values": ["llama-ft"]}])[
        "Reservations"]  # the check bought nothing
