"""Two real ``spotvisord run`` processes on one HA config (``ha:``), a real 3-member etcd
cluster (tests/etcd_cluster.py), and EC2 as moto behind ``fakes.aws_faults.AwsFaultProxy``
(its instances outlive a daemon, as a cloud's do; the proxy counts every RunInstances).

Each daemon has its own ``ha.name``, state dir and control socket; they share the agent
port (on one host a standby has not bound it; a real deployment puts a floating address
or a DNS name that follows the leader there). Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import boto3
import pytest
import yaml

from bench.ha_harness import ROOT, Daemon, instances, per_node, until
from bench.ports import free_port
from daemon.ha.client import EtcdClient
from daemon.ha.elector import pool_prefix
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401  (fixture)
from fakes.aws_faults import AwsFaultProxy

@pytest.fixture
async def ha_pair(tmp_path: Path, etcd_cluster: EtcdCluster, faults: AwsFaultProxy,  # noqa: F811
                  ec2_server: str) -> AsyncIterator[dict[str, Any]]:
    """Two daemons' configs (``control-a``, ``control-b``) for one pool; neither started."""
    pool = f"ha-{uuid.uuid4().hex[:8]}"
    sockdir = tempfile.mkdtemp(prefix="svha-", dir="/tmp")
    agent_port = free_port()
    daemons: list[Daemon] = []
    for name in ("control-a", "control-b"):
        raw = {
            "pool": {"name": pool, "min_nodes": 1, "target_nodes": 1, "max_nodes": 3},
            "job": {"id": "j", "global_batch_size": 48, "micro_batch_size": 1, "target_steps": 30},
            "ha": {"name": name, "lease_s": 4, "endpoints": etcd_cluster.endpoints},
            "daemon": {"verify_commits": False, "state_dir": str(tmp_path / name), "socket": f"{sockdir}/{name}.sock",
                       "agent_host": "127.0.0.1", "agent_port": agent_port, "reconcile_interval_s": 0.1},
            "providers": {"local": None, "aws": {"image_id": "ami-03cf127a", "endpoint_url": faults.url}},
            "offers": [{"provider": "aws", "region": "us-east-1", "zone": "us-east-1a",
                        "instance_type": "p4d.24xlarge", "gpu_type": "A100-40GB", "gpus_per_node": 8}],
        }
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(raw))
        daemons.append(Daemon(name, cfg, f"{sockdir}/{name}.sock", tmp_path / f"{name}.log"))
    ec2 = boto3.client("ec2", endpoint_url=ec2_server, region_name="us-east-1")
    client = EtcdClient(etcd_cluster.endpoints)
    await client.connect()
    try:
        yield {"pool": pool, "a": daemons[0], "b": daemons[1], "ec2": ec2, "etcd": client}
    finally:
        for d in daemons:
            if d.alive():
                assert d.proc is not None
                d.proc.kill()
                await d.proc.wait()
        await client.close()
        shutil.rmtree(sockdir, ignore_errors=True)


async def _etcd_seq(client: EtcdClient, pool: str) -> int:
    kv = await client.get(pool_prefix(pool) + b"seq")
    return int(kv.value) if kv is not None else 0


@pytest.mark.slow
async def test_the_standby_takes_over_a_killed_leader_without_buying_twice(ha_pair: dict[str, Any],
                                                                          faults: AwsFaultProxy) -> None:
    """control-a leads and buys; control-b stands by (says so, buys nothing, serves nothing).
    control-a is scaled to 2 and then SIGKILLed: control-b leads within 10 s with a's pool
    (both nodes and their instances, target 2, every event in order) and acts (scale 3: it
    buys node 3, and nothing a already bought): one instance per node id."""
    a, b, pool, ec2 = ha_pair["a"], ha_pair["b"], ha_pair["pool"], ha_pair["ec2"]
    await a.start()
    await until(a.status, "control-a leading (its control socket answers)", daemons=(a,))
    await b.start()
    await until(lambda: "standby: control-a leads" in b.log.read_text(), "control-b's standby line", daemons=(a, b))
    assert b.log.read_text().count("standby:") == 1
    await until(lambda: len(faults.actions("RunInstances")) == 1, "control-a's first purchase", daemons=(a, b))
    await a.scale(2)
    launched = await until(lambda: _launched_n(a, 2), "both nodes launched by control-a", daemons=(a, b))
    assert await b.status() is None  # the standby serves nothing
    # everything control-a recorded is committed to etcd (its flush: every 0.2 s)
    before: list[dict[str, Any]] = []

    async def synced() -> bool:
        before[:] = await a.events()
        return bool(before) and await _etcd_seq(ha_pair["etcd"], pool) == before[-1]["seq"]

    await until(synced, "control-a's events committed to etcd", daemons=(a, b))
    assert len(faults.actions("RunInstances")) == 2

    assert a.proc is not None
    await until(lambda: "standby_cloud_checked" in b.log.read_text(), "control-b's cloud check", daemons=(a, b))
    killed_at = time.monotonic()
    a.proc.send_signal(signal.SIGKILL)
    await a.proc.wait()
    status = await until(b.status, "control-b leading", timeout_s=10, daemons=(b,))
    led_s = time.monotonic() - killed_at
    assert status["pool"]["target_nodes"] == 2  # the operator's target, carried over (the config says 1)
    assert {n["id"]: n["instance_id"] for n in status["nodes"]} == launched
    await b.scale(3)
    await until(lambda: len(faults.actions("RunInstances")) == 3, "control-b's purchase of node 3",
                timeout_s=10 - led_s, daemons=(b,))
    acted_s = time.monotonic() - killed_at
    after = await b.events()
    assert after[:len(before)] == before  # a's log, in order, unchanged
    assert [e["seq"] for e in after] == list(range(1, len(after) + 1))  # b continues the seq, no gap, no reuse
    assert not [e for e in after[len(before):] if e["kind"] == "node_terminated"]
    # the proxy records a request as it arrives, before EC2 (moto) has answered it: node 3's
    # instance may be a moment behind its RunInstances (CI once looked in between)
    await until(lambda: f"{pool}-3" in per_node(instances(ec2, pool)), "node 3's instance at EC2", daemons=(b,))
    assert per_node(instances(ec2, pool)) == {f"{pool}-1": 1, f"{pool}-2": 1, f"{pool}-3": 1}
    assert "checked_in_standby=True" in b.log.read_text()  # its first act did not wait for a cloud check
    print(f"takeover: control-b led {led_s:.2f} s and bought {acted_s:.2f} s after control-a's SIGKILL (lease 4 s)")


async def test_a_standby_stops_on_sigterm_and_the_refusal_is_gone(ha_pair: dict[str, Any],
                                                                 faults: AwsFaultProxy) -> None:
    """Both on one config with ``ha:``: one leads, the other waits; SIGTERM ends a standby
    at once (exit 0, nothing bought by it), and the leader on SIGTERM steps down."""
    a, b = ha_pair["a"], ha_pair["b"]
    await a.start()
    await until(a.status, "control-a leading", daemons=(a,))
    await b.start()
    await until(lambda: "standby: control-a leads" in b.log.read_text(), "control-b's standby line", daemons=(a, b))
    assert b.proc is not None and a.proc is not None
    b.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(b.proc.wait(), 10) == 0
    a.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(a.proc.wait(), 20) == 0
    assert await ha_pair["etcd"].get(pool_prefix(ha_pair["pool"]) + b"leader") is None  # a stepped down: its lease revoked, the key gone with it


async def _deleted_at(client: EtcdClient, key: bytes) -> "asyncio.Task[float]":
    """A task that ends with the monotonic time of ``key``'s next deletion, seen through an
    etcd watch opened before this returns."""
    watch = await client.watch(key)

    async def first_delete() -> float:
        try:
            async for event in watch:
                if event.kind == "DELETE":
                    return time.monotonic()
            raise AssertionError("the watch ended")
        finally:
            await watch.cancel()
    return asyncio.create_task(first_delete())


async def test_a_leader_on_sigterm_hands_over_before_its_slow_closes(ha_pair: dict[str, Any],
                                                                     faults: AwsFaultProxy) -> None:
    """control-a's feed has a sink that never answers (on close the feed waits 3 s to
    drain it). On SIGTERM a revokes its lease as soon as it stops acting: the leader key
    goes and control-b leads while a is still closing; a then exits 0."""
    a, b, pool = ha_pair["a"], ha_pair["b"], ha_pair["pool"]
    with socket.socket() as hang:
        hang.bind(("127.0.0.1", 0))
        hang.listen(64)  # the kernel completes the connections; nothing ever answers
        for d in (a, b):
            raw = yaml.safe_load(d.config.read_text())
            raw["notify"] = [{"name": "slow", "type": "slack", "timeout_s": 60,
                              "url": f"http://127.0.0.1:{hang.getsockname()[1]}/hook"}]
            d.config.write_text(yaml.safe_dump(raw))
        await a.start()
        await until(lambda: _launched_n(a, 1), "control-a's node launched (events queued for the sink)", daemons=(a,))
        await b.start()
        await until(lambda: "standby: control-a leads" in b.log.read_text(), "control-b's standby line", daemons=(a, b))
        deleted = await _deleted_at(ha_pair["etcd"], pool_prefix(pool) + b"leader")
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        handed_over = await asyncio.wait_for(deleted, 15)
        assert await asyncio.wait_for(a.proc.wait(), 30) == 0
        closing_s = time.monotonic() - handed_over
        assert "notify_undelivered_at_close" in a.log.read_text()  # the slow close did happen, after the handover
        assert closing_s >= 2.0, f"the lease went only {closing_s:.2f} s before control-a exited"
        status = await until(b.status, "control-b leading", daemons=(b,))
        assert [n["id"] for n in status["nodes"]] == [f"{pool}-1"]
    print(f"sigterm: control-a handed over {closing_s:.2f} s before it exited")


@pytest.mark.slow
async def test_a_leader_whose_lease_is_revoked_stops_fail_closed_and_exits_1(ha_pair: dict[str, Any],
                                                                             faults: AwsFaultProxy) -> None:
    """control-a's lease is revoked in etcd (as when etcd expired it while a was cut off):
    a stops, exits 1 with one line saying why, and buys nothing more; control-b leads with
    a's node and buys nothing twice."""
    a, b, pool, etcd = ha_pair["a"], ha_pair["b"], ha_pair["pool"], ha_pair["etcd"]
    await a.start()
    await until(lambda: _launched_n(a, 1), "control-a's node launched", daemons=(a,))
    await b.start()
    await until(lambda: "standby: control-a leads" in b.log.read_text(), "control-b's standby line", daemons=(a, b))
    kv = await etcd.get(pool_prefix(pool) + b"leader")
    assert kv is not None and kv.value == b"control-a"
    await etcd.revoke_lease(kv.lease)
    assert a.proc is not None
    assert await asyncio.wait_for(a.proc.wait(), 10) == 1
    lines = [line for line in a.log.read_text().splitlines() if line.startswith("spotvisord run:")]
    assert len(lines) == 1 and "control-a lost the leadership" in lines[0] and "fail closed" in lines[0], lines
    status = await until(b.status, "control-b leading", timeout_s=10, daemons=(b,))
    assert [n["id"] for n in status["nodes"]] == [f"{pool}-1"]
    await until(lambda: _launched_n(b, 1), "control-b adopted the node", daemons=(b,))
    assert len(faults.actions("RunInstances")) == 1
    assert per_node(instances(ha_pair["ec2"], pool)) == {f"{pool}-1": 1}


async def _launched_n(d: Daemon, n: int) -> dict[str, str] | None:
    status = await d.status()
    nodes = {n["id"]: n["instance_id"] for n in (status or {}).get("nodes", []) if n["instance_id"]}
    return nodes if len(nodes) == n else None


@pytest.mark.slow
async def test_a_demo_whose_lease_is_revoked_ends_with_1(ha_pair: dict[str, Any], faults: AwsFaultProxy) -> None:
    """``spotvisord demo`` with ``ha:`` leads as ``run`` does, and like ``run`` ends (exit 1,
    one line saying why) once it leads no more, instead of running on unfenced."""
    a, pool, etcd = ha_pair["a"], ha_pair["pool"], ha_pair["etcd"]
    with open(a.log, "ab") as log:
        demo = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.interfaces.cli", "demo", "--config", str(a.config), "--timeout-s", "300",
            cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        await until(lambda: len(faults.actions("RunInstances")) == 1, "the demo's first purchase")
        kv = await etcd.get(pool_prefix(pool) + b"leader")
        assert kv is not None and kv.value == b"control-a"
        await etcd.revoke_lease(kv.lease)
        assert await asyncio.wait_for(demo.wait(), 30) == 1
        lines = [line for line in a.log.read_text().splitlines() if line.startswith("spotvisor demo: control-a")]
        assert len(lines) == 1 and lines[0].startswith("spotvisor demo: control-a lost the leadership"), lines
        assert len(faults.actions("RunInstances")) == 1
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()


async def test_a_demo_on_a_pool_etcd_already_holds_refuses_in_one_line(
        ha_pair: dict[str, Any], faults: AwsFaultProxy) -> None:
    """A demo starts from nothing: on a pool name whose state is in etcd (an earlier demo's,
    or a production pool's) it would resume that pool, its fired chaos and its completed
    job, instead. It exits 2 naming pool.name and the way out, and buys nothing."""
    a, pool, etcd = ha_pair["a"], ha_pair["pool"], ha_pair["etcd"]
    await etcd.put(pool_prefix(pool) + b"seq", b"41")  # an earlier run's
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.interfaces.cli", "demo", "--config", str(a.config), "--timeout-s", "60",
        cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(demo.communicate(), 60)
    assert demo.returncode == 2, (out, err)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotvisord demo: pool.name: etcd already holds"), lines
    assert f"etcdctl del --prefix /spotvisor/{pool}/" in lines[0]
    assert faults.actions("RunInstances") == [] and (await etcd.get(pool_prefix(pool) + b"leader")) is None
