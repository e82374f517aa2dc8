"""The etcd client's figures on a real 3-member cluster on loopback (issue 29's evaluation).

``python -m bench.ha_client [--n 300]`` starts Debian's etcd (tests/etcd_cluster.py) and
prints:

- a fenced txn (compare create_revision and lease, put one key) through aetcd
  (gRPC, :class:`daemon.ha.client.EtcdClient`) and through etcd's gRPC-gateway JSON API
  (``POST /v3/kv/txn`` over aiohttp, base64 keys): p50 and p99 in ms;
- the time from a lease's last keepalive to a watcher seeing its key deleted (5 s
  TTL): how soon a standby can notice a lost leader;
- the time from a member's kill -9 (the one the client's first address names) to the
  next successful put through the multi-endpoint client.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from daemon.ha.client import EtcdClient, LeaseCompare  # noqa: E402
from etcd_cluster import EtcdCluster  # noqa: E402


def _pcts(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"p50 {statistics.median(xs) * 1e3:.2f} ms, p99 {xs[int(len(xs) * 0.99) - 1] * 1e3:.2f} ms"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


async def _grpc_txns(client: EtcdClient, n: int) -> list[float]:
    tx = client.transactions
    lease = await client.lease(5)
    await client.put(b"/b/leader", b"me", lease=lease.id)
    fence = (await client.get(b"/b/leader")).create_revision
    out = []
    for i in range(n):
        t = time.perf_counter()
        ok, _ = await client.transaction(compare=[tx.create(b"/b/leader") == fence, LeaseCompare(b"/b/leader") == lease.id],
                                         success=[tx.put(b"/b/x", str(i).encode())], failure=[])
        out.append(time.perf_counter() - t)
        assert ok
    await lease.revoke()
    return out


async def _gateway_txns(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v3/lease/grant", json={"TTL": 5}) as r:
            lease = (await r.json())["ID"]
        async with s.post(f"{url}/v3/kv/put", json={"key": _b64(b"/g/leader"), "value": _b64(b"me"), "lease": lease}) as r:
            await r.read()
        async with s.post(f"{url}/v3/kv/range", json={"key": _b64(b"/g/leader")}) as r:
            fence = int((await r.json())["kvs"][0]["create_revision"])
        for i in range(n):
            body = {"compare": [{"key": _b64(b"/g/leader"), "target": "CREATE", "result": "EQUAL", "create_revision": fence},
                                {"key": _b64(b"/g/leader"), "target": "LEASE", "result": "EQUAL", "lease": lease}],
                    "success": [{"request_put": {"key": _b64(b"/g/x"), "value": _b64(str(i).encode())}}]}
            t = time.perf_counter()
            async with s.post(f"{url}/v3/kv/txn", json=body) as r:
                assert (await r.json()).get("succeeded") is True
            out.append(time.perf_counter() - t)
    return out


async def _lease_loss(client: EtcdClient) -> float:
    lease = await client.lease(5)
    await client.put(b"/b/l", b"x", lease=lease.id)
    last = time.monotonic()
    await client.refresh_lease(lease.id)
    watch = await client.watch(b"/b/l")
    try:
        async for ev in watch:
            if ev.kind == "DELETE":
                return time.monotonic() - last
    finally:
        await watch.cancel()
    raise RuntimeError("watch ended")


async def _member_loss(cluster: EtcdCluster, client: EtcdClient) -> float:
    await client.put(b"/b/m", b"0")
    t = time.monotonic()
    await asyncio.to_thread(cluster.kill, 0)
    while True:
        try:
            await client.put(b"/b/m", b"1")
            return time.monotonic() - t
        except Exception:  # noqa: BLE001  the dead member's calls fail until the channel drops it
            await asyncio.sleep(0.01)


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        cluster = await asyncio.to_thread(EtcdCluster(Path(d)).start)
        try:
            async with EtcdClient(cluster.endpoints) as client:
                print(f"aetcd (gRPC) fenced txn, n={n}: {_pcts(await _grpc_txns(client, n))}")
                print(f"gateway JSON over aiohttp fenced txn, n={n}: "
                      f"{_pcts(await _gateway_txns(cluster.members[1].client_url, n))}")
                print(f"last keepalive -> watcher sees the key deleted (TTL 5 s): {await _lease_loss(client):.2f} s")
                print(f"kill -9 of a member -> next put succeeds: {await _member_loss(cluster, client):.3f} s")
        finally:
            await asyncio.to_thread(cluster.stop)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=300)
    asyncio.run(main(p.parse_args().n))
