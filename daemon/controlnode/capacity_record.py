"""The pool's availability record (:mod:`daemon.control.availability`): what its own
events and stock probes say of each placement domain's spot capacity, and the past other
pools saw (:mod:`daemon.controlnode.market_memory`, with ``daemon.market_dir``).

A part of the :class:`~daemon.controlnode.migrator.Migrator`, which hands it the events
and the providers' stock answers and asks it for the record a decision reads
(:meth:`CapacityRecord.view`). Observing is pure bookkeeping; the only I/O is the
market directory's: read once at :meth:`CapacityRecord.restore` (a few small files,
start-up), then through :func:`asyncio.to_thread` every
:data:`~daemon.controlnode.market_memory.SHARE_S` seconds (:meth:`CapacityRecord.share`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import structlog

from daemon.control.availability import MEMORY_S, Availability, seeded
from daemon.controlnode.core import Core
from daemon.controlnode.market_memory import SHARE_S, Changes, MarketMemory
from daemon.model import Event, EventKind
from daemon.state_dir import UnsafeStatePath

__all__ = ["SEEN", "CapacityRecord"]

log = structlog.get_logger("spotvisor.daemon")

#: the events the record is made of
SEEN = frozenset({EventKind.NODE_LAUNCHED.value, EventKind.NODE_LAUNCH_FAILED.value,
                  EventKind.INTERRUPTION_NOTICE.value, EventKind.NODE_LOST.value,
                  EventKind.MIGRATION_COMPLETED.value, EventKind.MIGRATION_FAILED.value})
_LEFT = {EventKind.MIGRATION_COMPLETED.value: "source", EventKind.MIGRATION_FAILED.value: "target"}


class CapacityRecord:
    """``own``: what this pool saw (:meth:`seen`, :meth:`read_stock`); ``past``: the other
    pools' records of its domains (``memory``: the market directory, None without one)."""

    def __init__(self, core: Core, *, memory: MarketMemory | None = None) -> None:
        self.core, self.memory = core, memory
        self.own = Availability()
        self.past: list[dict[str, Changes]] = []
        self._stock_read = float("-inf")  # the newest spot_stock answer already in the record
        self._write_failed = False

    def view(self, now: float) -> Availability:
        """The record a decision reads at ``now``: the pool's own, after the newest other
        pool's past of each domain before its own first observation there
        (:func:`~daemon.control.availability.seeded`)."""
        return seeded(self.own, self.past, now) if self.past else self.own

    def restore(self, events: Iterable[Event]) -> None:
        """The record from the store's events of the last 48 h (the others' are read by
        :meth:`read_past`, awaited at start: the first decision has them)."""
        since = self.core.clock() - MEMORY_S
        for ev in events:
            if ev.time >= since:
                self.seen(ev)

    async def read_past(self) -> None:
        """The other pools' records from the market directory, read in a thread (up to
        :data:`~daemon.controlnode.market_memory.MAX_FILES` files of a MiB: never on the loop,
        which serves the agents' API meanwhile). Nothing without a market directory."""
        if self.memory is not None:
            self.past = await asyncio.to_thread(self.memory.read_others, self.core.clock())

    def seen(self, ev: Event) -> None:
        """A spot node launched (up), noticed, lost or refused for capacity (down) in its
        domain; a domain the job left, or gave a move to up, unwatched from then."""
        left = _LEFT.get(ev.kind)
        if left is not None:
            # nothing is tried there any more, so nothing is seen of it until a probe or a launch says
            if isinstance(ev.data.get(left), str):
                self.own = self.own.observe(ev.data[left], None, ev.time)
            return
        node = self.core.nodes.get(ev.node) if ev.node is not None else None
        if ev.kind not in SEEN or node is None or node.market != "spot":
            return
        if ev.kind == EventKind.NODE_LAUNCH_FAILED.value and ev.data.get("error") != "capacity":
            return  # (a bad image, a quota, a daemon restart: nothing said of the capacity)
        self.own = self.own.observe(self.core.domain_of(node), ev.kind == EventKind.NODE_LAUNCHED.value, ev.time)

    def read_stock(self, stock: Mapping[int, tuple[float, bool]], domains: Sequence[tuple[str, Sequence[int]]]) -> None:
        """The providers' newest word on each domain's spot stock (``stock``: offer index to
        (unix s, in stock); ``domains``: name and offer indices): up when any of its spot
        offers is in stock, down when all are out."""
        for name, offers in domains:
            fresh = [stock[i] for i in offers if i in stock and stock[i][0] > self._stock_read]
            if fresh:
                self.own = self.own.observe(name, any(ok for _, ok in fresh), max(t for t, _ in fresh))
        self._stock_read = max((t for t, _ in stock.values()), default=self._stock_read)

    async def share(self) -> None:
        """Every ``SHARE_S`` seconds: this pool's own record out to the market directory,
        the others' in. A write that fails is logged once; the pool goes on with its own."""
        assert self.memory is not None
        while True:
            await asyncio.sleep(SHARE_S)  # a period, not synchronisation (read_past() read the first)
            now = self.core.clock()
            try:
                await asyncio.to_thread(self.memory.write, self.own, now)
                self._write_failed = False
            except (OSError, UnsafeStatePath) as exc:
                if not self._write_failed:
                    log.warning("market_record_not_written", directory=str(self.memory.directory), error=str(exc))
                self._write_failed = True
            self.past = await asyncio.to_thread(self.memory.read_others, now)
