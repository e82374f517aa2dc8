"""In-process grow: a new node's workers join the running group at a step boundary.

The join queue lives in the job's rendezvous store on the control node
(``$SPOTVISOR_RDZV_ENDPOINT``, a ``TCPStore``; the same store the in-process shrink
re-forms the survivors' group through), under ``spotvisor/<run id>/join``. Nothing
here restarts a worker and nothing goes through torchrun's elastic agent: the joiners
were started by their node's own launcher (``torchrun --standalone``) with
``SPOTVISOR_JOIN=1``.

The protocol, in store keys (``t`` is a ticket, 1, 2, ... in arrival order)::

    joiner (every local rank)        tickets += 1 -> t;  t/<t> = {"node", "local_rank", "local_world", "expires"}
                                     then waits for a/<t>
    rank 0 of the group, each step   tickets > next?  read t/next .. t/tickets; a node is complete once
                                     all its local ranks have a ticket; pick the longest prefix of
                                     complete nodes whose world size the global batch splits over
    every rank of the group          the pick's size is all-reduced with the notice flags
                                     (trainer.guard.PreemptionGuard.check): all agree to grow
    rank 0                           a/<t> = {"prefix", "rank", "world_size"} for every picked ticket
                                     (compare-and-set: a joiner that gave up wrote "withdrawn" first)
    everyone                         init_process_group(PrefixStore(prefix, client), rank, world_size)

A joiner waits at most until its ticket's ``expires`` (unix seconds) and then
withdraws it with the same compare-and-set, so exactly one of "admitted" and
"withdrawn" wins; rank 0 never picks a ticket within :data:`EXPIRY_MARGIN_S` of its
expiry, so the ranks of one node are admitted together or not at all.

Store semantics (``compare_set``, ``add``, ``wait``):
https://docs.pytorch.org/docs/stable/distributed.html#distributed-key-value-store
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from trainer.contract import JOIN_ENV, NODE_ID_ENV, RUN_ID_ENV

__all__ = ["Admission", "JoinQueue", "Ticket", "JoinTimeout", "joining", "run_id", "settle_survivors", "EXPIRY_MARGIN_S"]

#: Rank 0 leaves a ticket this close to its expiry alone (seconds): its joiner may withdraw it.
EXPIRY_MARGIN_S = 30.0
WITHDRAWN = "withdrawn"


def joining() -> bool:
    """Whether this worker was started to join a running group (``$SPOTVISOR_JOIN`` is ``1``)."""
    return os.environ.get(JOIN_ENV, "") == "1"


def run_id() -> str:
    """The job's run id, the same on every node: ``$SPOTVISOR_RUN_ID``, else torchrun's
    ``TORCHELASTIC_RUN_ID``, else ``job``."""
    return os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or "job"


class JoinTimeout(RuntimeError):
    """No rank 0 admitted this joiner before its ticket expired. ``str()`` is one line."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """One joining worker: ``local_world`` workers of node ``node`` join together."""

    number: int
    node: str
    local_rank: int
    local_world: int
    expires: float  # unix seconds


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a joiner goes: the new group's store prefix, its rank and the world size;
    ``first_rank``: the first joiner's rank (the group's size before the grow)."""

    prefix: str
    rank: int
    world_size: int
    first_rank: int


class JoinQueue:
    """The join queue of run ``run`` in the store at ``endpoint`` (``(host, port)``).

    One client connection, opened on first use. ``timeout_s`` bounds every store call.
    """

    def __init__(self, endpoint: tuple[str, int], run: str, *, timeout_s: float = 60.0) -> None:
        self.endpoint = endpoint
        self.prefix = f"spotvisor/{run}/join"
        self.timeout_s = timeout_s
        self._store: dist.Store | None = None
        self._seen: dict[int, Ticket] = {}  # the tickets rank 0 has read
        self._resolved: set[int] = set()  # admitted or withdrawn

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            client = dist.TCPStore(self.endpoint[0], self.endpoint[1], is_master=False,
                                   timeout=timedelta(seconds=self.timeout_s))
            self._store = dist.PrefixStore(self.prefix, client)
        return self._store

    # -- the joiner's side

    def register(self, node: str, local_rank: int, local_world: int, *, wait_s: float,
                 now: float | None = None) -> Ticket:
        """Queue this worker; returns its ticket (it expires ``wait_s`` from ``now``)."""
        now = time.time() if now is None else now
        number = int(self.store.add("tickets", 1))
        ticket = Ticket(number, node, local_rank, local_world, now + wait_s)
        self.store.set(f"t/{number}", json.dumps({"node": node, "local_rank": local_rank,
                                                  "local_world": local_world, "expires": ticket.expires}))
        return ticket

    def wait(self, ticket: Ticket, *, poll_s: float = 0.05) -> Admission:
        """Block until rank 0 admits ``ticket``.

        Raises:
            JoinTimeout: its expiry passed first (the ticket is withdrawn).
        """
        key = f"a/{ticket.number}"
        while time.time() < ticket.expires:
            if self.store.check([key]):
                return self._admission(self.store.get(key).decode())
            time.sleep(poll_s)
        won = self.store.compare_set(key, "", WITHDRAWN).decode()
        if won != WITHDRAWN:  # rank 0 admitted it at the last moment
            return self._admission(won)
        raise JoinTimeout(f"no running group admitted node {ticket.node} (ticket {ticket.number}) "
                          f"before its wait ended")

    @staticmethod
    def _admission(raw: str) -> Admission:
        body = json.loads(raw)
        return Admission(str(body["prefix"]), int(body["rank"]), int(body["world_size"]), int(body["first_rank"]))

    # -- rank 0's side

    def ready(self, world: int, valid: Callable[[int], bool], *, now: float | None = None) -> list[Ticket]:
        """The tickets to admit at this step boundary, ranks in order: the longest prefix of
        complete nodes (every local rank queued, none within :data:`EXPIRY_MARGIN_S` of its
        expiry) whose ranks added to ``world`` give a world size ``valid`` accepts.
        Cheap when nobody waits: one ``add(0)`` round trip."""
        now = time.time() if now is None else now
        count = int(self.store.add("tickets", 0))
        start = self._next()
        if count < start:
            return []
        for number in range(start, count + 1):
            if number not in self._seen and number not in self._resolved:
                t = self._read(number)
                if t is not None:
                    self._seen[number] = t
        nodes: dict[str, list[Ticket]] = {}
        for number in range(start, count + 1):
            t = self._seen.get(number)
            if t is not None and number not in self._resolved and now < t.expires - EXPIRY_MARGIN_S:
                nodes.setdefault(t.node, []).append(t)
        pick: list[Ticket] = []
        total = world
        chosen: list[Ticket] = []
        for tickets in nodes.values():  # in order of each node's first ticket
            ranks = {t.local_rank for t in tickets}
            if ranks != set(range(tickets[0].local_world)):
                continue  # not all of its workers are here yet
            chosen += sorted(tickets, key=lambda t: t.local_rank)
            total += tickets[0].local_world
            if valid(total):
                pick = list(chosen)
        return pick

    def admit(self, tickets: list[Ticket], *, prefix: str, first_rank: int, world_size: int) -> None:
        """Admit ``tickets`` (from :meth:`ready`) as ranks ``first_rank, first_rank + 1, ...``
        of the group ``prefix`` of ``world_size`` ranks. A withdrawn ticket (impossible
        outside the expiry margin) raises ``RuntimeError``: the group would wait for it."""
        for i, t in enumerate(tickets):
            body = json.dumps({"prefix": prefix, "rank": first_rank + i, "world_size": world_size,
                               "first_rank": first_rank})
            won = self.store.compare_set(f"a/{t.number}", "", body).decode()
            if won != body:
                raise RuntimeError(f"ticket {t.number} of node {t.node} was withdrawn while being admitted")
            self._resolved.add(t.number)
        self._advance()

    def _read(self, number: int) -> Ticket | None:
        """Ticket ``number``, or None while its joiner is still writing it."""
        if not self.store.check([f"t/{number}"]):
            return None
        if self.store.check([f"a/{number}"]):
            self._resolved.add(number)  # withdrawn (or admitted by an earlier rank 0)
            return None
        body = json.loads(self.store.get(f"t/{number}").decode())
        return Ticket(number, str(body["node"]), int(body["local_rank"]), int(body["local_world"]),
                      float(body["expires"]))

    def _next(self) -> int:
        """The first ticket not yet resolved (1 when none is)."""
        return int(self.store.get("next").decode()) if self.store.check(["next"]) else 1

    def _advance(self) -> None:
        """Move ``next`` past the tickets resolved or expired, so later scans start there."""
        start, now = self._next(), time.time()
        n = start
        while n in self._resolved or (n in self._seen and self._seen[n].expires <= now):
            n += 1
        if n > start:
            self.store.set("next", str(n))


def settle_survivors(endpoint: tuple[str, int], run: str, attempt: str, old_rank: int, *, settle_s: float,
                     timeout_s: float = 60.0) -> tuple[int, int, str]:
    """After a collective failed (a peer lost without notice): agree with the other
    survivors of attempt ``attempt`` on the new group. Returns ``(new rank, world size,
    store prefix)``, the same on every survivor.

    Each survivor registers under ``spotvisor/<run>/loss/<attempt>``; the first to arrive
    sets a deadline ``settle_s`` seconds on; after it the first reader closes the round
    (compare-and-set of the count), so all see one member list. New ranks keep the old
    order. A failed collective reaches every survivor within about the time the failed
    ones take to destroy their group (their sockets close), so ``settle_s`` covers them.

    Raises:
        JoinTimeout: this survivor arrived after the round closed: it must leave (exit
            non-zero); the daemon replaces its node or torchrun restarts it.
    """
    client = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = f"spotvisor/{run}/loss/{attempt}"
    store = dist.PrefixStore(prefix, client)
    n = int(store.add("count", 1))
    store.set(f"m/{n}", str(old_rank))
    if n == 1:
        store.compare_set("deadline", "", repr(time.time() + settle_s))
    store.wait(["deadline"])
    left = float(store.get("deadline").decode()) - time.time()
    if left > 0:
        time.sleep(left)  # the settle window: survivors whose collective fails later arrive meanwhile
    closed = int(store.compare_set("closed", "", str(int(store.add("count", 0)))).decode())
    if n > closed:
        raise JoinTimeout(f"rank {old_rank} reached the survivors' round of attempt {attempt} after it closed")
    ranks = sorted(int(store.get(f"m/{i}").decode()) for i in range(1, closed + 1))
    return ranks.index(old_rank), closed, f"{prefix}/group"
