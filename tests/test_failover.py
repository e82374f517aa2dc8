"""Failover across clouds through the real daemon and the real SDKs: AWS (boto3 →
fault proxy → moto) and Alibaba (aliyun-python-sdk-ecs → FakeEcs). AWS and Alibaba are
two placement domains: the job moves between them whole, never spans them."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from conftest import DaemonHarness
from daemon.interfaces.api import ApiServer
from daemon.config import Config
from daemon.model import NodeState
from daemon.providers.aliyun import AliyunProvider
from daemon.providers.aws import AwsProvider
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor
from fakes.aws_faults import AwsFaultProxy
from fakes.ecs import FakeEcs

AK_ID, AK_SECRET = "LTAI-failover", "failover-secret"
ALIYUN_TYPE = "ecs.gn7i-c32g1.32xlarge"  # 4 GPUs: a different GPU count than the AWS offers


@pytest.fixture
async def ecs():
    async with FakeEcs(access_key_id=AK_ID, access_key_secret=AK_SECRET) as fake:
        yield fake


@pytest.fixture
async def daemon(request: pytest.FixtureRequest, tmp_path: Path, faults: AwsFaultProxy, ecs: FakeEcs):
    """A daemon with both cloud providers; ``request.param`` = list of offer providers to configure."""
    kinds = getattr(request, "param", ["aws", "aws", "aliyun"])
    offers = []
    for i, kind in enumerate(kinds):
        if kind == "aws":
            offers.append({"provider": "aws", "region": "us-east-1", "zone": f"us-east-1{'ab'[i % 2]}",
                           "instance_type": "p4d.24xlarge", "gpu_type": "A100-40GB", "gpus_per_node": 8})
        else:
            offers.append({"provider": "aliyun", "region": "cn-hangzhou", "zone": "cn-hangzhou-h",
                           "instance_type": ALIYUN_TYPE, "gpu_type": "A10-24GB", "gpus_per_node": 4})
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = Config.model_validate({
        "pool": {"name": f"fo-{uuid.uuid4().hex[:8]}", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "j", "global_batch_size": 16, "micro_batch_size": 1},  # valid world sizes 1, 2, 4, 8, 16
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                   "reconcile_interval_s": 0.05},
        "providers": {
            "local": None,
            "aws": {"image_id": "ami-03cf127a", "endpoint_url": faults.url},
            "aliyun": {"image_id": "m-test", "security_group_id": "sg-test",
                       "vswitch_ids": {"cn-hangzhou-h": "vsw-h"}, "endpoint": ecs.endpoint},
        },
        "offers": offers,
        **({"domains": [
            {"name": "aws-use1", "provider": "aws", "region": "us-east-1"},
            {"name": "aliyun-hz", "provider": "aliyun", "region": "cn-hangzhou",
             "checkpoint_uri": f"file://{tmp_path}/hz", "rendezvous": {"host": "172.16.0.10", "port": 29400}},
        ], "migration": {"patience_s": 0.5}} if {"aws", "aliyun"} <= set(kinds) else {}),
    })
    providers = {
        "aws": AwsProvider(spec=config.providers.aws, region="us-east-1", retry_attempts=2, retry_initial_s=0.01,
                           retry_max_s=0.05, read_timeout_s=5.0),
        "aliyun": AliyunProvider(spec=config.providers.aliyun, access_key_id=AK_ID, access_key_secret=AK_SECRET,
                                 retry_wait_s=0.0),
    }
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    sup = Supervisor(config, providers=providers, store=store)
    api = ApiServer(sup, agent_host="127.0.0.1", agent_port=0, socket_path=f"{sockdir}/d.sock")
    try:
        await api.start()
        yield DaemonHarness(sup, api, None, config, f"{sockdir}/d.sock", tmp_path)  # type: ignore[arg-type]
    finally:
        await sup.aclose()
        await api.aclose()
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


async def test_aws_out_of_capacity_moves_the_job_to_alibaba_and_it_follows_its_gpus(
        daemon: DaemonHarness, faults: AwsFaultProxy, ecs: FakeEcs) -> None:
    """Both AWS offers answer InsufficientInstanceCapacity: after migration.patience_s the
    job (not started yet, nothing to copy) moves to Alibaba, whose node starts it with its
    own GPU count and its own domain's rendezvous and store."""
    h = daemon
    faults.fail_next("RunInstances", "InsufficientInstanceCapacity", 500, n=2)
    await h.sup.start(agent_url=h.api.agent_url)
    await h.until(lambda: any(n.provider == "aliyun" and n.state is NodeState.LAUNCHING
                              for n in h.sup.nodes.values()), timeout_s=20, what="the Alibaba launch")
    [started] = h.events("migration_started")
    assert (started.data["source"], started.data["target"], started.data["reason"]) == \
        ("aws-use1", "aliyun-hz", "capacity")

    failed = h.events("node_launch_failed")
    assert [(e.data["error"], e.data["offer"].split("/")[0]) for e in failed] == [("capacity", "aws")] * 2
    assert {e.data["offer"] for e in failed} == {"aws/us-east-1/us-east-1a/p4d.24xlarge/spot",
                                                  "aws/us-east-1/us-east-1b/p4d.24xlarge/spot"}
    assert all(e.data["backoff_s"] >= 36 for e in failed)  # both AWS offers now sit out
    assert len(ecs.calls("RunInstances")) == 1

    node = next(n for n in h.sup.nodes.values() if n.provider == "aliyun")
    argv = h.sup.job_spec(node)["argv"]
    assert "--nproc-per-node=4" in argv  # nproc_per_node follows the replacement's GPU count
    assert "--rdzv-endpoint=172.16.0.10:29400" in argv  # Alibaba's own rendezvous endpoint
    h.sup.agents.on_register(node)
    await h.until(lambda: node.state is NodeState.RUNNING, what="admitted")
    assert h.sup.domain == "aliyun-hz"
    h.sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
        "event": "started", "attempt": "a1", "rank": 0, "world_size": 4, "step": 0, "time": time.time()}}])
    assert h.sup.job.world_size == 4


@pytest.mark.parametrize("daemon", [["aliyun"]], indirect=True)
async def test_the_daemon_answers_status_while_a_launch_is_in_flight(daemon: DaemonHarness, ecs: FakeEcs) -> None:
    """SDK calls run in threads: a slow cloud API never stalls the event loop. The
    launch's answer is held until the test releases it, so every status reply below
    came while the call was in flight (no timing bound: a blocked loop answers none)."""
    h = daemon
    ecs.delay_next("RunInstances", 600.0)
    await h.sup.start(agent_url=h.api.agent_url)
    await h.until(lambda: ecs.calls("RunInstances"), what="the launch call to reach ECS")
    conn = aiohttp.UnixConnector(path=h.socket_path)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(5):
            async with asyncio.timeout(30), s.get("http://spotvisord/v1/status") as r:
                assert r.status == 200
                await r.json()
    assert not h.events("node_launched"), "the launch was answered before its release"
    ecs.release_delays()
    await h.until(lambda: h.events("node_launched"), what="the released launch to land")
