"""torchrun's rendezvous backend ``spotvisor``: c10d's dynamic rendezvous that outlives its store.

Every node's torchrun agent keeps its rendezvous in the control node's store (a
``TCPStore``, :mod:`daemon.controlnode.rendezvous`). With torch's own ``c10d`` backend
the agent dies with that store: every monitor interval it asks the store how many nodes
wait (``num_nodes_waiting``), a store error there ends the agent, and the agent's end
kills its workers (``SimpleElasticAgent._invoke_run``, torch 2.13). Yet the running
workers never touch this store: their collectives go peer to peer, their group's own
store is on rank 0's node (below). Only membership changes need it, and those can wait
for it to come back.

``--rdzv-backend=spotvisor`` is the same rendezvous (c10d's
``DynamicRendezvousHandler``, every setting of ``--rdzv-conf`` as c10d reads it) with
the store's loss survivable:

- ``num_nodes_waiting`` and ``is_closed`` answer 0 / False while the store is out of
  reach (one log line when it goes, one when it is back): the agent keeps monitoring
  its workers, and nobody restarts;
- the store is reached again through a new client (a c10d ``TCPStore`` client never
  reconnects), tried at most every :data:`MAX_RETRY_S` seconds with a 1 s connect probe
  first, so no call blocks for the store's read timeout while it is down;
- a store that came back empty (a restarted process) gets this rendezvous' last state
  back (its round, its participants, their heartbeats refreshed): a node that arrives
  later is put on the wait list of the running round, as before the loss, rather than
  forming a round of its own next to the running one. The nodes' copies can differ (a
  node whose last write was lost with the store holds the round as it was before that
  write), so a node that finds an older state than its own there, by (round, complete),
  puts its own in its place, and no round completes until every live node has had time
  to do so (:attr:`ReconnectingBackend.settle_s`, the time c10d gives a node's heartbeat
  before it counts the node dead, plus the longest retry): a round completed just
  before the loss, whose workers train, is never completed a second time with other
  members by a node that did not see it complete (seen: a migration's first round, the
  store SIGKILLed mid-round; one node trained at world 1 while the other waited a
  minute for a rank 0 that was not in its round, and died);
- ``next_rendezvous`` (a worker failed, a node joins with ``job.grow: restart``) waits
  for the store up to the rendezvous' ``join_timeout``, then fails as c10d's would.
- the job's first round waits for the nodes the daemon admitted together at its start
  (``$SPOTVISOR_START_COHORT``, :func:`wait_for_cohort`): each node counts itself in the
  store and waits, at most until the daemon's ``rendezvous.start_wait_s`` has passed,
  until every one has (the last sets a key the others wait for), so all of them enter
  c10d's join together. c10d completes a round ``last_call_timeout`` after ``min_nodes``
  have joined, with whoever came by then; a torchrun that starts seconds later than the others (an import on a
  slower disk, a loaded machine) would find the job running without it, and its arrival
  restarts every worker, losing the steps since the start (seen under load: 17).
  Entering together is not enough: each join is a compare-and-set of the one state
  every participant also rewrites with its keep-alive (``keep_alive_interval``, 1 s by
  default), and on a loaded host a joiner lost that race for longer than the last call
  (seen: three nodes released within 30 ms, the third's four writes each beaten by a
  peer's, the round complete at two 5.6 s later; five of five loaded runs). So until the
  cohort's deadline this node does not complete the first round short of its cohort
  (:meth:`ReconnectingBackend.hold_first_round`): the write waits until the state
  changes (a joiner's write) and is then tried as it was, which fails against the newer
  state for c10d to read again.
- the store that moved (an HA takeover: the new leader serves it from its own control
  node; the agent writes the address to ``$SPOTVISOR_RDZV_ENDPOINT_FILE``) is followed:
  each call checks where it is now (:func:`trainer.store_retry.current_endpoint`) and a
  client of the old address is dropped for one of the new, which gets the last state
  as a store back empty does.

And the workers' group store (their ``MASTER_ADDR:MASTER_PORT``) is hosted by rank 0's
agent, a new one each round, bound to exactly this node's address (:func:`trainer.listen.
listen_socket`) on a port the kernel picked and that stays bound from then on; the
workers are its clients (``TORCHELASTIC_USE_AGENT_STORE=True``), and so is every
node's agent for what it does after the round (assigning its workers' ranks, the exit
barrier): once a round is formed, nothing of it needs the control node. c10d's own choices both
fail here: without sharing (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which every node
still runs with) rank 0's agent picks a port that is free *now* and closes it, and its
rank 0 worker binds it seconds later, by which time anything else on the node may have
taken it (the worker then fails ``EADDRINUSE``, seen twice in one run of the plain-script
demo under load); with sharing, one store server lives through every round, on every
interface, and a node that joins at a later round reads a previous round's keys
(pytorch#135712: torch's worker-side client assumes a new store per round, as here).

Registered with torchrun through the ``torchrun.handlers`` entry point
(``pyproject.toml``, :mod:`trainer.torchrun_plugin`; torch's
``torch/distributed/elastic/rendezvous/registry.py`` loads the group when
``torch.distributed.elastic.rendezvous`` is imported).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from base64 import b64decode
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousHandler, RendezvousInfo,
                                                  RendezvousParameters, RendezvousStoreInfo)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from trainer.contract import START_COHORT_ENV
from trainer.listen import address_toward, listen_socket
from trainer.store_retry import PROBE_S, current_endpoint, store_reachable

__all__ = ["BACKEND", "ReconnectingBackend", "SpotvisorRendezvousHandler", "create", "MAX_RETRY_S",
           "parse_cohort", "wait_for_cohort"]

log = logging.getLogger("spotvisor.rendezvous")

BACKEND = "spotvisor"
#: The longest wait between two tries to reach a store that is down (seconds); the
#: first retry comes after 0.5 s, each next one twice as late.
MAX_RETRY_S = 4.0
DEFAULT_PORT = 29400
#: How often a completion held for the start cohort reads the store (seconds).
HOLD_POLL_S = 0.2
# a round's key (c10d prefixes it with the run and the round): rank 0's group store, "host port"
_GROUP_STORE_KEY = "spotvisor_group_store"
# beside c10d's state key: no round completes before this time (epoch seconds), after a store back empty
_SETTLE_SUFFIX = ".spotvisor_settle_until"


def _order(state: bytes) -> tuple[int, bool] | None:
    """A c10d rendezvous state's place in time, (round, complete); None if unreadable."""
    try:
        s = pickle.loads(state)
        return int(s.round), bool(s.complete)
    except Exception:  # another torch's state
        return None


class ReconnectingBackend(RendezvousBackend):
    """c10d's ``C10dRendezvousBackend`` over a store client that is rebuilt after a loss.

    ``endpoint``: the store's ``(host, port)``; ``run_id``: the rendezvous; ``read_timeout_s``:
    each store call's bound once connected; ``settle_s``: after a store back empty, how
    long no round may complete (seconds; module docstring); ``clock``: monotonic seconds
    (tests); ``wall``: epoch seconds, which the nodes share as c10d's deadlines assume;
    ``sleep``: the wait for the settle time (tests).
    :meth:`get_state` / :meth:`set_state` raise ``RendezvousConnectionError`` at once
    while the store is down (as c10d's do when a call fails), and :attr:`store` is the
    client now in use. :attr:`generation` counts the clients built (1 after the first).
    Thread-safe: the agent's keep-alive timer and its monitor loop both call it.
    """

    def __init__(self, endpoint: tuple[str, int], run_id: str, *, read_timeout_s: float = 60.0,
                 settle_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.endpoint, self.run_id, self.read_timeout_s, self.settle_s = endpoint, run_id, read_timeout_s, settle_s
        self._at = endpoint  # where the client in use connects (the store may move: current_endpoint)
        self._clock, self._wall, self._sleep = clock, wall, sleep
        self._settle_key = f"torch.rendezvous.{run_id}{_SETTLE_SUFFIX}"
        self._lock = threading.RLock()
        self._inner: C10dRendezvousBackend | None = None
        self.store: dist.Store | None = None
        self.generation = 0
        self._last: bytes | None = None  # the newest state seen: what a store back empty gets again
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._retry_s = 0.5
        self._cohort: tuple[int, float, Any, float] | None = None  # hold_first_round
        self._holding = False  # told the operator of the hold (once per first round)

    @property
    def name(self) -> str:
        return "c10d"

    @property
    def down(self) -> bool:
        """The store was out of reach at the last call."""
        return self._down_since is not None

    def connect(self, *, first: bool = False) -> C10dRendezvousBackend:
        """The backend over a live client, built now if needed. ``first``: the agent's
        start, which waits up to the read timeout for the store, as c10d does.

        Raises:
            RendezvousConnectionError: the store is down (or a retry is not due yet).
        """
        with self._lock:
            at = current_endpoint(self.endpoint) or self.endpoint
            if self._inner is not None and at != self._at:  # an HA takeover: the new leader's store
                log.warning("rendezvous store moved from %s to %s:%s", self._where(), at[0], at[1])
                self._inner, self.store = None, None
            if self._inner is not None:
                return self._inner
            self._at = at
            now = self._clock()
            if not first:
                if now < self._retry_at:
                    raise RendezvousConnectionError(f"the rendezvous store {self._where()} is out of reach")
                if not store_reachable(at, PROBE_S):
                    self._failed(now)
                    raise RendezvousConnectionError(f"the rendezvous store {self._where()} is out of reach")
            try:
                store = dist.TCPStore(at[0], at[1], is_master=False, timeout=timedelta(seconds=self.read_timeout_s))
                inner = C10dRendezvousBackend(store, self.run_id)  # sets the state's key when absent
            except Exception as exc:
                self._failed(now)
                raise RendezvousConnectionError(f"the rendezvous store {self._where()} is out of reach") from exc
            self._inner, self.store = inner, store
            self.generation += 1
            if self._down_since is not None:
                log.warning("rendezvous store %s back after %.1f s", self._where(), now - self._down_since)
            self._down_since, self._retry_s = None, 0.5
            if self.generation > 1:
                self._republish(inner)
            return inner

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._call(lambda b: b.get_state())

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        return self._call(lambda b: b.set_state(self._settled(self._held(b, state, token), token), token))

    def hold_first_round(self, cohort: tuple[int, float] | None, node: Any = None, heartbeat_s: float = 1.0) -> None:
        """``cohort``, ``(nodes, until)``: while this node (c10d's ``_NodeDesc``, ``node``)
        joins the job's first round, a write of its that completes a round with fewer than
        ``nodes`` participants waits, up to ``until`` (unix seconds), for the state in the
        store to change, renewing this node's heartbeat in it every ``heartbeat_s``
        (c10d's ``keep_alive_interval``; :meth:`_held`). None: no longer (the round is
        formed)."""
        if cohort is None and self._holding and self._cohort is not None:
            log.info("the first round is formed")
        self._cohort = None if cohort is None else (cohort[0], cohort[1], node, heartbeat_s)
        self._holding = False

    def _held(self, inner: C10dRendezvousBackend, state: bytes, token: Token | None) -> bytes:
        """What to write for ``state``: a completion short of the start cohort
        (:meth:`hold_first_round`) first waits, reading the store every
        :data:`HOLD_POLL_S`: once another node has written (its token no longer
        ``token``: a joiner, or a peer's keep-alive) it is tried as it is and fails
        against the newer state, which c10d reads and decides on again; after a
        heartbeat interval with no write, the store's state with this node's heartbeat
        renewed is written instead (a waiting node is not taken for dead: c10d drops a
        participant silent for ``keep_alive_interval`` x ``keep_alive_max_attempt``), and
        c10d, finding its round still open and its last call past, completes it again;
        once the cohort's deadline has passed, it is written. Raises
        ``RendezvousConnectionError`` when the store fails."""
        if self._cohort is None or (round_ := _completes(state, token)) is None:
            return state
        nodes, until, node, heartbeat_s = self._cohort
        mine = pickle.loads(state)  # this torch's (_completes read it)
        if len(mine.participants) >= nodes:
            return state  # the whole cohort: complete it
        beat_at = self._clock() + heartbeat_s
        while (left := until - self._wall()) > 0:
            current = inner.get_state()
            if current is None or current[1] != token:
                return state  # a node wrote: this write fails against it, and c10d reads it
            if not self._holding:
                self._holding = True
                log.info("round %d complete with %d of the %d nodes started together: waiting up to %.0f s for "
                         "the others to join it", round_, len(mine.participants), nodes, left)
            if self._clock() >= beat_at:
                renewed = _renewed(current[0], node)
                if renewed is not None:
                    return renewed
            self._sleep(min(HOLD_POLL_S, left))
        if self._holding:
            log.warning("%d of the %d nodes started together joined the first round by its deadline: it goes on "
                        "without the others (they join it later)", len(mine.participants), nodes)
            self._holding = False
        return state

    def _settled(self, state: bytes, token: Token | None) -> bytes:
        """``state``, once it may be written: a write that completes a round (the state it
        replaces, ``token``'s, had that round open) waits until the settle time a store back
        empty was given (at most ``settle_s``), and is then tried as it is, against the same
        token: if a node put a newer copy back meanwhile, the compare-and-set fails and
        c10d's join reads that copy. (Not written with the round held open instead: a round
        open with ``max_nodes`` participants takes one more, and then never completes.)
        Raises ``RendezvousConnectionError`` when the store fails."""
        if self.settle_s <= 0 or (round_ := _completes(state, token)) is None:
            return state
        if (until := self._settle_until()) is not None and (wait := until - self._wall()) > 0:
            log.info("rendezvous store %s came back empty: round %s completes in %.1f s, once every live node "
                     "has had the time to put its copy back", self._where(), round_, wait)
            self._sleep(min(wait, self.settle_s))
        return state

    def _settle_until(self) -> float | None:
        if not self._store_call(lambda st: st.check([self._settle_key])):
            return None
        try:
            return float(self._store_call(lambda st: st.get(self._settle_key)).decode())
        except ValueError:  # not ours: no settle time
            return None

    def _store_call(self, fn: Callable[[dist.Store], Any]) -> Any:
        """``fn(store)`` on the client in use; ``RendezvousConnectionError`` when it fails."""
        store = self.store
        if store is None:
            raise RendezvousConnectionError(f"the rendezvous store {self._where()} is out of reach")
        try:
            return fn(store)
        except (ValueError, RuntimeError) as exc:
            raise RendezvousConnectionError(f"the rendezvous store {self._where()} failed: {exc}") from exc

    def lost(self, exc: BaseException) -> None:
        """The client in use failed (a call outside this backend: the bootstrap store):
        the next call builds a new one."""
        with self._lock:
            if self._inner is not None:
                self._inner, self.store = None, None
                self._failed(self._clock(), exc)

    def _call(self, fn: Callable[[C10dRendezvousBackend], Any]) -> Any:
        inner = self.connect()
        try:
            result = fn(inner)
        except RendezvousConnectionError as exc:
            with self._lock:
                if self._inner is inner:
                    self._inner, self.store = None, None
                    self._failed(self._clock(), exc)
            raise
        if result is not None:
            self._last = result[0]
        return result

    def _failed(self, now: float, exc: BaseException | None = None) -> None:
        if self._down_since is None:
            self._down_since = now
            log.warning("rendezvous store %s out of reach (%s): the workers train on; membership changes wait "
                        "for it", self._where(), (str(exc).splitlines() or ["no answer"])[0][:200] if exc else
                        "no answer")
        self._retry_at = now + self._retry_s
        self._retry_s = min(self._retry_s * 2, MAX_RETRY_S)

    def _republish(self, inner: C10dRendezvousBackend) -> None:
        """A new client: when the store is empty (a restarted process) or holds an older
        state than the last this node saw (by :func:`_order`: another node put its older
        copy back first), put this node's in its place, every heartbeat renewed to now
        (the nodes lost meanwhile miss their next ones and are dropped as c10d drops any
        dead node), after the settle time (:meth:`_settled`). Compare-and-set: of two
        copies the newer stays."""
        if self._last is None:
            return
        try:
            state = pickle.loads(self._last)
            now = datetime.now(timezone.utc)
            for node in list(state.last_heartbeats):
                state.last_heartbeats[node] = now
            data = pickle.dumps(state)
        except Exception:  # another torch's state: re-published as it was
            state, data = None, self._last
        mine = _order(self._last)
        for _ in range(3):  # a copy that lands between the read and the write is read again
            current = inner.get_state()
            if current is not None and not (
                    mine is not None and (theirs := _order(current[0])) is not None and mine > theirs):
                return  # the store kept its state (a network blip), or holds one as new as ours
            if self.settle_s > 0:  # first: a round completed between the two writes would be missed
                self._store_call(lambda st: st.set(self._settle_key, f"{self._wall() + self.settle_s:.3f}"))
            result = inner.set_state(data, current[1] if current is not None else None)
            if result is not None and result[2]:
                log.warning("rendezvous store %s %s: re-published round %s of rendezvous %s", self._where(),
                            "was empty" if current is None else "held an older state",
                            getattr(state, "round", "?"), self.run_id)
                return

    def _where(self) -> str:
        return f"{self._at[0]}:{self._at[1]}"


def _completes(state: bytes, token: Token | None) -> int | None:
    """The round that writing ``state`` over ``token``'s state completes; None when it
    completes none: not complete (a join, a keep-alive), complete already in ``token``'s
    state (a keep-alive of a running round), or another torch's state."""
    mine = _order(state)
    if mine is None or not mine[1]:
        return None
    if isinstance(token, bytes) and _order(b64decode(token)) == mine:
        return None
    return mine[0]


def _renewed(state: bytes, node: Any) -> bytes | None:
    """c10d's ``state`` with ``node``'s heartbeat set to now; None when ``node`` is not a
    participant there (or the state is not this torch's)."""
    try:
        s = pickle.loads(state)
        if node not in s.participants:
            return None
        s.last_heartbeats[node] = datetime.now(timezone.utc)
        return pickle.dumps(s)
    except Exception:  # another torch's state
        return None


def parse_cohort(raw: str | None) -> tuple[int, float] | None:
    """``$SPOTVISOR_START_COHORT`` (``N@UNTIL``) as ``(N, until)``; None when absent or malformed."""
    nodes, _, until = (raw or "").partition("@")
    try:
        parsed = int(nodes), float(until)
    except ValueError:
        return None
    return parsed if parsed[0] > 1 and parsed[1] > 0 else None


def wait_for_cohort(store: dist.Store, run_id: str, nodes: int, until: float, *,
                    clock: Callable[[], float] = time.time) -> int:
    """Count this node in the job's start cohort (``spotvisor/<run_id>/start_cohort`` in the
    rendezvous store, an ``add``) and wait until ``nodes`` have counted themselves, or until
    ``until`` (unix seconds) has passed. The node that completes the count sets
    ``.../start_cohort_full``, which the others wait for (``TCPStore.wait``: no polling).
    Returns the count seen last. A store error ends the wait (c10d's join then meets the
    store's loss as usual): the cohort only shortens the start, it is never needed to
    form a round."""
    key = f"spotvisor/{run_id}/start_cohort"
    full = f"{key}_full"
    try:
        count = store.add(key, 1)
        if count >= nodes:
            store.set(full, str(count))
            return count
        left = until - clock()
        if left <= 0:
            return count
        log.info("waiting for the nodes started with this one: %d of %d here (at most %.0f s)", count, nodes, left)
        try:
            store.wait([full], timedelta(seconds=left))
            return nodes
        except dist.DistStoreError:  # the deadline: go on with whoever came
            count = store.add(key, 0)
    except (dist.DistError, RuntimeError) as exc:  # the store out of reach: c10d's join deals with it
        log.warning("the start cohort could not be counted (%s): joining the rendezvous now",
                    (str(exc).splitlines() or ["no answer"])[0][:200])
        return 0
    log.warning("%d of the %d nodes started together arrived in time: the first round goes on without "
                "the others (they join it later)", count, nodes)
    return count


class SpotvisorRendezvousHandler(RendezvousHandler):
    """c10d's ``DynamicRendezvousHandler`` (``inner``) over a :class:`ReconnectingBackend`;
    see the module's docstring for what changes. ``join_timeout_s``: how long
    :meth:`next_rendezvous` waits for a store that is down."""

    def __init__(self, inner: Any, backend: ReconnectingBackend, *, join_timeout_s: float,
                 local_addr: str, cohort: tuple[int, float] | None = None) -> None:
        self._inner, self._backend, self._join_timeout_s = inner, backend, join_timeout_s
        self._cohort = cohort  # (nodes, until) before the first round only (wait_for_cohort)
        self._generation = backend.generation
        self._local_addr = local_addr
        # this round's group store: the server while this node holds rank 0, else a client of rank 0's
        self._group_store: dist.TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """True: the workers' group store is this agent's (:meth:`_round_group_store`)."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """c10d's next round, once the store can be reached (up to ``join_timeout_s``).

        Raises:
            RendezvousConnectionError: the store stayed out of reach that long.
            (the rest as c10d's ``next_rendezvous``)
        """
        deadline = time.monotonic() + self._join_timeout_s
        while True:
            try:
                self._backend.connect()
                self._follow_store()
                cohort, self._cohort = self._cohort, None
                if cohort is not None and self._backend.store is not None:
                    wait_for_cohort(self._backend.store, self._backend.run_id, *cohort)
                    # c10d's own: this node in the rendezvous' state, and its keep-alive interval
                    self._backend.hold_first_round(cohort, getattr(self._inner, "_this_node", None),
                                                   self._inner.settings.keep_alive_interval.total_seconds())
                try:
                    info = self._inner.next_rendezvous()
                finally:
                    self._backend.hold_first_round(None)
                return self._round_group_store(info)
            except (RendezvousConnectionError, dist.DistNetworkError) as exc:
                self._backend.lost(exc)
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"the rendezvous store stayed out of reach for {self._join_timeout_s:.0f} s") from exc
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _round_group_store(self, info: RendezvousInfo) -> RendezvousInfo:
        """``info`` with the workers' group store of this round: on rank 0 a new
        ``TCPStore`` server, listening on this node's address and a port the kernel picks
        (the previous round's server closed first: its workers are stopped by now), its
        ``host port`` put in the round's own keys of the rendezvous store; on the other
        nodes read from there (waiting for rank 0 up to the store's read timeout, as
        c10d's own ``RendezvousStoreInfo.build`` does).

        The round's store handed to torchrun is that group store too, not the rendezvous
        store: what the agent does with it from here on (its workers' ranks assigned
        through it, ``SimpleElasticAgent._assign_worker_ranks``; the exit barrier when
        they end) then needs only rank 0's node, not the control node, whose store may be
        SIGKILLed at that very moment (a leader's control node lost during a migration's
        first round: the agent died in ``multi_get`` and took its node out of the job).
        Those keys (``torchelastic/...``) never meet the workers' (``/worker/attempt_N/...``,
        torch's prefix for an agent's store).

        Raises:
            OSError: rank 0 cannot listen on its address.
            torch.distributed.DistStoreError: rank 0 did not say within the read timeout.
        """
        self._group_store = None  # the previous round's server (or client) goes with its last reference
        timeout = timedelta(seconds=self._backend.read_timeout_s)
        if info.rank == 0:
            sock = listen_socket(self._local_addr, 0)
            host, port = sock.getsockname()[:2]
            # c10d owns the descriptor from here on (it closes it with the store)
            self._group_store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                              master_listen_fd=sock.detach(), timeout=timeout)
            info.store.set(_GROUP_STORE_KEY, f"{host} {port}")
        host, port = info.store.get(_GROUP_STORE_KEY).decode().rsplit(" ", 1)
        if info.rank != 0:
            self._group_store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        return RendezvousInfo(self._group_store, info.rank, info.world_size, RendezvousStoreInfo(host, int(port)))

    def is_closed(self) -> bool:
        try:
            return self._inner.is_closed()
        except RendezvousConnectionError:
            return False  # unknown while the store is down: keep running

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Nodes on the wait list; 0 while the store is out of reach (nobody restarts for it)."""
        try:
            return self._inner.num_nodes_waiting()
        except RendezvousConnectionError:
            return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._group_store = None
        try:
            return self._inner.shutdown()
        except RendezvousConnectionError:
            return False

    def _follow_store(self) -> None:
        """After a new client: c10d's handler hands its store to the next round (the
        workers' bootstrap address goes through it), so give it the live one."""
        if self._backend.generation != self._generation and self._backend.store is not None:
            self._inner._store = self._backend.store  # torch 2.13: DynamicRendezvousHandler._store
            self._generation = self._backend.generation


class _QuietWhileDown(logging.Filter):
    """Drops c10d's keep-alive warning (one a second per node) while ``backend`` knows the
    store is down: its own line said so once, and says when it is back."""

    def __init__(self, backend: ReconnectingBackend) -> None:
        super().__init__()
        self._backend = backend

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self._backend.down and "keep-alive heartbeat" in record.getMessage())


def create(params: RendezvousParameters) -> SpotvisorRendezvousHandler:
    """The handler for torchrun's ``--rdzv-backend=spotvisor``: ``params.endpoint`` is the
    store (``HOST:PORT``, default port 29400; ``is_host`` is ignored: the store is never
    hosted by an agent), ``read_timeout`` (default 60 s) bounds each store call, and
    everything else is c10d's (``join_timeout``, ``last_call_timeout``, ``keep_alive_*``).
    Without ``--local-addr`` this node's address is the one on its route to the store
    (:func:`trainer.listen.address_toward`: its address on the job's network), not its
    host name: the workers' ``MASTER_ADDR`` when it holds rank 0, where their group
    store binds (c10d's default, ``socket.getfqdn()``, can resolve to 127.0.1.1 or to a
    public name).

    Raises:
        RendezvousConnectionError: the store cannot be reached within the read timeout.
    """
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    if not params.local_addr:  # torchrun's --local-addr, else this node's address on the job's network
        params.local_addr = address_toward(host, port)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    # c10d counts a node dead whose heartbeat is older than interval x attempts; a live
    # node reaches a store back within that, or its next retry (MAX_RETRY_S)
    settle = (params.get_as_int("keep_alive_interval", 5) or 5) * (params.get_as_int("keep_alive_max_attempt", 3)
                                                                   or 3) + MAX_RETRY_S
    backend = ReconnectingBackend((host, port), params.run_id, read_timeout_s=float(read_timeout),
                                  settle_s=float(settle))
    backend.connect(first=True)
    inner = create_handler(backend.store, backend, params)
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").addFilter(_QuietWhileDown(backend))
    join_timeout = params.get_as_int("join_timeout", 600) or 600
    return SpotvisorRendezvousHandler(inner, backend, join_timeout_s=float(join_timeout),
                                      local_addr=params.local_addr,
                                      cohort=parse_cohort(os.environ.get(START_COHORT_ENV)))


