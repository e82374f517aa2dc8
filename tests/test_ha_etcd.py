"""The 3-member etcd cluster the HA tests run on (tests/etcd_cluster.py), and the client
(daemon.ha.client) on it: writes survive a member's kill -9, the member rejoins, a txn
compares on create_revision and on the lease; members never outlive the test process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.ports import free_port

from daemon.ha.client import EtcdClient, LeaseCompare, target_of
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401  (fixture)

TESTS = Path(__file__).resolve().parent


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


def _gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie (its parent died; init reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


_OWNER = """
import signal, sys
from pathlib import Path
sys.path[:0] = [{tests!r}, {root!r}]
from etcd_cluster import EtcdCluster
cluster = EtcdCluster(Path({root_dir!r}), size=1).start()
print(cluster.members[0].proc.pid, flush=True)
signal.pause()  # until the test SIGKILLs this process
"""


async def test_members_die_with_a_sigkilled_test_process(tmp_path: Path) -> None:
    """A test process SIGKILLed (no fixture teardown runs) takes its etcd members with it."""
    script = _OWNER.format(tests=str(TESTS), root=str(TESTS.parent), root_dir=str(tmp_path / "etcd"))
    owner = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            member = int(await owner.stdout.readline())  # type: ignore[union-attr]
        assert not _gone(member)
        owner.kill()
        await owner.wait()
        async with asyncio.timeout(10):
            while not _gone(member):
                await asyncio.sleep(0.05)  # a poll inside a deadline
    finally:
        if owner.returncode is None:
            owner.kill()
            await owner.wait()


async def test_the_sweep_kills_members_whose_owner_is_gone_and_no_others(etcd_cluster: EtcdCluster,
                                                                         tmp_path: Path) -> None:
    """A member the first guard missed (here: started without it, its owner a process that
    ended) is killed by the next cluster's sweep; a live owner's members are left alone."""
    import etcd_cluster as ec

    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid names no process now (the 0 start time below: not even a reused pid)
    port, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    orphan = subprocess.Popen(
        [etcd_cluster.binary, "--name", "o", "--data-dir", str(tmp_path / "o.etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url, "--listen-peer-urls", peer_url,
         "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"o={peer_url}", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env={**os.environ, ec.OWNER_ENV: f"{ended.pid}:0"})  # pid ended, start time 0: no owner
    try:
        deadline = time.monotonic() + 10  # exec'd (a fork not yet exec'd is python, not etcd: no member yet)
        while not Path(f"/proc/{orphan.pid}/cmdline").read_bytes().startswith(etcd_cluster.binary.encode()):
            assert time.monotonic() < deadline, "the orphan never exec'd etcd"
            await asyncio.sleep(0.01)  # a poll inside a deadline
        killed = ec.sweep_orphans()
        assert orphan.pid in killed
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert all(m.running for m in etcd_cluster.members)  # this test process's own
        assert not {m.proc.pid for m in etcd_cluster.members} & set(killed)  # type: ignore[union-attr]
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_strain_counts_what_the_members_said_of_being_slow(tmp_path: Path) -> None:
    """A failed HA test's report says whether etcd struggled (the fixture prints this at
    teardown): etcd's slow-request warnings, counted per member and message, the longest
    of each; its routine warnings (a peer stream established) and non-JSON lines left out."""
    import json

    cluster = EtcdCluster(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    lines = [{"level": "warn", "msg": "apply request took too long", "took": "1.5s"},
             {"level": "warn", "msg": "apply request took too long", "took": "900ms"},
             {"level": "warn", "msg": "established TCP streaming connection with remote peer"},
             {"level": "warn", "msg": "leader failed to send out heartbeat on time; took too long, leader is "
                                      "overloaded likely from slow disk"}]
    cluster.members[0].log_path.write_text("\n".join(json.dumps(x) for x in lines[:3]) + "\nnot json\n")
    cluster.members[2].log_path.write_text(json.dumps(lines[3]) + "\n")
    said = cluster.strain()
    assert said.startswith(f"2x {cluster.members[0].name}: apply request took too long (longest 1.500 s); "), said
    assert f"1x {cluster.members[2].name}: leader failed to send out heartbeat" in said
    assert "established" not in said and EtcdCluster(tmp_path / "quiet").strain() == ""
