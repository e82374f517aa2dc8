"""The nodes' own credentials for their domain's checkpoint store (daemon/store_access.py):
a config whose nodes could not write a commit is refused before anything is bought."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.config import Config
from daemon.store_access import mount_type, store_access_problem

ROOT = Path(__file__).resolve().parents[1]

AWS = {"image_id": "ami-0123456789abcdef0"}
ALIYUN = {"image_id": "m-bp1exampleimage0000", "security_group_id": "sg-bp1examplegroup0000",
          "vswitch_ids": {"cn-hangzhou-h": "vsw-bp1examplevswitchh0"}}
AWS_OFFER = {"provider": "aws", "region": "us-east-1", "instance_type": "p4d.24xlarge"}
ALIYUN_OFFER = {"provider": "aliyun", "region": "cn-hangzhou", "zone": "cn-hangzhou-h",
                "instance_type": "ecs.gn7i-c32g1.8xlarge", "gpus_per_node": 1}
OSS_ENDPOINT = "https://oss-cn-hangzhou-internal.aliyuncs.com"
AWS_KEYS = {"AWS_ACCESS_KEY_ID": "ssm:/ck/id?region=us-east-1", "AWS_SECRET_ACCESS_KEY": "ssm:/ck/key?region=us-east-1"}
OSS_KEYS = {"OSS_ACCESS_KEY_ID": "kms:ck?region=cn-hangzhou#id", "OSS_ACCESS_KEY_SECRET": "kms:ck?region=cn-hangzhou#key"}


def config(provider: str, uri: str, *, role: bool = False, secrets: dict[str, str] | None = None,
           env: dict[str, str] | None = None) -> Config:
    """One cloud domain of ``provider`` with its store at ``uri``; ``role``: its nodes launch
    with an instance profile (aws) or RAM role (aliyun)."""
    launch = dict(AWS if provider == "aws" else ALIYUN)
    if role:
        launch["iam_instance_profile" if provider == "aws" else "ram_role"] = "spotvisor-node"
    job: dict[str, Any] = {"checkpoint_uri": uri, "secrets": secrets or {},
                           "env": env or {}}
    if uri.startswith("oss://"):
        job["oss_endpoint"] = OSS_ENDPOINT
    return Config.model_validate({"providers": {provider: launch}, "job": job,
                                  "offers": [AWS_OFFER if provider == "aws" else ALIYUN_OFFER]})


@pytest.mark.parametrize("provider, uri, role, secrets, field", [
    ("aws", "s3://b/ck", False, {}, "providers.aws.iam_instance_profile: the aws nodes of domain"),
    ("aws", "s3://b/ck", False, {"AWS_ACCESS_KEY_ID": "file:/etc/k#ID"}, "providers.aws.iam_instance_profile"),
    ("aws", "oss://b/ck", True, {}, "job.secrets: the aws nodes of domain"),
    ("aliyun", "oss://b/ck", False, {}, "providers.aliyun.ram_role: the aliyun nodes of domain"),
    ("aliyun", "s3://b/ck", True, {}, "job.secrets: the aliyun nodes of domain"),
    ("aliyun", "oss://b/ck", False, AWS_KEYS, "providers.aliyun.ram_role"),
], ids=["aws-s3-nothing", "aws-s3-half-a-key-pair", "aws-oss-a-profile-signs-no-oss", "aliyun-oss-nothing",
        "aliyun-s3-boto3-cannot-use-a-ram-role", "aliyun-oss-aws-keys-are-not-oss-keys"])
def test_nodes_without_credentials_for_their_store_are_refused_naming_the_field(
        provider: str, uri: str, role: bool, secrets: dict[str, str], field: str) -> None:
    problem = store_access_problem(config(provider, uri, role=role, secrets=secrets))
    assert problem is not None and problem.startswith(field), problem
    assert uri in problem and "\n" not in problem


@pytest.mark.parametrize("provider, uri, role, secrets", [
    ("aws", "s3://b/ck", True, {}),
    ("aws", "s3://b/ck", False, AWS_KEYS),
    ("aws", "oss://b/ck", False, OSS_KEYS),
    ("aliyun", "oss://b/ck", True, {}),
    ("aliyun", "oss://b/ck", False, OSS_KEYS),
    ("aliyun", "s3://b/ck", False, AWS_KEYS),
], ids=["aws-s3-profile", "aws-s3-keys", "aws-oss-keys", "aliyun-oss-ram-role", "aliyun-oss-keys", "aliyun-s3-keys"])
def test_nodes_with_a_credential_their_stores_client_uses_pass(provider: str, uri: str, role: bool,
                                                                secrets: dict[str, str]) -> None:
    assert store_access_problem(config(provider, uri, role=role, secrets=secrets)) is None


def test_keys_in_plain_job_env_count_as_given() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "example"}
    assert store_access_problem(config("aws", "s3://b/ck", env=env)) is None


def test_a_file_store_on_cloud_nodes_counts_only_on_a_network_filesystem() -> None:
    c = config("aws", "file:///mnt/ck/run", role=True)
    problem = store_access_problem(c, fs_type=lambda path: "ext4")
    assert problem is not None and problem.startswith("job.checkpoint_uri: file:///mnt/ck/run is each aws node's own")
    assert "(ext4 on the control node" in problem
    assert store_access_problem(c) is not None  # the type unknown: it does not count
    for shared in ("nfs4", "lustre", "fuse.s3fs", "fuse.juicefs"):
        assert store_access_problem(c, fs_type=lambda path, kind=shared: kind) is None, shared


def test_a_second_domains_own_store_is_judged_and_named() -> None:
    c = Config.model_validate({
        "providers": {"aws": {**AWS, "iam_instance_profile": "spotvisor-node"}, "aliyun": ALIYUN},
        "job": {"checkpoint_uri": "s3://b/ck"},
        "daemon": {"agent_host": "10.0.0.10"},
        "domains": [{"name": "use1", "provider": "aws", "region": "us-east-1"},
                    {"name": "hz", "provider": "aliyun", "region": "cn-hangzhou", "checkpoint_uri": "file:///data/ck",
                     "rendezvous": {"host": "172.16.0.10", "port": 29400}}],
        "offers": [AWS_OFFER, ALIYUN_OFFER]})
    problem = store_access_problem(c, fs_type=lambda path: "xfs")
    assert problem is not None and problem.startswith("domains.1.checkpoint_uri: file:///data/ck is each aliyun node's")


def test_nodes_that_are_this_machine_are_not_judged() -> None:
    assert store_access_problem(Config.model_validate({})) is None  # local: the daemon's own disk and environment
    c = config("aws", "s3://b/ck")
    assert store_access_problem(c, faked={"aws"}) is None  # AWS_ENDPOINT_URL: moto's "instances" run here
    faked = Config.model_validate({**c.model_dump(mode="json", exclude_unset=True),
                                   "providers": {"aws": {**AWS, "endpoint_url": "http://127.0.0.1:5000"}}})
    assert store_access_problem(faked) is None


CREDENTIALS = ("role", "aws_keys", "oss_keys")


@settings(max_examples=60, deadline=None)
@given(provider=st.sampled_from(["aws", "aliyun"]), scheme=st.sampled_from(["s3", "oss"]),
       have=st.sets(st.sampled_from(CREDENTIALS)), more=st.sets(st.sampled_from(CREDENTIALS)))
def test_giving_nodes_more_credentials_never_creates_a_problem(provider: str, scheme: str, have: set[str],
                                                               more: set[str]) -> None:
    def problem(creds: set[str]) -> str | None:
        secrets = {**(AWS_KEYS if "aws_keys" in creds else {}), **(OSS_KEYS if "oss_keys" in creds else {})}
        return store_access_problem(config(provider, f"{scheme}://b/ck", role="role" in creds, secrets=secrets))

    if problem(have) is None:
        assert problem(have | more) is None
    # the key pair the store's own client reads is always enough, whatever the launch gives
    assert problem(have | {"aws_keys" if scheme == "s3" else "oss_keys"}) is None


def test_the_shipped_cloud_configs_give_their_nodes_credentials() -> None:
    for name in ("aws.yaml", "aliyun.yaml", "multi-cloud.yaml"):
        raw = yaml.safe_load((ROOT / "configs" / name).read_text())
        assert store_access_problem(Config.model_validate(raw)) is None, name


def test_mount_type_takes_the_deepest_mount_holding_the_path(tmp_path: Path) -> None:
    (tmp_path / "shared dir").mkdir()
    (tmp_path / "local").mkdir()
    shared = str(tmp_path / "shared dir").replace(" ", "\\040")
    mounts = (f"/dev/vda1 / ext4 rw 0 0\n"
              f"fs-1.efs.us-east-1.amazonaws.com:/ {shared} nfs4 rw,vers=4.1 0 0\n"
              f"tmpfs {tmp_path}/local tmpfs rw 0 0\n")
    assert mount_type(str(tmp_path / "shared dir" / "run-1" / "step-9"), mounts) == "nfs4"  # not made yet
    assert mount_type(str(tmp_path / "local"), mounts) == "tmpfs"
    assert mount_type(str(tmp_path), mounts) == "ext4"
    assert mount_type(str(tmp_path / "shared"), mounts) == "ext4"  # a prefix of the name is not inside it


def test_check_config_refuses_a_cloud_config_whose_nodes_cannot_commit(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "configs" / "aws.yaml").read_text())
    del raw["providers"]["aws"]["iam_instance_profile"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "check-config", str(path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"{path}: providers.aws.iam_instance_profile: the aws nodes of domain 'use1' have no "
                               "credentials for s3://my-training-bucket/spotvisor/llama-ft"), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
