"""The attacker of tests/test_bounded_resources.py, in a process of its own (its load is
not the measuring process's): idle connections to the agent port and a report flood
from one node's token.

    python tests/flood_attacker.py --agent-url URL --node-id ID --token T \
        --idle 5000 --hosts 250 --flood-s 30

- ``--idle`` connections that never send a byte, spread over ``--hosts`` source
  addresses 127.0.0.2, 127.0.0.3, ... (Linux routes all of 127/8 to loopback: other
  "hosts"), each reopened as soon as the daemon closes it, for as long as the flood
  lasts; plus ``--one-host`` more from 127.0.0.2 alone (a single address over its cap);
- ``--workers`` concurrent senders, each POSTing batches of ``--batch`` reports from the
  node's token as fast as the daemon answers: metadata alarms (each one an event when
  accepted), a rank-1 ``started`` line (parsed, then dropped by the job tracker), a
  commit of a step nobody committed (vital; parsed, then dropped) and repeats.

Prints ``attacking`` once every idle connection has been opened the first time, then
on exit one JSON line: what it sent and what the daemon answered. If they are not all
open within :data:`OPEN_BOUND_S` it prints ``fell short: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import sys
import time
from urllib.parse import urlsplit

import aiohttp

#: seconds to open every idle connection once, before the flood; past it the attacker
#: exits 2 with ``fell short: ...`` rather than attack with fewer
OPEN_BOUND_S = 120.0


async def _idle(host: str, port: int, src: str, stop: asyncio.Event, stats: collections.Counter,
                first: asyncio.Semaphore, opened: list[int]) -> None:
    """One idle connection, reopened whenever the daemon closes it, until ``stop``."""
    once = False
    while not stop.is_set():
        try:
            async with first:
                reader, writer = await asyncio.open_connection(host, port, local_addr=(src, 0))
            stats["opened"] += 1
        except OSError:
            stats["connect_failed"] += 1
            await asyncio.sleep(0.05)  # pacing of a retry, not synchronisation
            continue
        if not once:
            once = True
            opened[0] += 1
        t0 = time.monotonic()
        try:
            done = asyncio.ensure_future(reader.read(1))
            waiter = asyncio.ensure_future(stop.wait())
            await asyncio.wait({done, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if done.done():
                stats["closed_by_daemon"] += 1
                stats["held_s_total"] += time.monotonic() - t0
            else:
                done.cancel()
        except (ConnectionError, OSError):
            stats["closed_by_daemon"] += 1
        finally:
            writer.close()


def _batch(node_id: str, n: int, serial: itertools.count) -> list[dict]:
    out = []
    for _ in range(n // 4):
        k = next(serial)
        now = time.time()
        out += [
            {"kind": "metadata_unreachable", "time": now, "failures": k, "error": "x" * 100, "url": "http://x"},
            {"kind": "trainer_status", "time": now,
             "line": {"event": "started", "attempt": f"evil-{k}", "rank": 1, "world_size": 2, "step": 0}},
            {"kind": "trainer_status", "time": now,
             "line": {"event": "checkpoint_committed", "attempt": f"evil-{k}", "rank": 0, "step": 10 * (k % 50) + 3,  # never a committed step
                      "reason": "periodic", "notice_ids": [], "kinds": []}},
        ]
        out.append(out[-3])  # a repeat within the POST
    return out


async def _flood(url: str, node_id: str, token: str, until: float, batch: int, stats: collections.Counter,
                 serial: itertools.count) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"},
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        while time.monotonic() < until:
            body = {"node_id": node_id, "events": _batch(node_id, batch, serial)}
            try:
                async with s.post(f"{url}/v1/agent/events", json=body) as r:
                    await r.read()
                    stats[f"status_{r.status}"] += 1
                    stats["reports_sent"] += batch
            except (aiohttp.ClientError, TimeoutError) as exc:
                stats[f"error_{type(exc).__name__}"] += 1


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--agent-url", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--idle", type=int, default=5000)
    p.add_argument("--hosts", type=int, default=250)
    p.add_argument("--one-host", type=int, default=200)
    p.add_argument("--flood-s", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=100)
    a = p.parse_args()
    u = urlsplit(a.agent_url)
    assert u.hostname and u.port
    stop = asyncio.Event()
    idle_stats: collections.Counter = collections.Counter()
    flood_stats: collections.Counter = collections.Counter()
    first = asyncio.Semaphore(200)  # connects in flight at once
    opened = [0]
    srcs = [f"127.0.0.{2 + i % a.hosts}" for i in range(a.idle)] + ["127.0.0.2"] * a.one_host
    t0 = time.monotonic()
    idle = [asyncio.ensure_future(_idle(u.hostname, u.port, src, stop, idle_stats, first, opened)) for src in srcs]
    while opened[0] < len(srcs) and time.monotonic() - t0 < OPEN_BOUND_S:
        await asyncio.sleep(0.05)  # progress polling of this script's own counters
    if opened[0] < len(srcs):  # a weaker attack than asked would make the test's bounds prove nothing
        stop.set()
        await asyncio.gather(*idle, return_exceptions=True)
        print(f"fell short: {opened[0]} of {len(srcs)} idle connections opened in {OPEN_BOUND_S:.0f} s "
              f"({dict(idle_stats)})", flush=True)
        return 2
    print(f"attacking {opened[0]}", flush=True)
    started = time.monotonic()
    serial = itertools.count()
    await asyncio.gather(*(_flood(a.agent_url, a.node_id, a.token, started + a.flood_s, a.batch, flood_stats, serial)
                           for _ in range(a.workers)))
    flood_s = time.monotonic() - started
    stop.set()
    await asyncio.gather(*idle, return_exceptions=True)
    print(json.dumps({"flood_s": round(flood_s, 2), "first_open_s": round(started - t0, 2),
                      "idle_first_opened": opened[0], "idle": dict(idle_stats), "flood": dict(flood_stats)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
