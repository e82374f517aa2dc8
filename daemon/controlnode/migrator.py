"""Whole-job migration at the edge: carries out :mod:`daemon.control.migration`'s decisions.

Each reconcile pass calls :meth:`Migrator.check`: with no move in flight it keeps how
long the job's domain has been starved and asks the recovery policy
(:meth:`~daemon.control.policies.RecoveryPolicy.migrate`, by default
:func:`~daemon.control.migration.decide`) whether to move; with one in flight it takes
the next step (booting → committing → copying → starting → done, the pure module's
docstring). It records
``migration_started``, ``checkpoint_replicated``, ``migration_completed`` and
``migration_failed``, and keeps the job's domain and the move in flight in the store,
so ``spotctl status`` and a restarted daemon know where the job is.

The copy runs in a worker thread (:func:`trainer.replicate.replicate`: blocking SDK
calls and hashing, never on the event loop), as a task the supervisor owns.

A daemon restarted during a move before the switch gives it up
(``migration_failed``, ``daemon_restarted``): the job stays in its domain and the
target's nodes are released; after the switch the job is in the target domain and the
move is complete but for releasing the old domain's nodes, which the next pass does.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from daemon.control import migration as decide
from daemon.control.actions import Action, Terminate
from daemon.control.deadline import in_markets, narrow
from daemon.control.lifecycle import ADMITTED, JobState, NodeState
from daemon.control.migration import Phase
from daemon.controlnode.core import Core
from daemon.controlnode.placement import Placement
from daemon.model import Event, EventKind
from daemon.state_dir import private_dir

__all__ = ["Migrator", "Move"]

log = structlog.get_logger("spotvisor.daemon")

# events that count against a placement domain when choosing where a move goes
_LOSSES = frozenset({EventKind.INTERRUPTION_NOTICE.value, EventKind.NODE_LOST.value,
                     EventKind.NODE_LAUNCH_FAILED.value})
_PREEMPTION_WINDOW_S = 3600.0  # recent preemptions / capacity failures per domain: this window (seconds)


@dataclass
class Move:
    """A move in flight (kept in the store as a dict). Times are unix seconds."""

    id: str
    source: str
    target: str
    reason: str
    started_at: float
    phase: str = Phase.BOOTING.value
    why: dict[str, Any] = field(default_factory=dict)
    from_step: int | None = None  # the job's step at the decision
    booted_at: float | None = None  # the target had nodes for the job; the commit was asked
    drain_seq: int = 0  # the last event before the drain: the move's commit is recorded after it
    committed_at: float | None = None  # the job left the source; its newest commit is what moves
    commit_step: int | None = None
    replicated_at: float | None = None
    copy: dict[str, Any] = field(default_factory=dict)
    markets: list[str] | None = None  # the target's markets while in flight (None: the policy's)


class Migrator:
    """Moves the whole job between placement domains (module docstring)."""

    def __init__(self, core: Core, *, fleet: Any, drain: Any, policy: Any) -> None:
        self.core = core
        self.policy = policy  # the RecoveryPolicy whose migrate() decides when and where
        self.fleet = fleet
        self._drain = drain
        cfg = core.config
        self.domains = cfg.domains_resolved()
        self.placement = Placement(core, self, fleet)  # which domain a node is in, which offers to buy
        self.domain: str = self.domains[0].name  # where the job runs (kept in the store)
        self.move: Move | None = None
        self.starved_since: float | None = None
        self.last_ended_at: float | None = None  # the last completed move's end (the cooldown)
        self.failed_moves: dict[str, float] = {}  # target domain -> when a move there failed
        self.completed = 0
        self.failed = 0
        self._copy: asyncio.Task[Any] | None = None
        self._copy_result: dict[str, Any] | None = None
        self._copy_error: str | None = None
        self._losses: list[tuple[float, str]] = []  # (time, domain) of preemptions and capacity failures
        self._pending: list[Action] = []  # releases decided at restore, carried out by the first pass
        m = cfg.migration
        self.plan = decide.Plan(patience_s=m.patience_s, boot_timeout_s=m.boot_timeout_s,
                                min_saving_fraction=m.min_saving_fraction, payback_h=m.payback_h,
                                cooldown_s=m.cooldown_s)

    # -- store ----------------------------------------------------------------------------
    def restore(self) -> None:
        """The job's domain and the move in flight from the store. A move before its switch
        is given up (module docstring); the first pass releases what that needs."""
        core = self.core
        names = {d.name for d in self.domains}
        stored = core.store.get("domain")
        if isinstance(stored, str) and stored in names:
            self.domain = stored
        raw = core.store.get("migration")
        self.completed = int(core.store.get("migrations_completed", 0) or 0)
        self.failed = int(core.store.get("migrations_failed", 0) or 0)
        if not isinstance(raw, dict):
            return
        try:
            move = Move(**raw)
        except TypeError:
            core.store.set("migration", None)
            return
        self.move = move
        if move.phase in (Phase.BOOTING.value, Phase.COMMITTING.value, Phase.COPYING.value):
            self._pending = self._fail("daemon_restarted", core.clock())

    def _save(self) -> None:
        self.core.store.set("migration", None if self.move is None else asdict(self.move))

    # -- what the rest of the supervisor asks ----------------------------------------------
    @property
    def build_domain(self) -> str:
        """The domain the planner builds the pool in: the target's during a move."""
        return self.move.target if self.move is not None else self.domain

    def held(self, node_domain: str) -> bool:
        """A node of this domain is kept until the move is done (not released as drained)."""
        m = self.move
        return (m is not None and node_domain == m.source
                and m.phase in (Phase.COMMITTING.value, Phase.COPYING.value, Phase.STARTING.value))

    def on_event(self, ev: Event) -> None:
        """A listener: a notice, a lost node or a failed launch weighs against its domain
        when choosing where a move goes."""
        if ev.kind in _LOSSES and ev.node is not None and ev.node in self.core.nodes:
            self._losses.append((ev.time, self.core.domain_of(self.core.nodes[ev.node])))

    def status(self) -> dict[str, Any]:
        m = self.move
        return {"domain": self.domain, "migrations": self.completed, "migrations_failed": self.failed,
                "starved_since": self.starved_since, "deadline": self.placement.status(self.core.clock()),
                "migration": None if m is None else {"id": m.id, "from": m.source, "to": m.target,
                                                     "phase": m.phase, "reason": m.reason,
                                                     "started_at": m.started_at}}

    # -- the pass -----------------------------------------------------------------------------
    def check(self, now: float) -> list[Action]:
        """One reconcile pass's migration step; returns actions: releases of a move's nodes,
        of any node outside both the job's domain and a move's (:meth:`Placement.strays`),
        and the policy's actions for the markets it allows now (:meth:`Placement.check_markets`)."""
        out = self._step(now)
        return out + self.placement.strays(but={a.node_id for a in out}) + self.placement.check_markets(now)

    def _step(self, now: float) -> list[Action]:
        core = self.core
        if self._pending:
            pending, self._pending = self._pending, []
            return pending
        if len(self.domains) < 2 or not core.config.migration.enabled:
            return []
        if self.move is None:
            return self._maybe_start(now)
        if self.move.phase != Phase.STARTING.value and (core.paused or core.job.state.is_terminal()):
            # the operator paused (or the job ended) before the switch: nothing to move any more
            return self._fail("paused" if core.paused else f"job_{core.job.state.value}", now)
        phase = self.move.phase
        if phase == Phase.BOOTING.value:
            return self._booting(now)
        if phase == Phase.COMMITTING.value:
            return self._committing(now)
        if phase == Phase.COPYING.value:
            return self._copying(now)
        return self._starting(now)

    def build_markets(self) -> frozenset[str] | None:
        """The markets the planner buys from in :attr:`build_domain`: the policy's, narrowed
        by a move in flight that is built from some markets only (``spot_elsewhere``)."""
        return narrow(self.placement.allowed, None if self.move is None else self._markets(self.move.markets))

    @staticmethod
    def _markets(markets: list[str] | None) -> frozenset[str] | None:
        return None if markets is None else frozenset(markets)

    def _views(self, now: float, markets: list[str] | None = None) -> list[decide.DomainView]:
        self._losses = [(t, d) for t, d in self._losses if now - t < _PREEMPTION_WINDOW_S]
        out = []
        for d in self.domains:
            losses = sum(1 for _, name in self._losses if name == d.name)
            # the markets the policy allows now: a domain is starved when its spot offers
            # are out while only spot is allowed, whatever on-demand offer it has
            offers = tuple(in_markets((self.fleet.offer(i) for i in d.offers if i not in self.fleet.unusable),
                                      narrow(self.placement.allowed, self._markets(markets))))
            out.append(decide.DomainView(d.name, offers, egress_usd_per_gb=d.egress_usd_per_gb, preemptions=losses))
        return out

    def _maybe_start(self, now: float) -> list[Action]:
        core = self.core
        s = core.state()
        views = self._views(now)
        history = self.fleet.history(now)
        here = next(v for v in views if v.name == self.domain)
        self.starved_since = decide.starved_since(self.starved_since, s, here, history, now=now)
        gpus = max(1, sum(n.gpus for n in s.nodes if n.state in ADMITTED and n.domain == self.domain))
        move = self.policy.migrate(s, views, self.domain, history, now=now, plan=self.plan,
                                   starved_since=self.starved_since, checkpoint_bytes=core.job.last_commit_bytes,
                                   last_move_ended_at=self.last_ended_at, gpus=gpus,
                                   failed_moves=self.failed_moves)
        if move is None:
            return []
        self.move = Move(id=f"mig-{secrets.token_hex(4)}", source=move.source, target=move.target,
                         reason=move.reason, started_at=now, why=dict(move.why), from_step=core.job.step,
                         markets=None if move.markets is None else sorted(move.markets))
        self._save()
        core.record(EventKind.MIGRATION_STARTED, None, migration=self.move.id, source=move.source,
                    target=move.target, reason=move.reason, step=core.job.step, **dict(move.why))
        log.info("migration_started", source=move.source, target=move.target, reason=move.reason)
        core.wake()
        return []

    def _booting(self, now: float) -> list[Action]:
        core, m = self.core, self.move
        assert m is not None
        s = core.state()
        rules_valid = frozenset(core.config.valid_world_sizes())
        if decide.ready_for_commit(s, m.target, valid_world_sizes=rules_valid, min_nodes=core.config.pool.min_nodes):
            m.phase, m.booted_at, m.drain_seq = Phase.COMMITTING.value, now, core.store.last_seq()
            self._save()
            for node in list(core.nodes.values()):
                if self._domain_of(node) == m.source and node.state in ADMITTED:
                    self._drain(node, "migration")
            core.wake()
            return []
        if now - m.started_at > self.plan.boot_timeout_s:
            return self._fail("boot_timeout", now)
        target = next(v for v in self._views(now, m.markets) if v.name == m.target)
        if decide.target_out(s, target, self.fleet.history(now), now=now):
            return self._fail("target_out_of_capacity", now)
        return []

    def _committing(self, now: float) -> list[Action]:
        core, m = self.core, self.move
        assert m is not None
        s = core.state()
        waited = now - (m.booted_at or now)
        # the job has left the source once no node there trains and its commit is recorded
        # (a trainer's exit can be reported before its commit line; a hung one: the timeout)
        committed = bool(core.store.events(since=m.drain_seq, kinds=[EventKind.CHECKPOINT_COMMITTED.value]))
        left = decide.job_left(s, m.source) and (committed or core.job.last_commit_step is None)
        if not left and waited <= core.config.daemon.rejoin_timeout_s:
            return []
        m.phase, m.committed_at, m.commit_step = Phase.COPYING.value, now, core.job.last_commit_step
        self._save()
        if m.commit_step is None:
            return self._switch(now)  # nothing committed yet: the job starts afresh there
        self._start_copy(m)
        return []

    def _start_copy(self, m: Move) -> None:
        cfg = self.core.config
        src, dst = cfg.domain(m.source), cfg.domain(m.target)
        state_dir = Path(cfg.daemon.state_path())
        fill = lambda uri: uri.replace("{state_dir}", str(state_dir))  # noqa: E731
        step = m.commit_step
        work = state_dir / "replicate" / f"{m.target}-step-{step}"  # a retried move resumes this copy

        def run() -> dict[str, Any]:
            from trainer.replicate import open_store_for, replicate

            private_dir(work, root=state_dir)  # a link planted in the state dir is refused, not followed
            # open_store_for: an OSS store keeps oss2's part-level resume records in the work dir
            a = open_store_for(fill(src.checkpoint_uri), work, s3_endpoint_url=src.s3_endpoint_url,
                               oss_endpoint=src.oss_endpoint)
            b = open_store_for(fill(dst.checkpoint_uri), work, s3_endpoint_url=dst.s3_endpoint_url,
                               oss_endpoint=dst.oss_endpoint)
            r = replicate(a, b, step=step, work_dir=work)
            return {"step": r.step, "bytes": r.bytes_total, "bytes_copied": r.bytes_copied,
                    "shards_copied": r.shards_copied, "shards_skipped": r.shards_skipped,
                    "copy_s": round(r.seconds, 3)}

        async def copy() -> None:
            try:
                self._copy_result = await asyncio.to_thread(run)
            except Exception as exc:  # a store or verification failure: the move fails, the job stays
                self._copy_error = f"{type(exc).__name__}: {exc}"[:300]
            self.core.wake()

        self._copy_result, self._copy_error = None, None
        self._copy = self.core.spawn(copy(), f"replicate-{m.id}")

    def _copying(self, now: float) -> list[Action]:
        m = self.move
        assert m is not None
        if self._copy is None and self._copy_result is None and self._copy_error is None:
            self._start_copy(m)  # (a restored move never gets here: see restore)
            return []
        if self._copy_error is not None:
            return self._fail(f"copy_failed: {self._copy_error}", now)
        if self._copy_result is None:
            return []
        m.copy, m.replicated_at = dict(self._copy_result), now
        src = self.core.config.domain(m.source)
        egress = (m.copy.get("bytes_copied") or 0) / 1e9 * src.egress_usd_per_gb
        self.core.record(EventKind.CHECKPOINT_REPLICATED, None, migration=m.id, source=m.source, target=m.target,
                         egress_usd=round(egress, 4), **m.copy)
        return self._switch(now)

    def _switch(self, now: float) -> list[Action]:
        """The job's domain is now the target: its nodes start the job from the copy."""
        core, m = self.core, self.move
        assert m is not None
        m.phase = Phase.STARTING.value
        self.domain = m.target
        core.store.set("domain", self.domain)
        self._save()
        if core.job.state is JobState.RUNNING:
            core.job.to(JobState.PENDING)
        core.first_ready_at = None
        log.info("job_domain_changed", pool=core.pool, domain=self.domain)
        core.wake()
        return []

    def _starting(self, now: float) -> list[Action]:
        core, m = self.core, self.move
        assert m is not None
        j = core.job
        trained_there = (j.state is JobState.RUNNING and j.step is not None
                         and j.step > (m.commit_step if m.commit_step is not None else -1)
                         and j.resumed_at is not None and j.resumed_at >= (m.replicated_at or m.committed_at or 0))
        if j.state is JobState.COMPLETED:
            trained_there = True
        if not trained_there:
            if now - (m.replicated_at or m.committed_at or now) > self.plan.boot_timeout_s:
                log.warning("migration_slow_start", migration=m.id)
            return []
        timeline = {
            "boot_s": _dt(m.started_at, m.booted_at),
            "commit_s": _dt(m.booted_at, m.committed_at),
            "copy_s": _dt(m.committed_at, m.replicated_at),
            "first_step_s": _dt(m.replicated_at or m.committed_at, now),
            "decision_to_first_step_s": _dt(m.started_at, now),
            "paused_s": _dt(m.booted_at, now),  # the job trained nowhere from the drain to the first step
        }
        releases = self._release(m.source, "migrated")
        core.record(EventKind.MIGRATION_COMPLETED, None, migration=m.id, source=m.source, target=m.target,
                    reason=m.reason, from_step=m.from_step, commit_step=m.commit_step, step=j.step,
                    bytes=m.copy.get("bytes"), released=[a.node_id for a in releases], **timeline)
        self.completed += 1
        core.store.set("migrations_completed", self.completed)
        self.move, self.last_ended_at, self.starved_since = None, now, None
        self._save()
        return releases

    def _fail(self, reason: str, now: float) -> list[Action]:
        core, m = self.core, self.move
        assert m is not None
        switched = m.phase == Phase.STARTING.value
        if not switched:
            releases = self._release(m.target, "migration_failed")
            if m.phase in (Phase.COMMITTING.value, Phase.COPYING.value):
                # the job left the source for the move: it starts again there from its commit
                releases += self._release(m.source, "migration_failed")
                if core.job.state is JobState.RUNNING:
                    core.job.to(JobState.PENDING)
                core.first_ready_at = None
        else:
            releases = []
        core.record(EventKind.MIGRATION_FAILED, None, migration=m.id, source=m.source, target=m.target,
                    phase=m.phase, reason=reason, stays_in=self.domain)
        log.warning("migration_failed", migration=m.id, reason=reason)
        self.failed += 1
        core.store.set("migrations_failed", self.failed)
        self.move = None
        self.failed_moves[m.target] = now  # not a target again within the cooldown; another may be
        self._copy = None
        self._save()
        core.wake()
        return releases

    def _release(self, domain: str, reason: str) -> list[Action]:
        return [Terminate(n.id, reason) for n in self.core.nodes.values()
                if self._domain_of(n) == domain and not n.state.is_terminal()]

    def _domain_of(self, node: Any) -> str:
        return self.core.domain_of(node)


def _dt(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)
