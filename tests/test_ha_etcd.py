"""The 3-member etcd cluster the HA tests run on (tests/etcd_cluster.py), and the client
(daemon.ha.client) on it: writes survive a member's kill -9, the member rejoins, a txn
compares on create_revision and on the lease."""

from __future__ import annotations

import asyncio

import pytest

from daemon.ha.client import EtcdClient, LeaseCompare, target_of
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401  (fixture)


async def _put_until(client: EtcdClient, key: bytes, value: bytes, timeout_s: float = 15.0) -> None:
    """Put, retrying while the cluster re-elects (a request to the dead member fails)."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                await client.put(key, value)
                return
            except Exception:  # noqa: BLE001  aetcd's ConnectionFailedError, timeouts: retry inside the deadline
                await asyncio.sleep(0.1)


async def test_a_member_killed_leaves_a_writable_cluster_and_rejoins(etcd_cluster: EtcdCluster) -> None:
    async with EtcdClient(etcd_cluster.endpoints, timeout_s=2.0) as client:
        await client.put(b"/t/a", b"1")
        await asyncio.to_thread(etcd_cluster.kill, 0)
        assert not etcd_cluster.members[0].running
        await _put_until(client, b"/t/b", b"2")
        assert (await client.get(b"/t/a")).value == b"1"
        await asyncio.to_thread(etcd_cluster.restart, 0)
        # the rejoined member serves the write it missed
        async with EtcdClient([etcd_cluster.members[0].endpoint], timeout_s=2.0) as only0:
            assert (await only0.get(b"/t/b")).value == b"2"


async def test_two_members_down_refuse_writes(etcd_cluster: EtcdCluster) -> None:
    await asyncio.to_thread(etcd_cluster.kill, 0)
    await asyncio.to_thread(etcd_cluster.kill, 1)
    async with EtcdClient(etcd_cluster.endpoints, timeout_s=1.0) as client:
        with pytest.raises(Exception):  # no quorum: the put times out
            await client.put(b"/t/x", b"1")


async def test_txn_compares_create_revision_and_lease(etcd_cluster: EtcdCluster) -> None:
    async with EtcdClient(etcd_cluster.endpoints) as client:
        tx = client.transactions
        lease = await client.lease(5)
        won, _ = await client.transaction(compare=[tx.create(b"/p/leader") == 0],
                                          success=[tx.put(b"/p/leader", b"a", lease=lease.id)], failure=[])
        assert won
        got = await client.get(b"/p/leader")
        fence = got.create_revision
        again, _ = await client.transaction(compare=[tx.create(b"/p/leader") == 0],
                                            success=[tx.put(b"/p/leader", b"b")], failure=[])
        assert not again
        ok, _ = await client.transaction(compare=[tx.create(b"/p/leader") == fence,
                                                  LeaseCompare(b"/p/leader") == lease.id],
                                         success=[tx.put(b"/p/x", b"1")], failure=[])
        assert ok
        bad, _ = await client.transaction(compare=[LeaseCompare(b"/p/leader") == lease.id + 1],
                                          success=[tx.put(b"/p/x", b"2")], failure=[])
        assert not bad
        await lease.revoke()
        assert await client.get(b"/p/leader") is None


def test_endpoints_are_checked() -> None:
    assert target_of(["127.0.0.1:1", "10.0.0.2:2379"]) == "ipv4:127.0.0.1:1,10.0.0.2:2379"
    for bad in ([], ["localhost:2379"], ["127.0.0.1"], ["127.0.0.1:99999"]):
        with pytest.raises(ValueError):
            target_of(bad)


def test_a_missing_etcd_fails_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import etcd_cluster as ec
    monkeypatch.setattr(ec, "ETCD_BIN", "/nonexistent/etcd")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y etcd-server"):
        ec.etcd_binary()
