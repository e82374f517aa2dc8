"""daemon.ha.elector on the real 3-member etcd cluster: the watch on the leader key makes
a standby take over at once when the key goes, and a leader whose key was deleted stop at
once; with the watch broken, the poll (a campaign every ``campaign_every_s``) still does."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from aetcd.exceptions import ConnectionFailedError

from daemon.control import leadership as ld
from daemon.ha.elector import Elector
from etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

SLOW_POLL = ld.LeaderConfig(ttl_s=5.0, campaign_every_s=5.0)  # a poll too slow to be what acts in time


async def _role(e: Elector, role: ld.Role, timeout_s: float) -> float:
    """Wait on ``e.changed`` until ``e`` is in ``role``; seconds it took."""
    start = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while True:
            e.changed.clear()
            if e.state.role is role:
                return time.monotonic() - start
            await e.changed.wait()


class _Frozen:
    """A clock that does not move: a leader that never renews and never expires by itself."""

    def __call__(self) -> float:
        return 1000.0


async def test_a_standby_takes_over_at_once_when_the_leader_steps_down(clients) -> None:
    """b polls only every 5 s; a steps down (revokes its lease): b's watch sees the key
    deleted and b campaigns then, before its next poll, and leads with a larger fence."""
    a = Elector(clients(), pool="p", name="a", cfg=SLOW_POLL).start()
    b = None
    try:
        await _role(a, ld.Role.LEADER, 15)  # a leads before b starts: b is the standby
        b = Elector(clients(), pool="p", name="b", cfg=SLOW_POLL).start()
        await _role(b, ld.Role.CANDIDATE, 15)
        async with asyncio.timeout(10):
            await b.watching.wait()
        polled = b.state.last_campaign_at
        assert polled is not None
        fence = a.fence
        await a.aclose()
        took = await _role(b, ld.Role.LEADER, 15)
        won = b.state.last_campaign_at
        assert won is not None and won < polled + SLOW_POLL.campaign_every_s  # not the poll's campaign
        assert b.may_act() and b.fence is not None and fence is not None and b.fence > fence
        print(f"takeover after a step-down: {took:.2f} s")
    finally:
        if b is not None:
            await b.aclose()
        await a.aclose()


async def test_a_leader_whose_key_is_deleted_stops_at_once(clients) -> None:
    """a's clock is frozen (it would never renew, never see its deadline: only etcd can
    tell it); its lease is revoked behind its back: its watch sees the key go, it stops."""
    admin = clients()
    a = Elector(clients(), pool="p", name="a", cfg=SLOW_POLL, clock=_Frozen()).start()
    try:
        await _role(a, ld.Role.LEADER, 15)
        async with asyncio.timeout(10):
            await a.watching.wait()
        assert a.may_act() and a.lease_id is not None
        await admin.revoke_lease(a.lease_id)
        await _role(a, ld.Role.FOLLOWER, 10)
        assert not a.may_act()
    finally:
        await a.aclose()


async def test_with_the_watch_broken_the_poll_still_takes_over(clients) -> None:
    """b's watch cannot be opened (every attempt fails): b still leads once a steps down,
    by its poll, and says its watch is broken."""
    cfg = ld.LeaderConfig(ttl_s=5.0)  # campaigns every 0.5 s
    a = Elector(clients(), pool="p", name="a", cfg=cfg).start()
    b_client = clients()

    async def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionFailedError("the watch stream broke")

    b_client.watch = broken  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        b = None
        try:
            await _role(a, ld.Role.LEADER, 15)  # a leads before b starts: b is the standby
            b = Elector(b_client, pool="p", name="b", cfg=cfg).start()
            await _role(b, ld.Role.CANDIDATE, 15)
            await a.aclose()
            await _role(b, ld.Role.LEADER, cfg.campaign_every_s + 10)
            assert not b.watching.is_set()
        finally:
            if b is not None:
                await b.aclose()
            await a.aclose()
    assert any(e["event"] == "ha_watch_broken" for e in logs)


async def test_a_leader_whose_keepalives_are_answered_late_keeps_leading(clients) -> None:
    """Every keepalive's answer takes 2.5 s (a loaded host), longer than the client's 2 s
    deadline but inside the lease's: each still renews the lease, from when it was sent;
    the leader keeps leading for two TTLs (it lost the lead within one when the client's
    deadline dropped those answers)."""
    client = clients()
    a = Elector(client, pool="p", name="a", cfg=ld.LeaderConfig(ttl_s=5.0)).start()
    try:
        await _role(a, ld.Role.LEADER, 15)
        real = client.leasestub.LeaseKeepAlive

        def slow(requests, timeout=None, metadata=None):  # type: ignore[no-untyped-def]
            async def replies():  # type: ignore[no-untyped-def]
                async with asyncio.timeout(timeout):  # gRPC's deadline: no answer after it
                    await asyncio.sleep(2.5)  # the simulated latency of the answer
                    async for reply in real(requests, timeout=timeout, metadata=metadata):
                        yield reply
            return replies()

        client.leasestub.LeaseKeepAlive = slow  # type: ignore[method-assign]
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(TimeoutError):  # no change of role for two TTLs
                await _role(a, ld.Role.FOLLOWER, 2 * a.cfg.ttl_s)
        assert a.may_act()
    finally:
        await a.aclose()
    # the operator hears of it before it costs the lead: once per streak, not each time
    slow_lines = [e for e in logs if e["event"] == "ha_keepalive_slow"]
    assert len(slow_lines) == 1 and slow_lines[0]["round_trip_s"] >= 2.5, slow_lines


async def test_a_leader_whose_own_loop_blocks_past_its_deadline_says_so(clients) -> None:
    """A blocking call holds the leader's event loop past its lease's deadline (4.25 s of
    a 5 s TTL): it stops leading, and its reason names its own stalled loop, not etcd
    (CI once showed only "no keepalive answered in time" and no way to tell them apart)."""
    a = Elector(clients(), pool="p", name="a", cfg=ld.LeaderConfig(ttl_s=5.0)).start()
    try:
        await _role(a, ld.Role.LEADER, 15)
        with structlog.testing.capture_logs() as logs:
            time.sleep(5.0)  # the blocking call under test (on the loop, on purpose)
            await _role(a, ld.Role.FOLLOWER, 10)
    finally:
        await a.aclose()
    assert "this daemon's own loop had not run for 5." in a.lost_because, a.lost_because
    assert [e["stalled_s"] >= 5.0 for e in logs if e["event"] == "ha_loop_stalled"] == [True], logs


class _LosesOneCancel:
    """An aetcd watch as a lost cancel leaves it: its iterator swallows the first
    ``CancelledError`` and waits on for events (what the partition cell's ``tasks_dumped``
    showed: the deposed daemon's key watch still in ``async for``, the daemon never ending)."""

    def __init__(self, inner) -> None:
        self.inner, self.lost = inner, 0

    def __aiter__(self):
        return self._events()

    async def _events(self):
        it = self.inner.__aiter__()
        while True:
            try:
                event = await it.__anext__()
            except asyncio.CancelledError:
                if self.lost:
                    raise
                self.lost += 1
                await asyncio.Event().wait()  # waits on, as if for the next event
            yield event

    async def cancel(self) -> None:
        await self.inner.cancel()


async def test_a_key_watch_that_loses_a_cancel_does_not_hold_the_step_down(clients, monkeypatch) -> None:
    """The leader's key watch swallows the first cancel: ``aclose`` cancels it again and
    returns (before, it waited on the watch for ever)."""
    client = clients()
    real = client.watch
    watches: list[_LosesOneCancel] = []

    async def watch(*args, **kwargs):
        watches.append(_LosesOneCancel(await real(*args, **kwargs)))
        return watches[-1]

    monkeypatch.setattr(client, "watch", watch)
    a = Elector(client, pool="p", name="a", cfg=SLOW_POLL).start()
    await _role(a, ld.Role.LEADER, 15)
    async with asyncio.timeout(10):
        await a.watching.wait()
    watch_task = a._watch_task
    assert watch_task is not None
    closing = asyncio.create_task(a.aclose())
    done, _ = await asyncio.wait([closing], timeout=15)  # not a cancel: that would be a second one, and end it
    assert done and watch_task.done(), "aclose waited on the watch that lost its cancel"
    assert [w.lost for w in watches] == [1] and not a.may_act()


async def test_stop_tasks_repeats_the_cancel_and_gives_up_on_a_task_that_ignores_every_one() -> None:
    from daemon.controlnode.core import stop_tasks

    async def swallows(limit: list[int], swallowed: list[int]) -> None:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if len(swallowed) >= limit[0]:
                    raise
                swallowed.append(1)

    twice: list[int] = []
    always: list[int] = []
    never = [10**9]
    t2 = asyncio.create_task(swallows([2], twice), name="twice")
    forever = asyncio.create_task(swallows(never, always), name="forever")
    await asyncio.sleep(0)  # both waiting
    with structlog.testing.capture_logs() as logs:
        await stop_tasks([t2, forever, None], every_s=0.01, bound_s=0.5)
    assert t2.cancelled() and len(twice) == 2
    assert not forever.done() and len(always) >= 2
    assert [(e["event"], e["task"]) for e in logs] == [("task_ignored_cancel", "forever")]
    never[0] = 0  # its next cancel is raised
    forever.cancel()
    with pytest.raises(asyncio.CancelledError):
        await forever
