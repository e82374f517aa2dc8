"""Fencing on the real 3-member etcd cluster: a deposed leader never reaches the provider.

"The provider" here is a counter of calls (in the test process) or a ledger file (for
a daemon in its own process, which the test SIGSTOPs past its lease's TTL and resumes).
Each call is preceded by its fenced intent txn (daemon.ha.fence), as the daemon's
purchases and terminations are. Run as a script, this module is that other process:
``python tests/test_ha_fence.py ENDPOINTS POOL NAME LEDGER`` (an elector and a loop that
buys every 50 ms while it may; its role changes on stdout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from etcd_cluster import etcd_cluster  # noqa: E402,F401  (fixture)

from daemon.control import leadership as ld  # noqa: E402
from daemon.ha.client import EtcdClient  # noqa: E402
from daemon.ha.elector import Elector, pool_prefix  # noqa: E402
from daemon.ha.fence import Deposed, Fence  # noqa: E402

CFG = ld.LeaderConfig(ttl_s=5.0)


class _Frozen:
    """A clock that does not move (a leader that believes it leads: never renews, never expires)."""

    def __call__(self) -> float:
        return 1000.0


async def _until(pred, timeout_s: float, what: str) -> float:
    """Poll ``pred`` every 20 ms within a deadline; seconds it took."""
    start = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _leads(e: Elector, timeout_s: float) -> float:
    """Wait on ``e.changed`` until ``e`` may act; seconds it took."""
    start = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while True:
            e.changed.clear()
            if e.may_act():
                return time.monotonic() - start
            await e.changed.wait()


async def _buy(fence: Fence, calls: list[int], n: int) -> None:
    """One purchase: the intent, fenced, then the provider (a count)."""
    tx = fence.client.transactions
    key = pool_prefix(fence.elector.pool) + f"intent/{fence.elector.name}-{n}".encode()

    async def provider() -> None:
        calls.append(fence.elector.fence or 0)

    await fence.then_call([tx.put(key, b"launch")], provider)


async def test_a_leader_whose_lease_was_revoked_cannot_buy_and_the_standby_takes_over(etcd_cluster) -> None:
    a_client, b_client, admin = (EtcdClient(etcd_cluster.endpoints) for _ in range(3))
    # without the key's watch (it would tell a at once): what the fence alone does
    a = Elector(a_client, pool="p", name="a", cfg=CFG, clock=_Frozen(), watch=False).start()
    a_calls: list[int] = []
    b_calls: list[int] = []
    try:
        await _leads(a, 10)
        b = Elector(b_client, pool="p", name="b", cfg=CFG).start()
        try:
            await _buy(Fence(a), a_calls, 1)
            assert a_calls == [a.fence]
            assert not b.may_act()
            with pytest.raises(Deposed):
                await _buy(Fence(b), b_calls, 1)  # the standby is gated before any txn
            await admin.revoke_lease(a.lease_id)  # a's lease gone behind its back; its clock says it still leads
            assert a.may_act()
            with pytest.raises(Deposed, match="refused"):
                await _buy(Fence(a), a_calls, 2)
            assert a_calls == [a.fence]  # no provider call after the deposal
            # the key went with the lease; a (told by the refused txn) starts over with a new
            # lease and may win the race once, but its frozen clock never renews: b leads
            # within one TTL and a bit
            took = await _leads(b, 2 * CFG.ttl_s)
            assert took < CFG.ttl_s + 2
            await _buy(Fence(b), b_calls, 2)
            assert b_calls and b_calls[0] > a_calls[0]
            async with asyncio.timeout(5):  # a stepped down from the fence that was refused (its loop
                while a.fence == a_calls[0]:  # takes the FenceRejected in its own time: wait on it)
                    a.changed.clear()
                    if a.fence != a_calls[0]:
                        break
                    await a.changed.wait()
        finally:
            await b.aclose()
    finally:
        await a.aclose()
        for c in (a_client, b_client, admin):
            await c.close()


def _ledger(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        name, fence = line.split()
        out.append((name, int(fence)))
    return out


@pytest.mark.slow
async def test_a_sigstopped_leader_resumed_past_its_ttl_never_buys_again(etcd_cluster, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, ",".join(etcd_cluster.endpoints), "p", "a", str(ledger),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    client = EtcdClient(etcd_cluster.endpoints)
    b = None
    try:
        async with asyncio.timeout(20):
            assert (await _role_line(proc.stdout))[:2] == [b"role", b"leader"]
        await _until(lambda: len(_ledger(ledger)) >= 3, 10, "a buys")
        b = Elector(client, pool="p", name="b", cfg=CFG).start()
        b_calls: list[int] = []
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        at_stop = _ledger(ledger)
        took = await _leads(b, 15)
        assert time.monotonic() - stopped < 10  # a 5 s lease: the standby acts within 10 s
        for n in range(3):
            await _buy(Fence(b), b_calls, n)
        os.kill(proc.pid, signal.SIGCONT)
        async with asyncio.timeout(15):  # a's next line: it stepped down (its clock, or the refused fence)
            line = await _role_line(proc.stdout)
        assert line[:2] == [b"role", b"follower"], line
        for n in range(3, 6):
            await _buy(Fence(b), b_calls, n)
        assert _ledger(ledger) == at_stop, "the resumed, deposed leader called the provider"
        assert min(b_calls) > max(f for _, f in at_stop)
        print(f"takeover after SIGSTOP: {took:.2f} s")
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        if b is not None:
            await b.aclose()
        await client.close()


@pytest.mark.slow
async def test_a_killed_leader_is_replaced_within_10_s_with_no_duplicate_purchase(etcd_cluster, tmp_path: Path) -> None:
    """kill -9 of the leading daemon (its own process), three times in a row, each new
    leader killed in turn: a standby buys within 10 s (5 s lease), every purchase has one
    fence, the fences grow, and no purchase happens under two fences at once."""
    ledger = tmp_path / "ledger"
    procs = []
    takeovers = []
    try:
        for name in ("a", "b", "c", "d"):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, __file__, ",".join(etcd_cluster.endpoints), "p", name, str(ledger),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL))
        for _ in range(3):
            await _until(lambda: len(_ledger(ledger)) > 0, 20, "someone buys")
            leader = _ledger(ledger)[-1][0]
            proc = procs["abcd".index(leader)]
            proc.kill()  # SIGKILL: no step-down, the lease must expire
            await proc.wait()
            killed_at = time.monotonic()
            bought = len(_ledger(ledger))
            took = await _until(lambda: any(n != leader for n, _ in _ledger(ledger)[bought:]), 15, "a standby buys")
            takeovers.append(took)
            assert time.monotonic() - killed_at < 10
        rows = _ledger(ledger)
        by_fence: dict[int, set[str]] = {}
        for name, fence in rows:
            by_fence.setdefault(fence, set()).add(name)
        assert all(len(names) == 1 for names in by_fence.values())  # one daemon per fence
        fences = [f for _, f in rows]
        assert fences == sorted(fences)  # in the ledger's order: a new leader's fence is larger
        print("takeover after kill -9 (s):", " ".join(f"{t:.2f}" for t in takeovers))
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


async def _role_line(stdout: asyncio.StreamReader) -> list[bytes]:
    """The child's next ``role ...`` line (its log lines go to stderr)."""
    while True:
        line = await stdout.readline()
        if not line or line.startswith(b"role "):
            return line.split()


async def _buyer_main(endpoints: str, pool: str, name: str, ledger: str) -> None:
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    client = EtcdClient(endpoints.split(","))
    elector = Elector(client, pool=pool, name=name, cfg=CFG).start()
    fence = Fence(elector)
    leads = False
    n = 0
    while True:
        if (elector.state.role is ld.Role.LEADER) != leads:  # printed: leader, then follower once it is not
            leads = not leads
            print("role", "leader" if leads else "follower", elector.fence, flush=True)
        if elector.may_act():
            n += 1

            async def provider(f: int | None = elector.fence) -> None:
                def write() -> None:
                    with open(ledger, "a") as out:
                        out.write(f"{name} {f}\n")
                await asyncio.to_thread(write)
            try:
                await fence.then_call([client.transactions.put(pool_prefix(pool) + f"intent/{name}-{n}".encode(),
                                                               b"launch")], provider)
            except Deposed:
                pass
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    asyncio.run(_buyer_main(*sys.argv[1:5]))
