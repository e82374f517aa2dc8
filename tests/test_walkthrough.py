"""The docs' walkthroughs run as written: every ``sh`` block of ``docs/first-pool-aws.md``
(the AWS CLI, then ``spotvisord``), in order, in one bash, against moto's server; every
``sh`` block of ``docs/first-pool-aliyun.md`` against the ECS and OSS fakes.

What the test arranges is what a real account already has and the reader is told to
have: a fresh account whose region has the AWS Deep Learning AMI (owned by ``amazon``), the control
node (an instance tagged ``Name=spotvisor-control``), a Hugging Face token in the
environment. Nothing else: the docs' own commands make the bucket, the roles, the
security group, the config, and run the checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from bench.ports import free_port

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


DLAMI = {"ami_id": "ami-0d1a0000000000001", "state": "available", "public": True, "owner_id": "898082745236",
         "image_location": "amazon/Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Ubuntu 24.04) 20261120",
         "sriov": "simple", "root_device_type": "ebs", "root_device_name": "/dev/sda1",
         "description": "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Ubuntu 24.04)", "image_type": "machine",
         "platform": None, "architecture": "x86_64", "virtualization_type": "hvm", "hypervisor": "xen",
         "name": "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.13 (Ubuntu 24.04) 20261120"}


@pytest.fixture
def account(tmp_path: Path) -> Iterator[str]:
    """A fresh AWS account: moto's server in its own process (the session's moto is shared
    by every test, and holds their roles and profiles), whose only image is the Deep
    Learning AMI as AWS publishes it (owner ``amazon``: moto's ``MOTO_AMIS_PATH``)."""
    amis = tmp_path / "amis.json"
    amis.write_text(json.dumps([DLAMI]))
    port = free_port()
    proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "MOTO_AMIS_PATH": str(amis)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # up when it answers (its start is an import of moto: seconds)
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (exit {proc.poll()})") from None
                time.sleep(0.2)  # polling a server's readiness, not ordering two of our own steps
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}  # moto takes any


def _control_node(endpoint: str) -> str:
    """The reader's control node: an instance tagged ``Name=spotvisor-control``."""
    import boto3

    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint, **_CREDS)
    inst = ec2.run_instances(ImageId=DLAMI["ami_id"], InstanceType="m7i.large", MinCount=1, MaxCount=1,
                             TagSpecifications=[{"ResourceType": "instance",
                                                 "Tags": [{"Key": "Name", "Value": "spotvisor-control"}]}])
    return inst["Instances"][0]["InstanceId"]


def test_first_pool_on_aws_runs_as_written(tmp_path: Path, account: str) -> None:
    ec2_server, ami = account, DLAMI["ami_id"]
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
    checks = [ln for ln in done.stdout.splitlines() if ln.startswith(("ok ", "skip ", "FAIL"))]
    assert checks and not [ln for ln in checks if ln.startswith("FAIL")], "\n".join(checks)
    for what in ("credentials resolve", f"image {ami}", "dry-run launch of offers.0", "dry-run launch of offers.1",
                 "store s3://spotvisor-ckpt-123456789012/llama-ft"):
        assert any(what in ln and ln.startswith("ok ") for ln in checks), (what, checks)
    # moto's Service Quotas holds no EC2 quota (AWS's does): that one line is not checked, and not shown passed
    assert [ln for ln in checks if ln.startswith("skip ")] == [
        "skip aws us-east-1: quota L-7212CCBC (All P Spot Instance Requests, vCPUs) (not checked: Service Quotas "
        "has no value for it in us-east-1; the pool needs 192 vCPUs)"], checks
    assert re.search(rf"^{len(checks) - 1} checks ok, 1 not checked$", done.stdout, re.M)
    assert token not in out  # the secret went to SSM, not to any output

    import boto3

    iam = boto3.client("iam", endpoint_url=ec2_server, region_name="us-east-1", **_CREDS)
    profile = iam.get_instance_profile(InstanceProfileName="spotvisor-node")["InstanceProfile"]
    assert [r["RoleName"] for r in profile["Roles"]] == ["spotvisor-node"]
    ec2 = boto3.client("ec2", endpoint_url=ec2_server, region_name="us-east-1", **_CREDS)
    assoc = ec2.describe_iam_instance_profile_associations(
        Filters=[{"Name": "instance-id", "Values": [control]}])["IamInstanceProfileAssociations"]
    assert assoc and assoc[0]["IamInstanceProfile"]["Arn"].endswith("/spotvisor-control")
    ssm = boto3.client("ssm", endpoint_url=ec2_server, region_name="us-east-1", **_CREDS)
    assert ssm.get_parameter(Name="/llama-ft/hf-token", WithDecryption=True)["Parameter"]["Value"] == token
    assert not ec2.describe_instances(Filters=[{"Name": "tag:spotvisor-pool", "Values": ["llama-ft"]}])[
        "Reservations"]  # the check bought nothing


_ALI_AK, _ALI_SK = "LTAI-walkthrough", "walkthrough-secret"


async def test_first_pool_on_alibaba_runs_as_written(tmp_path: Path, oss_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console's values (image, security group, vSwitches, bucket) come from the
    environment, as the doc says; the config's endpoints are pointed at the fakes before
    ``spotvisord check`` (the real ones are the SDKs' defaults and the doc's OSS endpoint)."""
    import asyncio

    import yaml

    from fakes.ecs import FakeEcs
    from fakes.kms import FakeKms

    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    oss_server.create_bucket(bucket)
    ws = _workspace(tmp_path)
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "ACCOUNT": "1234567890123456", "BUCKET": bucket, "IMAGE": "m-bp1walkthrough0000", "SG": "sg-bp1walk0000",
           "VSW_H": "vsw-bp1walkh", "VSW_I": "vsw-bp1walki", "PRIVATE_IP": "172.16.0.10",
           "ALIBABA_CLOUD_ACCESS_KEY_ID": _ALI_AK, "ALIBABA_CLOUD_ACCESS_KEY_SECRET": _ALI_SK,
           "OSS_ACCESS_KEY_ID": os.environ["OSS_ACCESS_KEY_ID"], "OSS_ACCESS_KEY_SECRET": os.environ["OSS_ACCESS_KEY_SECRET"],
           "SPOTVISOR_OSS_REGION": "cn-hangzhou"}
    blocks = sh_blocks(REPO / "docs" / "first-pool-aliyun.md")
    assert blocks[-1].strip() == "spotvisord check qwen-sft.yaml"

    async def bash(script: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec("bash", "-c", "set -euo pipefail\n" + script, cwd=ws, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 300)
        return proc.returncode or 0, out.decode(), err.decode()

    rc, out, err = await bash("\n".join(blocks[:-1]))
    assert rc == 0, (out + err)[-4000:]
    assert "qwen-sft.yaml: ok" in out
    for name in ("gpu-node-policy.json", "control-node-policy.json"):
        text = (ws / name).read_text()
        assert bucket in text and "CHECKPOINT_BUCKET" not in text and "ACCOUNT_ID" not in text
    config_path = ws / "qwen-sft.yaml"
    cfg = yaml.safe_load(config_path.read_text())
    assert cfg["domains"][0]["launch"]["image_id"] == "m-bp1walkthrough0000"
    async with FakeEcs(access_key_id=_ALI_AK, access_key_secret=_ALI_SK) as ecs, \
            FakeKms(access_key_id=_ALI_AK, access_key_secret=_ALI_SK) as kms:
        kms.put("qwen-sft-hf-token", "hf_" + uuid.uuid4().hex)  # the doc's job.secrets.HF_TOKEN, which check reads
        env["SPOTVISOR_KMS_ENDPOINT"] = kms.endpoint
        ecs.images["cn-hangzhou"] = {env["IMAGE"]}
        ecs.security_groups["cn-hangzhou"] = {env["SG"]}
        ecs.ram_roles = {"spotvisor-node"}
        ecs.available = {(z, "ecs.gn7i-c32g1.8xlarge") for z in ("cn-hangzhou-h", "cn-hangzhou-i")}
        cfg["providers"]["aliyun"]["endpoint"] = ecs.endpoint  # the fakes stand in for the clouds' endpoints
        cfg["job"]["oss_endpoint"] = oss_server.endpoint
        config_path.write_text(yaml.safe_dump(cfg))
        rc, out, err = await bash(blocks[-1])
        assert rc == 0, (out + err)[-4000:]
        assert "Traceback" not in out + err
        checks = [ln for ln in out.splitlines() if ln.startswith(("ok ", "FAIL"))]
        assert checks and not [ln for ln in checks if ln.startswith("FAIL")], "\n".join(checks)
        assert any(f"store oss://{bucket}/qwen-sft" in ln for ln in checks)
        assert "ok   job.secrets.HF_TOKEN (kms:qwen-sft-hf-token?region=cn-hangzhou): read" in "\n".join(checks)
        assert [r["SecretName"] for r in kms.requests] == ["qwen-sft-hf-token"]
        dry = ecs.calls("RunInstances", dry_run=True)
        assert len(dry) == 2 and all(p["RamRoleName"] == "spotvisor-node" and p["ImageId"] == env["IMAGE"]
                                     and p["SystemDisk.Category"] == "cloud_essd" for p in dry)
        assert ecs.instances == {}  # the check bought nothing
