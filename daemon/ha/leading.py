"""The daemon's HA side (``ha:`` in the config): wait to lead, then lead fenced, and end
the daemon the moment it leads no more.

:class:`Leadership` is what ``spotvisord run`` holds around the daemon
(:func:`daemon.interfaces.cli.running_daemon`):

1. :meth:`Leadership.lead` connects the etcd client (every ``ha.endpoints``), starts the
   :class:`~daemon.ha.elector.Elector`, and waits on its ``changed`` event (no polling)
   until this daemon leads; as a standby it says so once, naming the daemon that leads
   (the leader key's value), through ``on_standby``.
2. Then the daemon opens :meth:`Leadership.open_store` (an
   :class:`~daemon.ha.store.EtcdStore`, its SQLite mirror in the state dir, opened off
   the loop by :meth:`Leadership.prepare_store` while it stood by, loaded from etcd, its
   flush started) and wraps each provider with :meth:`Leadership.fenced`
   (:class:`~daemon.ha.store.FencedProvider`: no launch or terminate without a fenced sync).
3. :attr:`Leadership.lost` is set, with :attr:`Leadership.reason`, once the elector leaves
   the leader role (lease lost or expired, fence refused, key gone) or a
   :class:`~daemon.ha.fence.Deposed` ends one of the supervisor's tasks
   (:meth:`Leadership.on_task_crash`, the supervisor's crash hook). The daemon then stops
   (fail closed: every provider call after this is refused by the fence) and exits
   non-zero; the service manager (systemd ``Restart=``) starts it again, as a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, Callable, Mapping

import grpc
import structlog
from aetcd.utils import prefix_range_end

from daemon.control import leadership as ld
from daemon.controlnode.core import leaves
from daemon.ha.client import EtcdClient
from daemon.controlnode.core import stop_tasks
from daemon.ha.elector import Elector, pool_prefix
from daemon.ha.fence import Deposed, Fence
from daemon.ha.modes import leader_renew_s
from daemon.ha.store import EtcdStore, FencedProvider
from daemon.providers.base import Provider

__all__ = ["Leadership", "client_for", "leader_config", "pool_state_in_etcd"]

log = structlog.get_logger("spotvisor.ha")


def leader_config(lease_s: float) -> ld.LeaderConfig:
    """The election's timings for ``ha.lease_s`` (seconds): keepalives four times per
    TTL (at most every 1.5 s), campaigns every 0.5 s."""
    return ld.LeaderConfig(ttl_s=float(lease_s), renew_every_s=leader_renew_s(lease_s))


def _credentials(spec: Any) -> grpc.ChannelCredentials | None:
    if spec.ca_file is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(spec.ca_file).read_bytes(),
                                        private_key=Path(spec.key_file).read_bytes(),
                                        certificate_chain=Path(spec.cert_file).read_bytes())


def client_for(spec: Any) -> EtcdClient:
    """A client of the etcd cluster the config's :class:`~daemon.config.HaSpec` names (its
    endpoints, its TLS files), with a 2 s deadline per request; connected on first use."""
    return EtcdClient(spec.endpoints, timeout_s=2.0, credentials=_credentials(spec))


async def pool_state_in_etcd(spec: Any, pool: str) -> bool | None:
    """Whether etcd already holds pool ``pool``'s state (any key under
    ``/spotvisor/<pool>/``); None when etcd cannot be asked (the caller's own connect
    then says why). ``spec``: the config's :class:`~daemon.config.HaSpec`."""
    client = client_for(spec)
    try:
        prefix = pool_prefix(pool)
        page = await client.range_page(prefix, prefix_range_end(prefix), limit=1)
        return bool(page.kvs)
    except Exception:  # noqa: BLE001 - etcd out of reach or misconfigured: not this check's to report
        return None
    finally:
        with contextlib.suppress(Exception):
            await client.close()


class Leadership:
    """One daemon's part in its pool's election (module docstring). ``spec``: the config's
    :class:`~daemon.config.HaSpec`; ``pool``: ``pool.name``. Use as ``async with``:
    :meth:`aclose` steps down (revokes the lease) and closes the client."""

    def __init__(self, spec: Any, pool: str, *, on_standby: Callable[[str], None] | None = None) -> None:
        self.spec, self.pool = spec, pool
        self.on_standby = on_standby or (lambda line: None)
        self.client = client_for(spec)
        self.elector = Elector(self.client, pool=pool, name=spec.name, cfg=leader_config(spec.lease_s))
        self.fence = Fence(self.elector)
        self.store: EtcdStore | None = None
        self.lost = asyncio.Event()
        self.reason = ""
        self.led_at: float | None = None  # loop time when this daemon became the leader
        self._watch: asyncio.Task[None] | None = None
        self._prepared: EtcdStore | None = None  # the mirror opened before the lead (prepare_store)
        self._leading: asyncio.Task[None] | None = None  # the one wait of lead()
        self.campaigning = asyncio.Event()  # set once lead() was first called: the election runs

    async def __aenter__(self) -> "Leadership":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- becoming the leader --------------------------------------------------------
    async def lead(self) -> None:
        """Return once this daemon leads (waits on the elector's ``changed``, as long as it
        takes: a standby waits here). Raises gRPC/aetcd errors only from the client's
        connect; etcd out of reach is retried by the elector. Idempotent, and one wait
        however many callers (the standby's line is said once); cancelling a caller
        cancels only its own wait (:meth:`step_down` ends the shared one)."""
        if self._leading is None:
            self._leading = asyncio.create_task(self._lead(), name=f"ha:lead:{self.pool}")
            self.campaigning.set()
        await asyncio.shield(self._leading)

    async def _lead(self) -> None:
        if self.led_at is not None:
            return
        await self.client.connect()
        self.elector.start()
        said = False
        while self.elector.state.role is not ld.Role.LEADER:
            self.elector.changed.clear()
            if not said and self.elector.state.role is ld.Role.CANDIDATE:
                holder = await self._holder()
                if holder is not None and holder != self.spec.name:
                    self.on_standby(f"standby: {holder} leads pool {self.pool}; this daemon ({self.spec.name}) "
                                    "takes over when its lease ends")
                    said = True
            if self.elector.state.role is ld.Role.LEADER:
                break
            with contextlib.suppress(TimeoutError):  # a bound, not synchronisation: re-read the holder once
                async with asyncio.timeout(None if said else 1.0):
                    await self.elector.changed.wait()
        self.led_at = asyncio.get_running_loop().time()
        log.info("ha_leading", pool=self.pool, name=self.spec.name, fence=self.elector.fence)
        self._watch = asyncio.create_task(self._watch_role(), name=f"ha:watch:{self.pool}")

    async def _holder(self) -> str | None:
        with contextlib.suppress(Exception):  # noqa: BLE001  only for the standby's one line
            kv = await self.client.get(self.elector.key)
            return kv.value.decode() if kv is not None else None
        return None

    async def _watch_role(self) -> None:
        while self.elector.state.role is ld.Role.LEADER:
            self.elector.changed.clear()
            if self.elector.state.role is not ld.Role.LEADER:
                break
            await self.elector.changed.wait()
        why = self.elector.lost_because or "lease lost or expired, or fence refused"
        self.depose(f"{self.spec.name} lost the leadership of pool {self.pool}: {why}")

    # -- leading ----------------------------------------------------------------------
    async def prepare_store(self, mirror: Path, *, flush_every_s: float = 0.2) -> None:
        """Open ``mirror`` (emptied) for :meth:`open_store`, in a worker thread: SQLite's
        open writes and syncs the file, which on a busy disk (etcd's own fsyncs beside it)
        takes seconds; on the loop, right after the lead, that stalled the keepalives until
        the lease was lost. A standby calls this while it waits. Raises ``OSError``,
        ``sqlite3.Error``."""
        if self._prepared is None:
            store = EtcdStore(self.fence, mirror=mirror, flush_every_s=flush_every_s)
            self._prepared = await asyncio.to_thread(store.open)

    async def open_store(self, mirror: Path, *, flush_every_s: float = 0.2) -> EtcdStore:
        """The pool's store as this leader's: opened on ``mirror`` (emptied; by
        :meth:`prepare_store` if it was called), loaded from etcd, its flush started.
        Raises gRPC/aetcd errors: etcd out of reach."""
        await self.prepare_store(mirror, flush_every_s=flush_every_s)
        store, self._prepared = self._prepared, None
        assert store is not None
        try:
            await store.load()
        except BaseException:
            store.close()
            raise
        store.start()
        self.store = store
        return store

    def fenced(self, providers: Mapping[str, Provider]) -> dict[str, Provider]:
        """Every provider behind the fence (:class:`~daemon.ha.store.FencedProvider`)."""
        assert self.store is not None, "open_store() first"
        return {name: FencedProvider(p, self.store) for name, p in providers.items()}

    def depose(self, reason: str) -> None:
        """This daemon leads no more: set :attr:`lost` (first reason kept)."""
        if not self.lost.is_set():
            self.reason = reason
            log.error("ha_deposed", pool=self.pool, name=self.spec.name, reason=reason)
            self.lost.set()

    def on_task_crash(self, task: asyncio.Task[Any], exc: BaseException) -> bool:
        """The supervisor's crash hook: a :class:`Deposed` (alone or in a group) ends the
        daemon (True: handled); any other crash is the supervisor's to log (False)."""
        found = [e for e in (leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]) if isinstance(e, Deposed)]
        if not found:
            return False
        self.depose(f"{task.get_name()}: {found[0]}")
        return True

    async def step_down(self) -> None:
        """Hand the pool over: stop the store's flush (its last sync is fenced: a deposed
        daemon writes nothing) and revoke the lease, so the key goes at once and a standby
        leads without waiting the TTL. Call it as soon as this daemon stops acting (its
        supervisor closed), before slower closes (the feed's drain, the API's): a step-down
        is not a loss (:attr:`lost` stays as it is). Writes made after it stay in the
        mirror, never in etcd. Idempotent; the client stays open."""
        await stop_tasks([self._leading, self._watch])  # their errors were their callers'; aetcd can lose a cancel
        self._watch = None
        if self.store is not None:
            store, self.store = self.store, None
            await store.aclose()
        if self._prepared is not None:  # opened, never led
            prepared, self._prepared = self._prepared, None
            prepared.close()
        await self.elector.aclose()

    async def aclose(self) -> None:
        """:meth:`step_down` (if not done yet), then close the client. Idempotent."""
        await self.step_down()
        with contextlib.suppress(Exception):  # noqa: BLE001  the channel's close is best effort
            await self.client.close()
