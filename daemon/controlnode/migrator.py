"""Whole-job migration at the edge: reports what happens to :func:`daemon.control.migration.step`
and carries out what it returns.

Each reconcile pass calls :meth:`Migrator.check`: with no move in flight it keeps how
long the job's domain has been starved and asks the recovery policy
(:meth:`~daemon.control.policies.RecoveryPolicy.migrate`, by default
:func:`~daemon.control.migration.decide`) whether to move; with one in flight it looks at
what the move waits for (the target's nodes, the job's commit, the copy, a step in the
target) and, when it happened, reports it as a typed message (``Booted``,
``SourceLeft``, ``CopyDone``, ...). The pure step moves the phase on (booting →
committing → copying → starting → done, its table refusing any other change) and says
what to do: drain the source, start the copy, reset the job's start, record
``migration_started``, ``checkpoint_replicated``, ``migration_completed`` or
``migration_failed``, release nodes. The job's domain and the move in flight are kept in
the store, so ``spotctl status`` and a restarted daemon know where the job is.

The copy runs in a worker thread (:func:`copy_checkpoint`: blocking SDK calls and
hashing, never on the event loop), as one task the supervisor owns, whose result is the
message (``CopyDone`` or ``CopyFailed``).

A daemon restarted during a move before the switch gives it up
(``migration_failed``, ``daemon_restarted``): the job stays in its domain and the
target's nodes are released; after the switch the job is in the target domain and the
move is complete but for releasing the old domain's nodes, which the next pass does.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import structlog

from daemon.config import Config
from daemon.control import migration
from daemon.control.actions import Action, Drain, PoolState
from daemon.control.availability import Availability
from daemon.control.deadline import in_markets, narrow
from daemon.control.lifecycle import ADMITTED
from daemon.control.homezone import HomeDecision
from daemon.control.migration import Migration, MigrationState, Phase
from daemon.control.policies import RecoveryPolicy
from daemon.controlnode.capacity_record import SEEN, CapacityRecord
from daemon.controlnode.core import Core
from daemon.controlnode.fleet import Fleet
from daemon.controlnode.market_memory import MarketMemory
from daemon.controlnode.placement import Placement
from daemon.model import Event, EventKind, Node
from daemon.state_dir import private_dir

__all__ = ["Migrator", "copy_checkpoint"]

log = structlog.get_logger("spotvisor.daemon")

# events that count against a placement domain when choosing where a move goes
_LOSSES = frozenset({EventKind.INTERRUPTION_NOTICE.value, EventKind.NODE_LOST.value,
                     EventKind.NODE_LAUNCH_FAILED.value})
_PREEMPTION_WINDOW_S = 3600.0  # recent preemptions / capacity failures per domain: this window (seconds)
_HELD = frozenset({Phase.COMMITTING, Phase.COPYING, Phase.STARTING})  # the source's nodes are kept
_WAKES = frozenset({Phase.BOOTING, Phase.COMMITTING, Phase.STARTING})  # a pass at once: the pool changes

_Copied = migration.CopyDone | migration.CopyFailed


class Migrator:
    """Moves the whole job between placement domains (module docstring).

    ``fleet``: the :class:`~daemon.controlnode.fleet.Fleet` (offers, prices, capacity
    history); ``drain``: makes a node leave the job cleanly (``Operator.drain``);
    ``policy``: the RecoveryPolicy whose ``migrate()`` decides when and where."""

    def __init__(self, core: Core, *, fleet: Fleet, drain: Callable[[Node, str], None],
                 policy: RecoveryPolicy) -> None:
        self.core, self.fleet, self.policy = core, fleet, policy
        self._drain = drain
        cfg = core.config
        self.domains = cfg.domains_resolved()
        # which domain a node is in, which offers to buy
        self.placement = Placement(core, usable_offers=fleet.usable_offers, building=self._building)
        self.state = MigrationState(domain=self.domains[0].name)
        self._copy: asyncio.Task[_Copied] | None = None  # the move's checkpoint copy (its result: the message)
        self._losses: list[tuple[float, str]] = []  # (time, domain) of preemptions and capacity failures
        reads = policy.reads_availability and len(self.domains) > 1
        fleet.probe_stock = reads  # asked with the prices; the record, with the other pools' past
        self.capacity = CapacityRecord(core, memory=MarketMemory.for_config(cfg) if reads else None)
        self._overdue_said: str | None = None  # the move whose overdue start was logged (once a move)
        self.decision: HomeDecision | None = None  # the policy's word on where the job is (spotctl status)
        self._pending: list[Action] = []  # releases decided at restore, carried out by the first pass
        m = cfg.migration
        self.plan = migration.Plan(patience_s=m.patience_s, boot_timeout_s=m.boot_timeout_s,
                                   min_saving_fraction=m.min_saving_fraction, payback_h=m.payback_h,
                                   cooldown_s=m.cooldown_s)

    # -- store ----------------------------------------------------------------------------
    def restore(self) -> None:
        """The job's domain and the move in flight from the store. A move before its switch
        is given up (module docstring); the first pass releases what that needs."""
        core = self.core
        stored = core.store.get("domain")
        domain = stored if isinstance(stored, str) and stored in {d.name for d in self.domains} else self.domain
        self.state = MigrationState(domain, completed=int(core.store.get("migrations_completed", 0) or 0),
                                    failed=int(core.store.get("migrations_failed", 0) or 0))
        self.capacity.restore(core.store.events(kinds=sorted(SEEN)))
        if self.capacity.memory is not None:
            core.spawn(self.capacity.share(), "market")
        raw = core.store.get("migration")
        if not isinstance(raw, dict):
            return
        try:
            m = Migration.from_dict(raw)
        except (TypeError, ValueError):
            core.store.set("migration", None)
            return
        self.state = replace(self.state, migration=m)
        if m.phase is not Phase.STARTING:
            self._pending = self._apply(migration.GiveUp("daemon_restarted"), core.clock(), core.state())

    # -- what the rest of the supervisor asks ----------------------------------------------
    @property
    def domain(self) -> str:
        """The placement domain the job runs in."""
        return self.state.domain

    @property
    def move(self) -> Migration | None:
        """The move in flight (None: none)."""
        return self.state.migration

    @property
    def starved_since(self) -> float | None:
        """Since when (unix s) the job's domain has been starved (:func:`~daemon.control.migration.starved_since`)."""
        return self.state.starved_since

    @property
    def build_domain(self) -> str:
        """The domain the planner builds the pool in: the target's during a move."""
        return self.move.target if self.move is not None else self.domain

    def _building(self) -> tuple[str, frozenset[str] | None]:
        """For :class:`Placement`: the build domain and a move's markets (``spot_elsewhere``)."""
        return self.build_domain, None if self.move is None else self.move.markets

    def held(self, node_domain: str) -> bool:
        """A node of this domain is kept until the move is done (not released as drained)."""
        m = self.move
        return m is not None and node_domain == m.source and m.phase in _HELD

    def on_event(self, ev: Event) -> None:
        """A listener: a notice, a lost node or a failed launch weighs against its domain
        when choosing where a move goes; a spot node launched, or one noticed, lost or
        refused for capacity, is what the availability record is made of."""
        if ev.kind in _LOSSES and ev.node is not None and ev.node in self.core.nodes:
            self._losses.append((ev.time, self.core.domain_of(self.core.nodes[ev.node])))
        self.capacity.seen(ev)

    @property
    def availability(self) -> Availability:
        """What this pool's own events and probes say of each domain's spot capacity."""
        return self.capacity.own

    def status(self) -> dict[str, Any]:
        st, m = self.state, self.move
        return {"domain": st.domain, "migrations": st.completed, "migrations_failed": st.failed,
                "starved_since": st.starved_since, "deadline": self.placement.status(self.core.clock()),
                "placement": None if self.decision is None else self.decision.to_dict(),
                # other pools whose record the decisions read (daemon.market_dir; None: no directory)
                "market_past": None if self.capacity.memory is None else len(self.capacity.past),
                "migration": None if m is None else {"id": m.id, "from": m.source, "to": m.target,
                                                     "phase": m.phase.value, "reason": m.reason,
                                                     "started_at": m.started_at}}

    # -- the pass -----------------------------------------------------------------------------
    def check(self, now: float) -> list[Action]:
        """One reconcile pass's migration step; returns actions: releases of a move's nodes,
        of any node outside both the job's domain and a move's
        (:func:`~daemon.control.migration.strays`), and the policy's actions for the
        markets it allows now (:meth:`Placement.check_markets`)."""
        pending, self._pending = self._pending, []
        if len(self.domains) < 2 and not pending:  # one domain: nothing moves, no node is outside it
            return self.placement.check_markets(now)
        s = self.core.state()
        out = pending or self._step(now, s)
        keep = {self.domain, self.build_domain} | ({self.move.source} if self.move is not None else set())
        return out + migration.strays(s, keep, but={a.node_id for a in out}) + self.placement.check_markets(now)

    def _step(self, now: float, s: PoolState) -> list[Action]:
        if not self.core.config.migration.enabled:
            return []
        msg = self._observe(now, s)
        return [] if msg is None else self._apply(msg, now, s)

    def _apply(self, msg: migration.Message, now: float, s: PoolState) -> list[Action]:
        """Step the move with ``msg``; carry out its effects; keep what changed. Returns the
        releases, for the supervisor to carry out."""
        old = self.state
        self.state, effects = migration.step(old, msg, s=s, now=now)
        out: list[Action] = []
        for e in effects:
            if isinstance(e, migration.Record):
                self._record(e)
            elif isinstance(e, Drain):
                self._drain(self.core.nodes[e.node_id], e.reason)
            elif isinstance(e, migration.StartCopy):
                self._start_copy(e)
            elif isinstance(e, migration.ResetStart):
                self.core.act(e)  # the supervisor applies it (actuator)
            else:
                out.append(e)  # Terminate: a provider call, the supervisor's
        self._keep(old)
        if (self.move is not None and self.move.phase in _WAKES) or self.state.failed > old.failed:
            self.core.wake()
        return out

    def _record(self, e: migration.Record) -> None:
        self.core.record(EventKind(e.kind), None, **e.data)
        if e.kind == EventKind.MIGRATION_STARTED.value:
            log.info("migration_started", source=e.data["source"], target=e.data["target"], reason=e.data["reason"])
        elif e.kind == EventKind.MIGRATION_FAILED.value:
            log.warning("migration_failed", migration=e.data["migration"], reason=e.data["reason"])

    def _keep(self, old: MigrationState) -> None:
        """Write to the store what the step changed."""
        st, store = self.state, self.core.store
        if st.migration is None or st.migration.phase is not Phase.COPYING:
            self._copy = None  # (a copy still running for a move given up is not waited for)
        if st.domain != old.domain:
            store.set("domain", st.domain)
            log.info("job_domain_changed", pool=self.core.pool, domain=st.domain)
        if st.completed != old.completed:
            store.set("migrations_completed", st.completed)
        if st.failed != old.failed:
            store.set("migrations_failed", st.failed)
        if st.migration != old.migration:
            store.set("migration", None if st.migration is None else st.migration.to_dict())

    # -- what a move waits for, as a message ---------------------------------------------------
    def _observe(self, now: float, s: PoolState) -> migration.Message | None:
        core, m = self.core, self.move
        if m is None:
            return self._maybe_start(now, s)
        if m.phase is not Phase.STARTING and (core.paused or core.job.state.is_terminal()):
            # the operator paused (or the job ended) before the switch: nothing to move any more
            return migration.GiveUp("paused" if core.paused else f"job_{core.job.state.value}")
        if m.phase is Phase.BOOTING:
            return self._booting(now, s, m)
        if m.phase is Phase.COMMITTING:
            return self._committing(now, s, m)
        if m.phase is Phase.COPYING:
            return self._copied(m)
        j = core.job
        if migration.trained_there(m, j.state, j.step, j.resumed_at):
            return migration.TrainedThere(j.step)
        if migration.start_overdue(m, now, self.plan.boot_timeout_s) and self._overdue_said != m.id:
            self._overdue_said = m.id  # once a move: the stall rules act from here (holds_job)
            log.warning("migration_slow_start", migration=m.id, commit_step=m.commit_step, then="the stall rules")
        return None

    def holds_job(self) -> bool:
        """A move in flight answers for the job (no stall rules), until it waits past its
        deadline for a step in the target (:func:`daemon.control.migration.start_overdue`)."""
        m = self.move
        return m is not None and not migration.start_overdue(m, self.core.clock(), self.plan.boot_timeout_s)

    def _views(self, now: float, markets: frozenset[str] | None = None) -> list[migration.DomainView]:
        self._losses = [(t, d) for t, d in self._losses if now - t < _PREEMPTION_WINDOW_S]
        # the markets the policy allows now: a domain is starved when its spot offers
        # are out while only spot is allowed, whatever on-demand offer it has
        allowed = narrow(self.placement.allowed, markets)
        out = []
        for d in self.domains:
            losses = sum(1 for _, name in self._losses if name == d.name)
            offers = tuple(in_markets((self.fleet.offer(i) for i in d.offers if i not in self.fleet.unusable),
                                      allowed))
            out.append(migration.DomainView(d.name, offers, egress_usd_per_gb=d.egress_usd_per_gb,
                                            preemptions=losses))
        return out

    def _maybe_start(self, now: float, s: PoolState) -> migration.Begin | None:
        core, st = self.core, self.state
        self.capacity.read_stock(self.fleet.stock, [(d.name, d.offers) for d in self.domains])
        record = self.capacity.view(now)  # with the other pools' past of the domains this one has not seen
        views = self._views(now)
        history = self.fleet.history(now)
        here = next(v for v in views if v.name == st.domain)
        since = migration.starved_since(st.starved_since, s, here, history, now=now)
        self.state = st = replace(st, starved_since=since)
        gpus = max(1, sum(n.gpus for n in s.nodes if n.state in ADMITTED and n.domain == st.domain))
        progress = self.placement.progress(now)
        decision = self.policy.placement(s, views, st.domain, history, now=now, plan=self.plan, starved_since=since,
                                         checkpoint_bytes=core.job.last_commit_bytes, gpus=gpus, progress=progress,
                                         availability=record, last_move_ended_at=st.last_ended_at,
                                         failed_moves=st.failed_moves)
        if decision is not None and decision.action == "wait" and (
                self.decision is None or self.decision.action != "wait"):
            core.record(EventKind.PLACEMENT_WAITING, None, **decision.to_dict())  # once per outage: the feed's
        self.decision = decision
        move = self.policy.migrate(s, views, st.domain, history, now=now, plan=self.plan, starved_since=since,
                                   checkpoint_bytes=core.job.last_commit_bytes, last_move_ended_at=st.last_ended_at,
                                   gpus=gpus, failed_moves=st.failed_moves, progress=progress,
                                   availability=record)
        return None if move is None else migration.Begin(move, f"mig-{secrets.token_hex(4)}", core.job.step)

    def _booting(self, now: float, s: PoolState, m: Migration) -> migration.Message | None:
        cfg = self.core.config
        if migration.ready_for_commit(s, m.target, valid_world_sizes=frozenset(cfg.valid_world_sizes()),
                                      min_nodes=cfg.pool.min_nodes):
            return migration.Booted(self.core.store.last_seq())
        if now - m.started_at > self.plan.boot_timeout_s:
            return migration.BootFailed("boot_timeout")
        target = next(v for v in self._views(now, m.markets) if v.name == m.target)
        if migration.target_out(s, target, self.fleet.history(now), now=now):
            return migration.BootFailed("target_out_of_capacity")
        return None

    def _committing(self, now: float, s: PoolState, m: Migration) -> migration.SourceLeft | None:
        core = self.core
        # (a trainer's exit can be reported before its commit line: the commit is read too)
        committed = bool(core.store.events(since=m.drain_seq, kinds=[EventKind.CHECKPOINT_COMMITTED.value]))
        if not migration.source_left(s, m, committed=committed, last_commit_step=core.job.last_commit_step,
                                     job_step=core.job.step, waited_s=now - (m.booted_at or now),
                                     rejoin_timeout_s=core.config.daemon.rejoin_timeout_s):
            return None
        return migration.SourceLeft(core.job.last_commit_step)

    def _copied(self, m: Migration) -> _Copied | None:
        """The copy's result once it is done (None: still copying)."""
        if self._copy is None and m.commit_step is not None:  # (a restored move never gets here: see restore)
            self._start_copy(migration.StartCopy(m.id, m.source, m.target, m.commit_step))
        return self._copy.result() if self._copy is not None and self._copy.done() else None

    def _start_copy(self, e: migration.StartCopy) -> None:
        cfg = self.core.config
        egress = cfg.domain(e.source).egress_usd_per_gb

        async def copy() -> _Copied:
            try:
                result = await asyncio.to_thread(copy_checkpoint, cfg, e.source, e.target, e.step)
            except Exception as exc:  # a store or verification failure: the move fails, the job stays
                return migration.CopyFailed(f"{type(exc).__name__}: {exc}"[:300])
            finally:
                self.core.wake()
            return migration.CopyDone(result, egress)

        self._copy = self.core.spawn(copy(), f"replicate-{e.migration}")


def copy_checkpoint(cfg: Config, source: str, target: str, step: int) -> dict[str, Any]:
    """Copy the job's newest commit, at least ``step``, from domain ``source``'s checkpoint
    store to ``target``'s, every shard verified against the manifest
    (:func:`trainer.replicate.replicate`); a retried move resumes the copy from its work dir
    under the state dir. The store is read for a commit newer than the recorded ``step``:
    one whose report died with its node (released by a move given up at a takeover) is
    still the job's, as the trainer itself would resume from it, and it verifies or it does
    not count. Blocking (SDK calls, hashing): run it in a worker thread. Returns the copy's
    figures: ``step`` (the one copied), ``bytes``, ``bytes_copied``, ``shards_copied``,
    ``shards_skipped``, ``copy_s``. Raises what the stores and the verification raise (the
    move then fails)."""
    from trainer.checkpoint import latest_committed, open_store
    from trainer.replicate import open_store_for, replicate

    src, dst = cfg.domain(source), cfg.domain(target)
    state_dir = Path(cfg.daemon.state_path())

    def uri(u: str) -> str:
        return u.replace("{state_dir}", str(state_dir))

    newest = latest_committed(open_store(uri(src.checkpoint_uri), s3_endpoint_url=src.s3_endpoint_url,
                                         oss_endpoint=src.oss_endpoint))
    if newest is not None and newest.step > step:
        log.warning("migration_copies_unrecorded_commit", source=source, recorded_step=step, step=newest.step)
        step = newest.step
    work = state_dir / "replicate" / f"{target}-step-{step}"
    private_dir(work, root=state_dir)  # a link planted in the state dir is refused, not followed
    # open_store_for: an OSS store keeps oss2's part-level resume records in the work dir
    a = open_store_for(uri(src.checkpoint_uri), work, s3_endpoint_url=src.s3_endpoint_url, oss_endpoint=src.oss_endpoint)
    b = open_store_for(uri(dst.checkpoint_uri), work, s3_endpoint_url=dst.s3_endpoint_url, oss_endpoint=dst.oss_endpoint)
    r = replicate(a, b, step=step, work_dir=work)
    return {"step": r.step, "bytes": r.bytes_total, "bytes_copied": r.bytes_copied,
            "shards_copied": r.shards_copied, "shards_skipped": r.shards_skipped, "copy_s": round(r.seconds, 3)}
