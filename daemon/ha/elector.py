"""The election's edge: carries out :mod:`daemon.control.leadership`'s actions on etcd
and feeds back what etcd answered.

One loop task (``ha:elector:<pool>``) takes observations from a queue (a ``Tick``
every ``tick_s`` when nothing else came), calls :func:`~daemon.control.leadership.decide`
with the monotonic clock, and starts each action as a task of its own
(``ha:<action>:<pool>``), whose answer comes back through the queue; requests have
the client's deadline (``EtcdClient(timeout_s=...)``), and a failed or timed-out one
is the ``Failed`` observation, fed back ``retry_s`` later (etcd out of reach is asked at
most every ``retry_s``, and the failures of a streak are logged at its 1st, 10th and every
100th, not each time). Every task is owned and cancelled by :meth:`Elector.aclose`,
which steps down (revokes the lease, so the key goes at once and a standby takes over
without waiting the TTL; bounded by the client's deadline).

A second task (``ha:keywatch:<pool>``) watches the leader key (etcd's Watch,
https://etcd.io/docs/v3.4/learning/api/#watch-api, from the revision of a read so no
deletion between the read and the watch is missed) and feeds each deletion as
``LeaderKeyGone(revision)``: a standby campaigns at once when the key goes (revoked on
a step-down, or its lease expired), a leader whose key was deleted stops at once. The
watch is an accelerator, never the only signal: when its stream breaks (the member it
was on died) it is opened again after ``retry_s``, from the last revision it saw, and
meanwhile the candidate's campaign every ``campaign_every_s`` (the poll) and the
leader's keepalives bound how late a change is seen (the takeover bound: the lease's
TTL plus one poll).

Keys (under ``/spotvisor/<pool>/``): ``leader``, the daemon's name, under its lease;
its ``create_revision`` is the fence token (:mod:`daemon.ha.fence`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Awaitable, Callable

import structlog
from aetcd.exceptions import RevisionCompactedError

from daemon.control import leadership as ld
from daemon.ha.client import EtcdClient
from daemon.controlnode.core import stop_tasks

__all__ = ["Elector", "leader_key", "pool_prefix"]

log = structlog.get_logger("spotvisor.ha")


def pool_prefix(pool: str) -> bytes:
    """``/spotvisor/<pool>/``: every key of the pool's HA state lives under it."""
    if not pool or "/" in pool:
        raise ValueError(f"pool name {pool!r} must be non-empty and have no '/'")
    return f"/spotvisor/{pool}/".encode()


def leader_key(pool: str) -> bytes:
    return pool_prefix(pool) + b"leader"


class Elector:
    """Campaigns for ``pool``'s leadership as ``name`` (module docstring). Construct, then
    :meth:`start`; :meth:`aclose` is idempotent. :meth:`may_act` is the gate for every act.
    ``tick_s``, ``retry_s``: seconds (the loop's idle tick; the pace of a retry after a
    failed request or a broken watch); ``clock``: monotonic seconds; ``watch``: False runs
    without the key's watch (the poll alone)."""

    def __init__(self, client: EtcdClient, *, pool: str, name: str, cfg: ld.LeaderConfig | None = None,
                 tick_s: float = 0.1, retry_s: float = 0.2, clock: Callable[[], float] = time.monotonic,
                 watch: bool = True) -> None:
        self.client = client
        self.pool = pool
        self.name = name
        self.cfg = cfg or ld.LeaderConfig()
        self.key = leader_key(pool)
        self.tick_s = tick_s
        self.retry_s = retry_s
        self._failures = 0  # requests failed in a row
        self.clock = clock
        self.state = ld.INITIAL
        self.changed = asyncio.Event()  # set on each change of role (tests, the daemon's gate)
        self._queue: asyncio.Queue[ld.Observation] = asyncio.Queue(maxsize=256)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._watch = watch  # False: the poll alone (tests of what the fence does without it)
        self._watch_task: asyncio.Task[None] | None = None
        self.watching = asyncio.Event()  # set while the key's watch stream is open (tests)
        self.lost_because = ""  # why it last stopped leading (leadership.why_lost), for the deposition's line
        self._stepped_at: float | None = None  # the clock at the loop's last step (a stall shows as a gap)
        self._slow = 0  # keepalives answered later than a renewal period, in a row

    # -- what the daemon reads --------------------------------------------------
    def may_act(self) -> bool:
        return ld.may_act(self.state, self.clock(), self.cfg)

    @property
    def fence(self) -> int | None:
        return self.state.fence

    @property
    def lease_id(self) -> int | None:
        return self.state.lease_id

    def observe(self, obs: ld.Observation) -> None:
        """Feed an observation from elsewhere (a fenced txn that failed: ``FenceRejected``).
        Dropped when the queue is full (256: a stuck loop; the ticks catch up)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(obs)

    # -- lifetime ---------------------------------------------------------------
    def start(self) -> "Elector":
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name=f"ha:elector:{self.pool}")
            if self._watch:
                self._watch_task = asyncio.create_task(self._watch_key(), name=f"ha:keywatch:{self.pool}")
        return self

    async def aclose(self) -> None:
        """Step down (revoke the lease: the key goes with it) and stop every task."""
        if self._loop_task is None:
            return
        task, self._loop_task = self._loop_task, None
        watch, self._watch_task = self._watch_task, None
        await stop_tasks([task, watch, *self._tasks])  # cancelled again while one runs on (aetcd can lose one)
        out = ld.decide(self.state, ld.Stop(), self.clock(), self.cfg)
        self.state = out.state
        for action in out.actions:
            with contextlib.suppress(Exception):  # best effort: the TTL ends the lease anyway
                await asyncio.shield(self._revoke(action.lease_id))  # type: ignore[union-attr]
        self.changed.set()

    # -- the loop ---------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            obs: ld.Observation = ld.Tick()
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel
                async with asyncio.timeout(self.tick_s):
                    obs = await self._queue.get()
            self._step(obs)

    async def _watch_key(self) -> None:
        """Feed every deletion of the leader key as ``LeaderKeyGone`` (module docstring);
        a broken stream is opened again ``retry_s`` later from the next revision unseen."""
        start = 0  # the first revision not yet seen (0: read the key first)
        failures = 0
        me = asyncio.current_task()
        while True:
            watch = None
            try:
                if not start:
                    start = (await self.client.range_page(self.key)).header.revision + 1
                watch = await self.client.watch(self.key, start_revision=start)
                if me is not None and me.cancelling():  # a cancel aetcd's watch() lost (3.11's wait_for)
                    raise asyncio.CancelledError
                self.watching.set()
                async for event in watch:
                    failures = 0
                    start = event.kv.mod_revision + 1
                    if event.kind == "DELETE":
                        self.observe(ld.LeaderKeyGone(event.kv.mod_revision))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  the stream broke or etcd is away: the poll bounds it
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("ha_watch_broken", pool=self.pool, error=repr(exc)[:200], in_a_row=failures)
                if isinstance(exc, RevisionCompactedError):  # that revision is gone: read the key again
                    start = 0
            finally:
                self.watching.clear()
                if watch is not None:
                    with contextlib.suppress(Exception):  # noqa: BLE001  the stream may be gone already
                        async with asyncio.timeout(self.retry_s * 5):
                            await watch.cancel()
            await asyncio.sleep(self.retry_s)  # the retry's pace, not synchronisation

    def _step(self, obs: ld.Observation) -> None:
        before, now = self.state, self.clock()
        stalled_s = now - self._stepped_at if self._stepped_at is not None else 0.0
        self._stepped_at = now
        if stalled_s >= ld.STALL_S and before.role is ld.Role.LEADER:
            log.warning("ha_loop_stalled", pool=self.pool, name=self.name, stalled_s=round(stalled_s, 2),
                        lease_s=before.ttl_s, note="this daemon's event loop did not run: a blocking call, "
                        "or the host starved it of CPU; the lease is at risk")
        out = ld.decide(before, obs, now, self.cfg)
        self.state = out.state
        if out.state.role is not before.role:
            log.info("ha_role", pool=self.pool, name=self.name, role=out.state.role.value,
                     was=before.role.value, fence=out.state.fence, lease=out.state.lease_id,
                     on=type(obs).__name__)  # what changed it (Tick: a deadline passed)
            if before.role is ld.Role.LEADER:
                self.lost_because = ld.why_lost(before, obs, now, stalled_s=stalled_s)
            self.changed.set()
        for action in out.actions:
            self._spawn(self._carry_out(action), f"ha:{type(action).__name__}:{self.pool}")

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, action: ld.Action) -> None:
        sent = self.clock()
        try:
            obs = await self._request(action, sent)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  every etcd/gRPC failure is the same observation: try again
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                log.warning("ha_request_failed", pool=self.pool, action=type(action).__name__,
                            error=repr(exc)[:200], in_a_row=self._failures)
            await asyncio.sleep(self.retry_s)  # the retry's pace (no busy loop while etcd is away)
            obs = ld.Failed()
        else:
            self._failures = 0
        if obs is not None:
            self.observe(obs)

    async def _request(self, action: ld.Action, sent: float) -> ld.Observation | None:
        if isinstance(action, ld.GrantLease):
            lease = await self.client.lease(int(action.ttl_s))
            return ld.LeaseGranted(lease.id, float(lease.ttl), sent)
        if isinstance(action, ld.KeepAlive):
            # its answer is of use until the deadline it would set (sent + the lease's span),
            # also past the client's usual 2 s (a loaded host: etcd renewed, the reply was slow)
            span_s = ld.deadline(ld.LeaderState(lease_id=action.lease_id, ttl_s=self.state.ttl_s or self.cfg.ttl_s,
                                                confirmed_at=0.0), self.cfg) or 0.0
            wait_s = max(self.client.timeout_s, span_s)
            reply = await self.client.keepalive(action.lease_id, timeout_s=wait_s)
            self._note_round_trip(self.clock() - sent)
            return ld.LeaseRenewed(action.lease_id, float(reply.TTL) if reply is not None else -1.0, sent)
        if isinstance(action, ld.Campaign):
            return await self._campaign(action.lease_id)
        await self._revoke(action.lease_id)
        return None

    def _note_round_trip(self, rtt_s: float) -> None:
        """Warn when keepalives come back later than a renewal period (the 1st, 10th and
        every 100th of a streak): the margin to the lease's deadline is being eaten, and
        the operator learns it before a deposition does."""
        if rtt_s < self.cfg.renew_every_s:
            self._slow = 0
            return
        self._slow += 1
        if self._slow in (1, 10) or self._slow % 100 == 0:
            log.warning("ha_keepalive_slow", pool=self.pool, name=self.name, round_trip_s=round(rtt_s, 2),
                        renew_every_s=self.cfg.renew_every_s, lease_s=self.state.ttl_s or self.cfg.ttl_s,
                        in_a_row=self._slow, note="etcd, the network to it, or this host slow")

    async def _campaign(self, lease_id: int) -> ld.Observation:
        tx = self.client.transactions
        won, answers = await self.client.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, self.name.encode(), lease=lease_id), tx.get(self.key)],
            failure=[tx.get(self.key)],
        )
        kvs = answers[-1] if answers else []
        if not kvs:  # deleted between the compare and the read: impossible in one txn; try again
            return ld.Failed()
        kv = kvs[0][1]
        if won:
            return ld.CampaignWon(lease_id, kv.create_revision)
        return ld.CampaignLost(lease_id, kv.lease, kv.create_revision)

    async def _revoke(self, lease_id: int) -> None:
        with contextlib.suppress(Exception):  # noqa: BLE001  gone already, or etcd away: the TTL ends it
            await self.client.revoke_lease(lease_id)
