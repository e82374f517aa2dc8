"""Membership across nodes, in the running workers: a new node's workers join the
running group at a step boundary (the grow), and the survivors of a peer lost without
notice agree on their new group (:func:`settle_survivors`, :class:`LossWatch`).

The join queue lives in the job's rendezvous store on the control node
(``$SPOTVISOR_RDZV_ENDPOINT``, a ``TCPStore``; the same store the in-process shrink
re-forms the survivors' group through), under ``spotvisor/<run id>/join``. Nothing
here restarts a worker and nothing goes through torchrun's elastic agent: the joiners
were started by their node's own launcher (``torchrun --standalone``) with
``SPOTVISOR_JOIN=1``.

The protocol, in store keys (``t`` is a ticket, 1, 2, ... in arrival order)::

    joiner (every local rank)        tickets += 1 -> t;  t/<t> = {"node", "local_rank", "local_world", "expires",
                                     "cert", "cert_sig", "sig"}  then waits for a/<t>
    rank 0 of the group, each step   tickets > next?  read t/next .. t/tickets (at most MAX_READS_PER_STEP);
                                     a ticket whose proof fails is refused: a/<t> = "refused: <why>";
                                     a node is complete once all its local ranks have a ticket; pick the
                                     longest prefix of complete nodes whose world size the global batch
                                     splits over
    every rank of the group          the pick's size is all-reduced with the notice flags
                                     (trainer.guard.PreemptionGuard.check): all agree to grow
    rank 0                           a/<t> = {"prefix", "rank", "world_size"} for every picked ticket
                                     (compare-and-set: a joiner that gave up wrote "withdrawn" first)
    everyone                         init_process_group(PrefixStore(prefix, client), rank, world_size)

**Who may join.** The store has no authentication, so a ticket counts only with a
proof (:mod:`trainer.credential`): the certificate the job's daemon issued to the node
when it admitted it (``$SPOTVISOR_JOIN_CREDENTIAL``) and that node key's signature
over the ticket's fields, its number and the run id included. Rank 0 checks it with
the daemon's public key from its own credential (:class:`~trainer.credential.Verifier`);
a ticket without one, of another run, expired, of another node, forged or copied off
the store to a new number is refused: rank 0 writes ``refused: <why>`` as its
admission (the joiner exits, :class:`JoinRefused`), logs it and counts it
(:attr:`JoinQueue.refused`). A rank 0 without a credential refuses every ticket.
The survivors' round after a loss (:func:`settle_survivors`) is a way into the group
too: its entries carry the same proofs, and every survivor leaves out those that fail.
Its ``alive/<rank>`` and ``in/<rank>`` keys carry none (they only say when to close): an
outsider that writes them can make the round wait, at most ``timeout_s``, or close before
a survivor's entry, which then joins as a newcomer; it cannot get into the group.

A joiner waits at most until its ticket's ``expires`` (unix seconds) and then
withdraws it with the same compare-and-set, so exactly one of "admitted" and
"withdrawn" wins; rank 0 never picks a ticket within :data:`EXPIRY_MARGIN_S` of its
expiry, so the ranks of one node are admitted together or not at all.

Store semantics (``compare_set``, ``add``, ``wait``):
https://docs.pytorch.org/docs/stable/distributed.html#distributed-key-value-store
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainer import group_sockets
from trainer.contract import JOIN_ENV, RUN_ID_ENV
from trainer.credential import CredentialRefused, NodeCredential, Verifier
from trainer.store_retry import PROBE_S, StoreRetry, current_endpoint, store_reachable

__all__ = ["Admission", "JoinQueue", "Ticket", "JobCompleted", "JoinRefused", "JoinTimeout", "LossWatch", "joining",
           "run_id", "settle_survivors", "SurvivorRound", "wake_survivors", "StoreRetry", "store_reachable",
           "EXPIRY_MARGIN_S", "MAX_READS_PER_STEP"]

log = logging.getLogger("trainer.membership")

#: Rank 0 leaves a ticket this close to its expiry alone (seconds): its joiner may withdraw it.
EXPIRY_MARGIN_S = 30.0
#: Rank 0 reads at most this many new tickets at one step boundary (a flooded queue
#: costs each step that many store round trips, no more); the rest wait for the next.
MAX_READS_PER_STEP = 64
#: Refused tickets rank 0 logs one by one; after that, every 100th (with the count).
LOGGED_REFUSALS = 10
WITHDRAWN = "withdrawn"
REFUSED = "refused"


def joining() -> bool:
    """Whether this worker was started to join a running group (``$SPOTVISOR_JOIN`` is ``1``)."""
    return os.environ.get(JOIN_ENV, "") == "1"


def _is_entry_of(ticket: Ticket, raw: bytes) -> bool:
    """Whether a ticket entry in the store (:meth:`JoinQueue.register`'s body) is ``ticket``'s."""
    try:
        body = json.loads(raw)
        return (body["node"], body["local_rank"], body["expires"]) == (ticket.node, ticket.local_rank, ticket.expires)
    except (ValueError, KeyError, TypeError):
        return False


def run_id() -> str:
    """The job's run id, the same on every node: ``$SPOTVISOR_RUN_ID``, else torchrun's
    ``TORCHELASTIC_RUN_ID``, else ``job``."""
    return os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or "job"


class JobCompleted(RuntimeError):
    """The job reached its target while this worker waited to join. ``str()`` is one line."""


class JoinTimeout(RuntimeError):
    """No rank 0 admitted this joiner before its ticket expired. ``str()`` is one line."""


class JoinRefused(RuntimeError):
    """Rank 0 refused this joiner's ticket (its proof did not hold), or its admission names
    ranks it cannot join as. ``str()`` is one line."""


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
    ``first_rank``: the group's size before the grow; ``ranks``: every joiner's rank in
    the new group (``first_rank .. world_size - 1`` unless the grow placed them among
    the old ranks: :func:`trainer.integrations.p2p_reshard.grow_ranks`)."""

    prefix: str
    rank: int
    world_size: int
    first_rank: int
    ranks: tuple[int, ...] = ()


def _admission(ticket: Ticket, raw: str) -> Admission:
    """The admission rank 0 wrote for ``ticket`` (``raw``, from the store).

    Raises:
        JoinRefused: rank 0 refused the ticket, or the admission names ranks no grow has
            (rank 0, a rank twice, one past the world, not this joiner's own): the joiner
            would wait on a group that never forms.
    """
    if raw.startswith(REFUSED):
        raise JoinRefused(f"the running group refused node {ticket.node}'s ticket {ticket.number} "
                          f"({raw[len(REFUSED):].lstrip(': ')[:200]})")
    body = json.loads(raw)
    rank, first, world = int(body["rank"]), int(body["first_rank"]), int(body["world_size"])
    try:
        ranks = tuple(int(r) for r in list(body.get("ranks", range(first, world)))[:world])
    except (TypeError, ValueError):
        ranks = ()
    if rank not in ranks or len(set(ranks)) != len(ranks) or not all(0 < r < world for r in ranks):
        raise JoinRefused(f"node {ticket.node}'s admission names ranks {list(ranks)[:16]} for rank {rank} of "
                          f"{world}: not a grow this worker can join")
    return Admission(str(body["prefix"]), rank, world, first, ranks)


class JoinQueue:
    """The join queue of run ``run`` in the store at ``endpoint`` (``(host, port)``).

    One client connection, opened on first use. ``timeout_s`` bounds every store call.
    ``verifier``: what rank 0 checks tickets with (from its own credential:
    :meth:`~trainer.credential.NodeCredential.verifier`); None refuses every ticket.
    """

    def __init__(self, endpoint: tuple[str, int], run: str, *, timeout_s: float = 60.0,
                 verifier: Verifier | None = None) -> None:
        self._given = endpoint
        self._store_at: tuple[str, int] | None = None  # where the client in use connects
        self.run = run
        self.prefix = f"spotvisor/{run}/join"
        self.timeout_s = timeout_s
        self.verifier = verifier
        self.refused = 0  # tickets rank 0 refused (their proof did not hold)
        self._store: dist.Store | None = None
        self._seen: dict[int, Ticket] = {}  # the tickets rank 0 has read and checked
        self._resolved: set[int] = set()  # admitted, withdrawn or refused
        self._credential: NodeCredential | None = None  # the joiner's, to queue again on a store back empty

    @property
    def endpoint(self) -> tuple[str, int]:
        """The store's ``(host, port)`` now (:func:`trainer.store_retry.current_endpoint`)."""
        return current_endpoint(self._given) or self._given

    @property
    def store(self) -> dist.Store:
        """The queue's client, built again when the store has moved (an HA takeover). Ticket
        numbers are each store's own: what rank 0 read or resolved in the old one is
        forgotten with it (a ticket 1 queued in the new store is a new ticket)."""
        at = self.endpoint
        if self._store is None or at != self._store_at:
            client = dist.TCPStore(at[0], at[1], is_master=False, timeout=timedelta(seconds=self.timeout_s))
            if self._store_at is not None and at != self._store_at:
                self._seen, self._resolved = {}, set()
            self._store, self._store_at = dist.PrefixStore(self.prefix, client), at
        return self._store

    def _moved(self, ticket: Ticket) -> tuple[Ticket, Admission | None]:
        """The joiner's side of a store move (an HA takeover, the old store perhaps still
        answering): an admission rank 0 wrote in the old store before it moved still
        counts; else ``ticket`` is queued again in the new store, where rank 0 now looks."""
        old, key = self._store, f"a/{ticket.number}"
        if old is not None:
            try:
                if old.check([key]):
                    return ticket, _admission(ticket, old.get(key).decode())
            except dist.DistError:  # the old store is gone with its control node: nothing was admitted there
                pass
        self._store = None
        return self._requeue(ticket), None

    def _fields(self, number: int, node: str, local_rank: int, local_world: int, expires: float) -> dict[str, Any]:
        """What a ticket's proof signs: its fields, its number and the run."""
        return {"run": self.run, "number": number, "node": node, "local_rank": local_rank,
                "local_world": local_world, "expires": expires}

    # -- the joiner's side

    def register(self, node: str, local_rank: int, local_world: int, *, wait_s: float,
                 credential: NodeCredential | None, now: float | None = None) -> Ticket:
        """Queue this worker with its node's ``credential`` (None: rank 0 will refuse it);
        returns its ticket (it expires ``wait_s`` from ``now``)."""
        now = time.time() if now is None else now
        return self._enter(node, local_rank, local_world, now + wait_s, credential)

    def _enter(self, node: str, local_rank: int, local_world: int, expires: float,
               credential: NodeCredential | None) -> Ticket:
        """Write a ticket that expires at ``expires`` (unix s) under the next number."""
        number = int(self.store.add("tickets", 1))
        ticket = Ticket(number, node, local_rank, local_world, expires)
        fields = self._fields(number, node, local_rank, local_world, ticket.expires)
        body = {k: fields[k] for k in ("node", "local_rank", "local_world", "expires")}
        if credential is not None:
            body.update(credential.prove("ticket", fields))
        self.store.set(f"t/{number}", json.dumps(body))
        self._credential = credential
        return ticket

    def queue_up(self, node: str, local_rank: int, local_world: int, *, wait_s: float,
                 credential: NodeCredential | None) -> Ticket:
        """:meth:`register`, waiting for a store that is out of reach (backoff, each try a
        1 s connect probe) within ``wait_s``, which the ticket's expiry then counts from
        the same start: a joiner started during a store outage waits for it rather than
        failing (and its node being replaced, and the replacement failing the same way).

        Raises:
            JoinTimeout: the store stayed out of reach for ``wait_s`` seconds.
        """
        deadline, retry = time.time() + wait_s, StoreRetry()
        while True:
            try:
                if not store_reachable(self.endpoint):
                    raise dist.DistNetworkError("no answer")
                ticket = self.register(node, local_rank, local_world, wait_s=deadline - time.time(),
                                       credential=credential)
                retry.ok()
                return ticket
            except dist.DistError as exc:
                self._store = None
                retry.failed(exc, what=f"node {node}'s join ticket")
                if time.time() + retry.wait_s() >= deadline:
                    raise JoinTimeout(f"node {node} could not queue to join: the rendezvous store stayed out of "
                                      f"reach for {wait_s:.0f} s") from None
                time.sleep(retry.wait_s())

    def wait(self, ticket: Ticket, *, poll_s: float = 0.05) -> Admission:
        """Block until rank 0 admits ``ticket``.

        Raises:
            JoinTimeout: its expiry passed first (the ticket is withdrawn).
            JoinRefused: rank 0 refused it (its proof did not hold).
            JobCompleted: the job reached its target meanwhile (:meth:`complete`).
        """
        retry = StoreRetry()
        while time.time() < ticket.expires:
            try:
                if retry.failed_before:  # back from an outage: a new client, the ticket queued again if it is gone
                    if not store_reachable(self.endpoint):
                        raise dist.DistNetworkError("no answer")
                    ticket = self._requeue(ticket)
                elif self._store is not None and self.endpoint != self._store_at:  # the store moved
                    ticket, admitted = self._moved(ticket)
                    if admitted is not None:
                        return admitted
                # the client the ticket is in, not the property: a move seen between the check
                # above and a read here would switch stores with the ticket left behind
                store, key = self._store if self._store is not None else self.store, f"a/{ticket.number}"
                if store.check([key]):
                    return _admission(ticket, store.get(key).decode())
                if store.check(["completed"]):
                    raise JobCompleted(f"the job completed at step {store.get('completed').decode()} "
                                       f"before node {ticket.node} joined")
                retry.ok()
                time.sleep(poll_s)
            except dist.DistError as exc:  # the store out of reach: wait for it (the ticket's expiry bounds it)
                self._store = None
                retry.failed(exc, what=f"node {ticket.node}'s join ticket {ticket.number}")
                time.sleep(min(retry.wait_s(), max(0.0, ticket.expires - time.time())))
        key = f"a/{ticket.number}"
        try:
            won = self.store.compare_set(key, "", WITHDRAWN).decode()
        except dist.DistError:
            raise JoinTimeout(f"no running group admitted node {ticket.node} (ticket {ticket.number}) before its "
                              "wait ended (the rendezvous store out of reach)") from None
        if won != WITHDRAWN:  # rank 0 admitted (or refused) it at the last moment
            return _admission(ticket, won)
        raise JoinTimeout(f"no running group admitted node {ticket.node} (ticket {ticket.number}) "
                          f"before its wait ended")

    def _requeue(self, ticket: Ticket) -> Ticket:
        """After the store was out of reach or moved: ``ticket`` again if the store kept it,
        else (a store restarted empty, or a new leader's) a new ticket for the same worker
        with the same expiry. The ticket is kept only if the store's entry of its number is
        this worker's: in a store that lost it, another joiner may hold that number now."""
        key = f"t/{ticket.number}"
        if self.store.check([key]) and _is_entry_of(ticket, self.store.get(key)):
            return ticket
        again = self._enter(ticket.node, ticket.local_rank, ticket.local_world, ticket.expires, self._credential)
        log.warning("node %s's join ticket %d was gone from the rendezvous store (restarted or moved): queued "
                    "again as ticket %d", ticket.node, ticket.number, again.number)
        return again

    # -- rank 0's side

    def ready(self, world: int, valid: Callable[[int], bool], *, now: float | None = None) -> list[Ticket]:
        """The tickets to admit at this step boundary, ranks in order: the longest prefix of
        complete nodes (every local rank queued, none within :data:`EXPIRY_MARGIN_S` of its
        expiry) whose ranks added to ``world`` give a world size ``valid`` accepts. Each
        ticket's proof is checked once, when it is read; one that fails is refused
        (:meth:`_refuse`). Cheap when nobody waits: one ``add(0)`` round trip; at most
        :data:`MAX_READS_PER_STEP` tickets are read at one boundary."""
        now = time.time() if now is None else now
        count = int(self.store.add("tickets", 0))
        start = self._next()
        if count < start:
            return []
        reads, refused = 0, self.refused
        for number in range(start, count + 1):  # bounded: tickets already read, plus MAX_READS_PER_STEP
            if number not in self._seen and number not in self._resolved:
                if reads == MAX_READS_PER_STEP:
                    break
                reads += 1
                t = self._read(number, now)
                if t is not None:
                    self._seen[number] = t
        if self.refused > refused:
            self._advance()  # later scans start past the refused ones
        nodes: dict[str, dict[int, Ticket]] = {}
        for number in sorted(n for n in self._seen if start <= n <= count):
            t = self._seen[number]
            if number not in self._resolved and now < t.expires - EXPIRY_MARGIN_S:
                nodes.setdefault(t.node, {})[t.local_rank] = t  # a worker queued twice: its newest ticket
        pick: list[Ticket] = []
        total = world
        chosen: list[Ticket] = []
        for by_rank in nodes.values():  # in order of each node's first ticket
            tickets = list(by_rank.values())
            if set(by_rank) != set(range(tickets[0].local_world)):
                continue  # not all of its workers are here yet
            chosen += sorted(tickets, key=lambda t: t.local_rank)
            total += tickets[0].local_world
            if valid(total):
                pick = list(chosen)
        return pick

    def admit(self, tickets: list[Ticket], *, prefix: str, first_rank: int, world_size: int,
              ranks: list[int] | None = None) -> None:
        """Admit ``tickets`` (from :meth:`ready`) as ranks ``ranks`` (default ``first_rank,
        first_rank + 1, ...``) of the group ``prefix`` of ``world_size`` ranks, grown from
        ``first_rank``. A withdrawn ticket (impossible outside the expiry margin) raises
        ``RuntimeError``: the group would wait for it."""
        ranks = list(range(first_rank, first_rank + len(tickets))) if ranks is None else ranks
        if len(ranks) != len(tickets):
            raise ValueError(f"{len(ranks)} ranks for {len(tickets)} tickets")
        for t, rank in zip(tickets, ranks):
            body = json.dumps({"prefix": prefix, "rank": rank, "world_size": world_size,
                               "first_rank": first_rank, "ranks": ranks})
            won = self.store.compare_set(f"a/{t.number}", "", body).decode()
            if won != body:
                raise RuntimeError(f"ticket {t.number} of node {t.node} was withdrawn while being admitted")
            self._resolved.add(t.number)
        self._advance()

    def complete(self, step: int) -> None:
        """Rank 0, at the job's end: workers still waiting to join exit (:class:`JobCompleted`)."""
        self.store.set("completed", str(step))

    def _read(self, number: int, now: float) -> Ticket | None:
        """Ticket ``number`` once its proof holds; None while its joiner is still writing
        it, once it is resolved, or when it is refused."""
        if not self.store.check([f"t/{number}"]):
            return None
        if self.store.check([f"a/{number}"]):
            self._resolved.add(number)  # withdrawn, refused (or admitted by an earlier rank 0)
            return None
        raw = self.store.get(f"t/{number}")
        try:
            body = json.loads(raw.decode())
            if not isinstance(body, dict):
                raise ValueError("not an object")
            ticket = Ticket(number, str(body["node"]), int(body["local_rank"]), int(body["local_world"]),
                            float(body["expires"]))
        except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            self._refuse(number, f"malformed ticket ({type(exc).__name__})", "?")
            return None
        if self.verifier is None:
            self._refuse(number, "this group holds no join credential to check tickets with", ticket.node)
            return None
        try:
            self.verifier.check("ticket", self._fields(number, ticket.node, ticket.local_rank, ticket.local_world,
                                                       ticket.expires), body, now=now)
        except CredentialRefused as exc:
            self._refuse(number, str(exc), ticket.node)
            return None
        if not (0 <= ticket.local_rank < ticket.local_world):
            self._refuse(number, f"local rank {ticket.local_rank} of {ticket.local_world}", ticket.node)
            return None
        return ticket

    def _refuse(self, number: int, why: str, node: str) -> None:
        """Answer ticket ``number`` with a refusal (compare-and-set: unless its joiner has
        withdrawn it), never read it again, count it, log it (the first
        :data:`LOGGED_REFUSALS` one by one, then every 100th)."""
        self.store.compare_set(f"a/{number}", "", f"{REFUSED}: {why}")
        self._resolved.add(number)
        self.refused += 1
        if self.refused <= LOGGED_REFUSALS or self.refused % 100 == 0:
            log.warning("refused join ticket %d of node %r: %s (%d refused so far)", number, node[:64], why,
                        self.refused)

    def _next(self) -> int:
        """The first ticket not yet resolved (1 when none is)."""
        if not self.store.check(["next"]):
            return 1
        raw = self.store.get("next").decode(errors="replace")
        return int(raw) if raw.isdigit() and len(raw) < 19 else 1  # rewritten by someone else: scan from 1

    def _advance(self) -> None:
        """Move ``next`` past the tickets resolved or expired, so later scans start there."""
        start, now = self._next(), time.time()
        n = start
        while n in self._resolved or (n in self._seen and self._seen[n].expires <= now):
            n += 1
        if n > start:
            self.store.set("next", str(n))


class SurvivorRound:
    """The survivors' round of attempt ``attempt`` after a collective failed (a peer lost
    without notice), as survivor ``old_rank`` of ``old_world`` takes part in it.

    Store keys, under ``spotvisor/<run>/loss/<attempt>``::

        alive/<rank>   this rank is coming: its worker entered the round (:meth:`coming`),
                       or its LossWatch was woken by the round (the thread answers at once,
                       whatever the worker is computing)
        count, m/<n>   the entries, in arrival order, each with its proof
        in/<rank>      this rank's entry is in
        deadline       the first arrival's time + ``settle_s`` (compare-and-set)
        expected       the ranks that were coming by the deadline (compare-and-set, read by all)
        closed         the number of entries the round took (compare-and-set)

    The round closes once every expected rank's entry is in, not on a timer: a survivor
    that computes a whole step before its collective fails (a straggler, a loaded host)
    is still in the group. Only a rank that never answers by the deadline is presumed
    lost (a killed process, a powered-off node), and ``timeout_s`` after the first arrival
    bounds the wait for one that answered and then died too.

    Raises (all methods):
        torch.distributed.DistError: the store is out of reach for ``timeout_s`` seconds.
    """

    def __init__(self, endpoint: tuple[str, int], run: str, attempt: str, old_rank: int, old_world: int, *,
                 timeout_s: float = 60.0) -> None:
        endpoint = current_endpoint(endpoint) or endpoint  # one round, one store: where it is now
        self._endpoint, self._timeout_s = endpoint, timeout_s
        self.run, self.attempt, self.old_rank, self.old_world = run, attempt, old_rank, old_world
        self.prefix = f"spotvisor/{run}/loss/{attempt}"
        client = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timedelta(seconds=timeout_s))
        self._store = dist.PrefixStore(self.prefix, client)

    def coming(self) -> None:
        """Say this rank takes part (before it drops its old group, which can take a while)."""
        self._store.set(f"alive/{self.old_rank}", "coming")

    def settle(self, *, settle_s: float, credential: NodeCredential | None, node: str) -> tuple[int, int, str]:
        """Register (with a proof by this node's ``credential``, :mod:`trainer.credential`)
        and agree on the new group with the other survivors. Returns ``(new rank, world
        size, store prefix)``, the same on every survivor; new ranks keep the old order.
        ``settle_s`` (seconds): how long after the first arrival a rank may take to answer
        before it is presumed lost. Every survivor checks every entry with its own
        credential's verifier and leaves out those that fail (an outsider's, a copy).

        Raises:
            JoinTimeout: this survivor's entry came after the round closed: it joins the
                new group as a newcomer, or leaves (exit non-zero).
            JoinRefused: this survivor's own entry does not verify (it has no credential,
                or an expired one): the same.
        """
        store, old_rank, old_world = self._store, self.old_rank, self.old_world
        n = int(store.add("count", 1))
        body: dict[str, Any] = {"rank": old_rank, "node": node}
        if credential is not None:
            body.update(credential.prove("loss", {"run": self.run, "attempt": self.attempt, "number": n, **body}))
        store.set(f"m/{n}", json.dumps(body))
        store.set(f"alive/{old_rank}", "in")
        store.set(f"in/{old_rank}", str(n))
        mine = repr(time.time() + settle_s)
        if store.compare_set("deadline", "", mine).decode() == mine:  # the first to arrive (an outsider's count aside)
            for r in range(old_world):  # wake the others' LossWatch: each answers, and one blocked on a survivor comes
                if r != old_rank:
                    store.set(f"wake/{r}", "loss")
        store.wait(["deadline"])
        deadline = float(store.get("deadline").decode())
        expected = self._expected(deadline)
        self._wait_for([f"in/{r}" for r in expected], deadline - settle_s + self._timeout_s)
        closed = int(store.compare_set("closed", "", str(int(store.add("count", 0)))).decode())
        if n > closed:
            raise JoinTimeout(f"rank {old_rank} reached the survivors' round of attempt {self.attempt} after it closed")
        verifier = credential.verifier() if credential is not None else None
        ranks: set[int] = set()
        for i in range(1, closed + 1):
            rank = _survivor(store.get(f"m/{i}"), verifier, run=self.run, attempt=self.attempt, number=i,
                             now=deadline)
            if rank is not None and 0 <= rank < old_world:
                ranks.add(rank)
        if old_rank not in ranks:
            raise JoinRefused(f"rank {old_rank}'s entry in the survivors' round of attempt {self.attempt} does not "
                              f"verify ({'no join credential' if credential is None else 'its credential'})")
        order = sorted(ranks)
        return order.index(old_rank), len(order), f"{self.prefix}/group"

    def _expected(self, deadline: float) -> list[int]:
        """The ranks that answered by ``deadline`` (unix seconds), as the first survivor to
        get there saw them: one list for all."""
        store, keys = self._store, [f"alive/{r}" for r in range(self.old_world)]
        while time.time() < deadline and not store.check(keys):
            # answers come within a thread's wake-up; a lost rank never answers. Polled, as
            # TCPStore.wait's timeout logs a warning per call and a loss always reaches it
            time.sleep(min(_ANSWER_POLL_S, max(0.0, deadline - time.time())))
        seen = [r for r in range(self.old_world) if store.check([f"alive/{r}"])]
        return [int(r) for r in json.loads(store.compare_set("expected", "", json.dumps(seen)).decode())]

    def _wait_for(self, keys: list[str], until: float) -> None:
        """Wait until every key in ``keys`` is set, or until ``until`` (unix seconds)."""
        left = until - time.time()
        if not keys or left <= 0:
            return
        waiter = dist.PrefixStore(self.prefix, dist.TCPStore(self._endpoint[0], self._endpoint[1], is_master=False,
                                                             timeout=timedelta(seconds=left)))
        try:
            waiter.wait(keys, timedelta(seconds=left))
        except dist.DistStoreError:  # an expected rank answered and then died too: close without it
            log.warning("closing the survivors' round of attempt %s without a rank that answered and never came",
                        self.attempt)


#: how often a survivor looks for the other ranks' answers in a loss round (seconds)
_ANSWER_POLL_S = 0.02


def settle_survivors(endpoint: tuple[str, int], run: str, attempt: str, old_rank: int, old_world: int, *,
                     settle_s: float, credential: NodeCredential | None, node: str,
                     timeout_s: float = 60.0) -> tuple[int, int, str]:
    """:class:`SurvivorRound` in one call: say this rank is coming, then settle. The
    same returns and errors as :meth:`SurvivorRound.settle`."""
    survivors = SurvivorRound(endpoint, run, attempt, old_rank, old_world, timeout_s=timeout_s)
    survivors.coming()
    return survivors.settle(settle_s=settle_s, credential=credential, node=node)


def _survivor(raw: bytes, verifier: Verifier | None, *, run: str, attempt: str, number: int,
              now: float) -> int | None:
    """The old rank entry ``number`` of a loss round registers, once its proof holds (else
    None, with one log line). ``now``: the round's deadline, the same on every survivor,
    so all of them keep the same entries."""
    try:
        body = json.loads(raw.decode())
        rank, node = int(body["rank"]), str(body["node"])
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("left out entry %d of the survivors' round of attempt %s: malformed", number, attempt)
        return None
    if verifier is None:
        return None
    try:
        verifier.check("loss", {"run": run, "attempt": attempt, "number": number, "rank": rank, "node": node}, body,
                       now=now)
    except CredentialRefused as exc:
        log.warning("left out entry %d (rank %d of node %r) of the survivors' round of attempt %s: %s", number,
                    rank, node[:64], attempt, exc)
        return None
    return rank


def wake_survivors(endpoint: tuple[str, int], run: str, attempt: str, world_size: int, *, reason: str,
                   timeout_s: float = 10.0) -> None:
    """Wake every rank of attempt ``attempt`` (ranks ``0 .. world_size - 1``) as the first
    survivor of a loss does (:func:`settle_survivors`): each rank's :class:`LossWatch`
    fails its blocked collective and the rank joins the survivors' round. For the daemon,
    which learns of a node lost without a trace (powered off: no connection reset, so its
    peers would wait in their collective until its timeout, ``--pg-timeout-s``) from its
    heartbeats or the provider. Harmless on an attempt that has ended (nobody watches its
    keys any more). Blocking (store round trips): call it off the event loop.

    Raises:
        torch.distributed.DistError / RuntimeError: (torch) the store is out of reach.
    """
    client = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"spotvisor/{run}/loss/{attempt}", client)
    for r in range(world_size):
        store.set(f"wake/{r}", reason)


class LossWatch:
    """Unblocks this worker when other survivors have started a loss round it is not in.

    A survivor blocked in a collective on *another survivor* (not on the lost peer) is
    never told: neither gloo's ``destroy`` nor its ``abort`` closes a connection (measured
    with torch 2.13: the peer's blocked ``all_reduce`` fails only when the process that
    dropped the group exits), and a peer's NCCL kernel waits for its watchdog's timeout.
    The first survivor of a loss sets ``wake/<rank>`` for every rank of the failed attempt
    (:func:`settle_survivors`); this daemon thread waits for its own key in the store
    (``TCPStore.wait``: one outstanding request, renewed every :attr:`WAIT_S`, when the
    thread also follows the store to a new address: an HA takeover whose deposed leader's
    store still answers would otherwise keep it there). When it comes and this
    worker is not re-forming already, the thread aborts the group (NCCL) and shuts down
    the connected sockets of every process group the worker made (gloo: the descriptors
    :mod:`trainer.group_sockets` recorded and that still name those sockets, never the
    listener; a DeepSpeed or FSDP2 subgroup's too), so the blocked collective fails at
    once and the worker joins the round. It answers the round first (``alive/<rank>``):
    the survivors wait for a rank that answered, and presume lost only one that does not
    (:class:`SurvivorRound`).
    A worker wakes its own thread the same way when its attempt changes
    (:meth:`follow`) or it ends (:meth:`stop`).
    """

    #: the longest one wait on the store lasts (seconds): then the thread looks whether the
    #: store moved (an HA takeover whose old store still answers) and waits again
    WAIT_S = 30.0

    def __init__(self, endpoint: tuple[str, int], run: str) -> None:
        self._endpoint, self._run = endpoint, run
        self._client_at: tuple[str, int] | None = None  # where the client in use connects
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._watching: tuple[str, int] | None = None  # (attempt, rank)
        self._waiting_on: tuple[str, int] | None = None  # what the thread waits for now
        self._pg: Any = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._retry = StoreRetry()
        self.unblocked = 0  # how many times it shut a blocked group down
        #: set when the round woke this worker (until it follows its next attempt): a wait
        #: that no socket ends (a gloo send or receive whose peer failed elsewhere) watches it
        self.woken = threading.Event()

    def _connect(self) -> Any:
        """A new client of the store (a c10d client never reconnects). Raises
        ``torch.distributed.DistError`` when the store does not answer within 1 s."""
        host, port = current_endpoint(self._endpoint) or self._endpoint  # the store may have moved
        if not store_reachable((host, port), PROBE_S):
            raise dist.DistNetworkError(f"the rendezvous store {host}:{port} is out of reach")
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._client_at = (host, port)
        return client

    def _key(self, attempt: str, rank: int) -> str:
        return f"spotvisor/{self._run}/loss/{attempt}/wake/{rank}"

    def follow(self, attempt: str, rank: int) -> None:
        """Watch ``attempt`` as ``rank``."""
        with self._lock:
            self._watching = (attempt, rank)
            self._pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
            self.woken.clear()
            stale = self._waiting_on if self._waiting_on != self._watching else None  # its own wake reads as a loss
        if self._thread is None:
            try:
                self._client = self._connect()
            except dist.DistError:  # the store out of reach: the thread connects once it answers
                self._client = None
            self._thread = threading.Thread(target=self._run_loop, name="spotvisor-loss-watch", daemon=True)
            self._thread.start()
        self._wake(stale)

    def pause(self) -> None:
        """This worker re-forms its group itself: nothing to unblock until :meth:`follow`."""
        with self._lock:
            self._watching, self._pg = None, None

    def stop(self) -> None:
        """End the thread (the worker ends): it is woken and joined, never left in a C++ wait."""
        with self._lock:
            self._stopped = True
            stale = self._waiting_on
        self._wake(stale)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _wake(self, target: tuple[str, int] | None) -> None:
        self._changed.set()
        host, port = current_endpoint(self._endpoint) or self._endpoint
        if target is not None and store_reachable((host, port)):  # else its wait fails, and it sees the change
            try:
                client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
                client.set(self._key(*target), "self")
            except Exception:  # the store out of reach: the thread's wait ends at its timeout
                pass

    def _run_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                target = self._waiting_on = self._watching
                self._changed.clear()
            if target is None:
                self._changed.wait(1.0)
                continue
            t0 = time.monotonic()
            try:
                if self._client is None or (current_endpoint(self._endpoint) or self._endpoint) != self._client_at:
                    self._client = self._connect()  # first, back from an outage, or the store moved
                    self._retry.ok()
                self._client.wait([self._key(*target)], timedelta(seconds=self.WAIT_S))
            except Exception as exc:  # WAIT_S without a loss, or the store out of reach
                if time.monotonic() - t0 < self.WAIT_S * 0.9:  # the store: a new client once it answers, never a spin
                    self._client = None
                    self._retry.failed(exc, what="the loss watch")
                    self._changed.wait(self._retry.wait_s())
                continue
            with self._lock:  # held throughout: pause() returns only once no descriptor is touched
                if self._stopped:
                    return
                if self._watching != target:
                    continue  # woken by its own worker: the attempt changed
                pg = self._pg
                self._watching, self._pg = None, None
                self.woken.set()
                self._answer(*target)
                self._shut(group_sockets.live(), pg)

    def _answer(self, attempt: str, rank: int) -> None:
        """Tell the loss round this rank is alive and coming (:class:`SurvivorRound`),
        however long its worker takes to reach its failed collective."""
        try:
            self._client.set(f"spotvisor/{self._run}/loss/{attempt}/alive/{rank}", "woken")
        except Exception:  # the store out of reach: the round presumes this rank lost; it joins as a newcomer
            log.warning("could not answer the survivors' round of attempt %s", attempt)

    def _shut(self, fds: set[int], pg: Any) -> None:
        if pg is not None:
            try:
                pg.abort()  # NCCL: its pending kernels end with an error
            except Exception:
                pass
        for fd in fds:
            try:
                s = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                s.getpeername()  # a connection to a peer; never the listener (gloo aborts the process)
                s.shutdown(socket.SHUT_RDWR)  # the blocked read fails; the descriptor stays the group's
            except OSError:
                pass
            finally:
                s.detach()
        self.unblocked += 1
