"""An Alibaba Cloud GPU node has no OSS keys: its OSS credentials are its instance RAM
role's, from the ECS metadata service. The daemon names the role (a domain's
``launch.ram_role``) in the job's environment; the trainer's store and the agent's code
fetch read it there.

The metadata answer's shape (``Code``, ``AccessKeyId``, ``AccessKeySecret``,
``SecurityToken``, ``Expiration``) is the one Alibaba documents for
``/latest/meta-data/ram/security-credentials/<role>``
(https://www.alibabacloud.com/help/en/ecs/user-guide/attach-an-instance-ram-role-to-an-ecs-instance).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import oss2.credentials
import pytest
import yaml

from daemon.config import load_config
from daemon.controlnode.jobspec import job_spec
from daemon.model import Node
from fakes.serving import http_server
from trainer.contract import OSS_RAM_ROLE_ENV
from trainer.oss_store import _default_credentials, ram_role_credentials_url


@pytest.fixture
def metadata():
    """A stand-in for the ECS metadata service on 127.0.0.1: serves one role's credentials."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            if self.path != "/latest/meta-data/ram/security-credentials/spotvisor-node":
                self.send_error(404)
                return
            expires = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
            body = json.dumps({"Code": "Success", "AccessKeyId": "STS.node-ak", "AccessKeySecret": "node-sk",
                               "SecurityToken": "node-token", "Expiration": expires,
                               "LastUpdated": expires}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http_server(Handler) as url:
        yield url, seen


def test_a_node_without_keys_uses_its_ram_role(monkeypatch: pytest.MonkeyPatch, metadata) -> None:
    url, seen = metadata
    monkeypatch.delenv("OSS_ACCESS_KEY_ID", raising=False)
    monkeypatch.setenv(OSS_RAM_ROLE_ENV, "spotvisor-node")
    monkeypatch.setenv("SPOTVISOR_ALIYUN_METADATA_URL", url)
    creds = _default_credentials().get_credentials()
    assert (creds.access_key_id, creds.access_key_secret, creds.security_token) == \
        ("STS.node-ak", "node-sk", "node-token")
    assert seen == ["/latest/meta-data/ram/security-credentials/spotvisor-node"]


def test_keys_in_the_environment_win_and_no_role_means_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSS_ACCESS_KEY_ID", "ak")
    monkeypatch.setenv(OSS_RAM_ROLE_ENV, "spotvisor-node")
    assert isinstance(_default_credentials(), oss2.credentials.EnvironmentVariableCredentialsProvider)
    monkeypatch.delenv("OSS_ACCESS_KEY_ID")
    monkeypatch.delenv(OSS_RAM_ROLE_ENV)
    assert isinstance(_default_credentials(), oss2.credentials.EnvironmentVariableCredentialsProvider)


def test_a_role_name_cannot_steer_the_metadata_url() -> None:
    assert ram_role_credentials_url("spotvisor-node").endswith("/ram/security-credentials/spotvisor-node")
    with pytest.raises(ValueError, match="not a RAM role name"):
        ram_role_credentials_url("../../user-data")


def test_the_daemon_names_the_domains_ram_role_to_its_nodes(tmp_path: Path) -> None:
    cfg = {
        "pool": {"name": "qwen"},
        "job": {"checkpoint_uri": "oss://b/p", "oss_endpoint": "https://oss-cn-hangzhou-internal.aliyuncs.com"},
        "rendezvous": {"host": "172.16.0.10"},
        "daemon": {"state_dir": str(tmp_path), "agent_host": "172.16.0.10"},
        "providers": {"aliyun": {"image_id": "m-1", "security_group_id": "sg-1", "vswitch_ids": {"cn-hangzhou-h": "vsw-h"}}},
        "domains": [{"name": "hz", "provider": "aliyun", "region": "cn-hangzhou",
                     "launch": {"ram_role": "spotvisor-node"}}],
        "offers": [{"provider": "aliyun", "region": "cn-hangzhou", "zone": "cn-hangzhou-h",
                    "instance_type": "ecs.gn7i-c32g1.8xlarge"}],
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_config(path)
    node = Node(id="n-1", ordinal=1, provider="aliyun", region="cn-hangzhou", zone="cn-hangzhou-h",
                instance_type="ecs.gn7i-c32g1.8xlarge", gpus=1, price_usd_h=1.0, token="t")
    assert job_spec(config, node, "r1", domain="hz")["env"][OSS_RAM_ROLE_ENV] == "spotvisor-node"
