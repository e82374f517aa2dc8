"""Whole-job migration between placement domains: when to move, where, and each next
step of a move in flight. Pure: no I/O, no clock (``now`` is passed in).

A job attempt's nodes share one placement domain (a provider and region, plus an
optional placement group) and its private network. Replacements come from that domain;
when it cannot hold the job, the whole job moves:

1. ``booting``: the pool is launched in the target domain (the planner builds there)
   while the job keeps training where it is;
2. ``committing``: once the target has nodes for a valid world size, every node of the
   job is drained: the job commits at one step boundary and its workers stop (no step
   computed after the commit, so none is lost);
3. ``copying``: the newest committed checkpoint is copied to the target's store, every
   shard verified against the manifest (:mod:`trainer.replicate`);
4. ``starting``: the job's domain is now the target; its nodes start the job, which
   resumes from the copy with the same global batch and data position;
5. done once the job has trained its first step there: the old domain's nodes, held
   until then, are released (``migration_completed``). A move that cannot finish
   (the target brings up no nodes within ``boot_timeout_s``, the copy fails) ends
   ``migration_failed`` and the job stays, or goes back, where it was.

When to move (:func:`decide`): the job's domain has been **starved** (short of the
target with every one of its offers out of capacity or over its price cap) for
``patience_s``; or, with ``min_saving_fraction`` set, another domain is that much
cheaper per GPU-hour and the saving over ``payback_h`` pays for the move. Where
(:func:`choose_target`): the usable domain with the lowest cost per GPU-hour, after a
penalty for its recent preemptions and capacity failures, plus the move's own cost
(checkpoint bytes × the source's egress price), spread over ``payback_h``.

A move in flight (:class:`Migration`) advances only through :func:`step`: the migrator
(``daemon/controlnode/migrator.py``) reports what happened as a typed message (the
target booted, the job left the source, the copy finished or failed, the job trained
in the target, the move was given up) and carries out the effects it gets back
(drains, releases, the copy, events). Every phase change is checked against
:data:`PHASE_TRANSITIONS`; one the table does not list raises :class:`IllegalTransition`
before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Collection, Mapping, Sequence, Union

from daemon.control.actions import Drain, PoolState, Terminate
from daemon.control.lifecycle import ADMITTED, COUNTED, IllegalTransition, JobState, NodeState
from daemon.control.offers import History, Offer, rank_offers

__all__ = ["Phase", "PHASE_TRANSITIONS", "check_phase_transition", "DomainView", "Plan", "Move", "Migration",
           "MigrationState", "starved_since", "choose_target", "decide", "move_cost_usd", "ready_for_commit",
           "target_out", "job_left", "source_left", "trained_there", "RISK_PENALTY", "Begin", "Booted", "BootFailed", "SourceLeft",
           "CopyDone", "CopyFailed", "TrainedThere", "GiveUp", "Message", "Record", "StartCopy", "ResetStart",
           "Effect", "step", "strays"]

# each recent preemption or capacity failure in a domain weighs like this fraction of its
# price per GPU-hour (a domain that just failed us is not where to go first)
RISK_PENALTY = 0.10
# a domain's recent losses past this many add no more penalty (a window of an hour holds far fewer)
MAX_RECENT_LOSSES = 10**6
_GB = 1e9


class Phase(str, Enum):
    """Where a move is (module docstring): booting → committing → copying → starting →
    done, or failed from any phase before starting (:data:`PHASE_TRANSITIONS`). Only a
    move in flight is stored, so ``done`` and ``failed`` never are."""

    BOOTING = "booting"  # the target's pool launches; the job trains on in the source
    COMMITTING = "committing"  # the source is drained: the job commits and stops there
    COPYING = "copying"  # the newest commit is copied to the target's store
    STARTING = "starting"  # the job's domain is the target; the source's nodes wait for a step there
    DONE = "done"  # the job trained in the target: the source's nodes are released
    FAILED = "failed"  # given up before the switch: the job stays, or goes back, where it was

    @classmethod
    def terminal(cls) -> frozenset["Phase"]:
        return _PHASE_TERMINAL

    def is_terminal(self) -> bool:
        return self in _PHASE_TERMINAL


_P = Phase
_PHASE_TERMINAL = frozenset({_P.DONE, _P.FAILED})
PHASE_TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    _P.BOOTING: frozenset({_P.COMMITTING, _P.FAILED}),
    # nothing committed yet goes through copying at once (nothing to copy)
    _P.COMMITTING: frozenset({_P.COPYING, _P.FAILED}),
    _P.COPYING: frozenset({_P.STARTING, _P.FAILED}),
    _P.STARTING: frozenset({_P.DONE}),  # after the switch the job is in the target: no way back
    _P.DONE: frozenset(),
    _P.FAILED: frozenset(),
}


def check_phase_transition(old: Phase, new: Phase) -> None:
    """Raises IllegalTransition unless ``old → new`` is in :data:`PHASE_TRANSITIONS`. Unlike
    the node and job lifecycles, staying in a phase is no transition: every message that
    :func:`step` takes moves a move on, so one that would leave it where it is is refused."""
    if new not in PHASE_TRANSITIONS[old]:
        raise IllegalTransition(f"migration phase {old.value} → {new.value} is not allowed")


@dataclass(frozen=True, slots=True)
class DomainView:
    """A decision's view of a placement domain.

    ``offers``: its offers with current prices (USD/hour); ``egress_usd_per_gb``: what
    copying a byte out of its store to another domain costs (USD per 10^9 bytes);
    ``preemptions`` / ``capacity_failures``: recent ones there (the daemon's window).
    """

    name: str
    offers: tuple[Offer, ...]
    egress_usd_per_gb: float = 0.0
    preemptions: int = 0
    capacity_failures: int = 0

    def usable(self, history: History, now: float) -> list[Offer]:
        return rank_offers(self.offers, history, now=now)

    def usd_per_gpu_h(self, history: History, now: float) -> float:
        """The cheapest usable offer's price per GPU-hour (inf: none usable or price unknown)."""
        usable = self.usable(history, now)
        return min((o.usd_per_gpu_h() for o in usable), default=float("inf"))


@dataclass(frozen=True, slots=True)
class Plan:
    """Migration settings (``config.migration``); seconds and hours."""

    patience_s: float = 300.0
    boot_timeout_s: float = 900.0
    min_saving_fraction: float | None = None
    payback_h: float = 24.0
    cooldown_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class Move:
    """The decision to move the job from ``source`` to ``target``; ``reason`` is
    ``capacity`` or ``price``; ``why``: the figures behind it, for the event."""

    source: str
    target: str
    reason: str
    why: Mapping[str, object] = field(default_factory=dict)
    # the markets the target is built from while the move is in flight (None: those the
    # recovery policy allows): a move made to find spot does not buy on-demand there
    markets: frozenset[str] | None = None


def move_cost_usd(checkpoint_bytes: int | None, source: DomainView) -> float:
    """What copying the checkpoint out of ``source`` costs (USD): bytes × egress price."""
    return (checkpoint_bytes or 0) / _GB * source.egress_usd_per_gb


_LAUNCHED = frozenset(COUNTED) - {NodeState.REQUESTED}


def starved_since(prev: float | None, s: PoolState, domain: DomainView, history: History, *,
                  now: float) -> float | None:
    """Since when (unix s) the job's domain has been **starved**, or None: short of the
    target (fewer of its nodes count as capacity than ``s.target_nodes``) with none of its
    offers usable (all in capacity backoff or over their price cap).

    Once starved, the domain stays starved until the shortage ends or a launch there
    succeeds after ``prev``: an offer whose backoff ran out and which failed again has not
    ended the shortage, so the patience is not restarted by each retry.
    """
    if s.job.is_terminal() or s.paused or s.target_nodes <= 0:
        return None
    mine = [n for n in s.nodes if n.domain == domain.name]
    counted = [n for n in mine if n.state in COUNTED and not n.replacing]
    if len(counted) >= s.target_nodes:
        return None
    if prev is not None:
        if any(n.created_at > prev and n.state in _LAUNCHED for n in mine):
            return None  # a launch there succeeded: capacity came back
        return prev
    return now if not domain.usable(history, now) else None


def _score(d: DomainView, history: History, now: float) -> float:
    """USD per GPU-hour after the risk penalty (inf: no usable priced offer). The recent
    losses counted are capped at :data:`MAX_RECENT_LOSSES` so that no count, however
    large, overflows the float (the ranking is the same past the cap)."""
    price = d.usd_per_gpu_h(history, now)
    if price == float("inf"):
        return price
    losses = min(max(0, d.preemptions + d.capacity_failures), MAX_RECENT_LOSSES)
    return price * (1.0 + RISK_PENALTY * losses)


def choose_target(domains: Sequence[DomainView], current: str, history: History, *, now: float,
                  checkpoint_bytes: int | None, payback_h: float, gpus: int,
                  avoid: Collection[str] = ()) -> tuple[DomainView, dict] | None:
    """The domain to move to, with the figures that chose it; None when no other domain
    (outside ``avoid``) has a usable offer. Cost per GPU-hour after the risk penalty (a
    domain whose price is unknown ranks after every priced one), plus the move's egress
    spread over ``payback_h`` hours and ``gpus`` GPUs; config order breaks ties."""
    source = next((d for d in domains if d.name == current), None)
    egress = move_cost_usd(checkpoint_bytes, source) if source is not None else 0.0
    scored = []
    for i, d in enumerate(domains):
        if d.name == current or d.name in avoid or not d.usable(history, now):
            continue
        # a usable domain whose price is unknown stays a candidate, after every priced one
        score = _score(d, history, now)
        scored.append((score + egress / max(payback_h, 1e-9) / max(gpus, 1), i, d))
    if not scored:
        return None
    score, _, best = min(scored, key=lambda t: (t[0], t[1]))
    price = best.usd_per_gpu_h(history, now)
    why = {
        "candidates": {d.name: _finite(sc) for sc, _, d in sorted(scored, key=lambda t: (t[0], t[1]))},
        "target_usd_per_gpu_h": _finite(price),
        "target_recent_failures": best.preemptions + best.capacity_failures,
        "egress_usd": round(egress, 2),
        "checkpoint_bytes": checkpoint_bytes,
    }
    return best, why


def _finite(x: float) -> float | None:
    """``x`` rounded for an event, None when unknown (inf)."""
    return None if x == float("inf") else round(x, 4)


def decide(s: PoolState, domains: Sequence[DomainView], current: str, history: History, *, now: float,
           plan: Plan, starved_since: float | None, checkpoint_bytes: int | None,
           last_move_ended_at: float | None, gpus: int, failed_moves: Mapping[str, float] | None = None) -> Move | None:
    """Whether to move the job now, and where (module docstring). None: stay.

    Never while paused or over, never within ``cooldown_s`` of the last completed move's
    end (``last_move_ended_at``), never to a domain a move to which failed within
    ``cooldown_s`` (``failed_moves``: domain → when, unix s; another domain may be tried
    at once: a starved job should not sit out the cooldown because one target could not
    boot), and never without a target domain that can launch now."""
    if s.job.is_terminal() or s.paused or len(domains) < 2:
        return None
    if last_move_ended_at is not None and now - last_move_ended_at < plan.cooldown_s:
        return None
    src = next((d for d in domains if d.name == current), None)
    if src is None:
        return None
    avoid = {d for d, t in (failed_moves or {}).items() if now - t < plan.cooldown_s}
    picked = choose_target(domains, current, history, now=now, checkpoint_bytes=checkpoint_bytes,
                           payback_h=plan.payback_h, gpus=gpus, avoid=avoid)
    if picked is None:
        return None
    target, why = picked
    if starved_since is not None and now - starved_since >= plan.patience_s:
        return Move(current, target.name, "capacity",
                    {**why, "starved_s": round(now - starved_since, 1), "patience_s": plan.patience_s})
    if plan.min_saving_fraction is None:
        return None
    here = src.usd_per_gpu_h(history, now)
    there = target.usd_per_gpu_h(history, now)
    if here == float("inf") or there >= here * (1.0 - plan.min_saving_fraction):
        return None
    saving = (here - there) * gpus * plan.payback_h
    if saving <= why["egress_usd"]:
        return None
    return Move(current, target.name, "price",
                {**why, "source_usd_per_gpu_h": round(here, 4), "saving_usd_over_payback": round(saving, 2)})


def target_out(s: PoolState, target: DomainView, history: History, *, now: float) -> bool:
    """A move in its ``booting`` phase cannot go on: its target has no node launching or up
    and none of its offers is usable (every launch there failed for capacity: the
    provider said so at once, e.g. EC2's ``InsufficientInstanceCapacity``). The move
    fails now rather than at ``boot_timeout_s``, and another domain may be tried."""
    if any(n.domain == target.name and n.state in COUNTED for n in s.nodes):
        return False
    return not target.usable(history, now)


def ready_for_commit(s: PoolState, target: str, *, valid_world_sizes: frozenset[int], min_nodes: int) -> bool:
    """The target domain can take the job: its ready nodes reach the pool's target, or make
    a valid world size of at least ``min_nodes`` nodes while nothing more is launching there."""
    ready = [n for n in s.nodes if n.domain == target and n.state is NodeState.READY]
    if len(ready) >= s.target_nodes:
        return True
    booting = [n for n in s.nodes if n.domain == target and n.state in (NodeState.REQUESTED, NodeState.LAUNCHING,
                                                                        NodeState.PREPARING)]
    world = sum(n.gpus for n in ready)
    return not booting and len(ready) >= min_nodes and world in valid_world_sizes


def source_left(s: PoolState, m: "Migration", *, committed: bool, last_commit_step: int | None,
                job_step: int | None, waited_s: float, rejoin_timeout_s: float) -> bool:
    """Whether the job has left ``m``'s source, so its newest commit is what moves: no node
    there trains (:func:`job_left`) and the commit the drain asked for is recorded
    (``committed``), or none can come: the job never committed (``last_commit_step`` None).
    A move whose drain stopped no node (``m.drained`` 0: started again after a takeover,
    its predecessor's drain having stopped the source's nodes) has no commit of its own to
    wait for, but its predecessor's may still be on its way from the agents: it moves once
    the newest recorded commit covers the step the job reached (``job_step``), or once no
    node is left in the source to report one (each is terminal). The copy then takes the
    newest commit that verifies in the source's store, recorded or not
    (:func:`~daemon.controlnode.migrator.copy_checkpoint`): HA job trials 19 and 23 lost
    7-10 steps copying the recorded periodic commit while the drain's commit, written by a
    node released before its report got through, sat in the store. Past
    ``rejoin_timeout_s`` of waiting (``waited_s``, seconds since the drain), it has left
    whatever is there (a trainer that hangs, a commit line lost)."""
    if waited_s > rejoin_timeout_s:
        return True
    if not job_left(s, m.source):
        return False
    if committed or last_commit_step is None:
        return True
    if m.drained != 0:
        return False
    covered = job_step is not None and last_commit_step >= job_step
    return covered or all(n.state.is_terminal() for n in s.nodes if n.domain == m.source)


def job_left(s: PoolState, source: str) -> bool:
    """Every node of the job in ``source`` has stopped training (its commit is in, or it is gone)."""
    return not any(n.domain == source and (n.state in ADMITTED or not n.trainer_exited)
                   and not n.state.is_terminal() for n in s.nodes)


def trained_there(m: "Migration", job: JobState, step: int | None, resumed_at: float | None) -> bool:
    """A switched move (``starting``) is done: the job trained a step past the moved commit
    after resuming from the copy (``resumed_at``, unix s), or it completed."""
    if job is JobState.COMPLETED:
        return True
    return (job is JobState.RUNNING and step is not None
            and step > (m.commit_step if m.commit_step is not None else -1)
            and resumed_at is not None and resumed_at >= (m.replicated_at or m.committed_at or 0))


def start_overdue(m: "Migration", now: float, boot_timeout_s: float) -> bool:
    """A switched move (``starting``) has waited longer than ``boot_timeout_s`` (seconds)
    since its commit reached the target for the job to train there. The move can do no
    more (the job's domain is the target already): from then on the job is held to the
    stall rules again (:func:`daemon.control.stall.check`), whose recovery restarts its
    trainers in place there, instead of waiting on the move for good (a trainer that
    died in the first round, with the claim to rank 0 waiting for its word, held the job
    and the move ten minutes in an HA trial)."""
    return m.phase is Phase.STARTING and now - (m.replicated_at or m.committed_at or now) > boot_timeout_s


# -- a move in flight ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Migration:
    """A move in flight, as the store keeps it (:meth:`to_dict`). Times are unix seconds."""

    id: str
    source: str
    target: str
    reason: str
    started_at: float
    phase: Phase = Phase.BOOTING
    why: Mapping[str, Any] = field(default_factory=dict)
    from_step: int | None = None  # the job's step at the decision
    booted_at: float | None = None  # the target had nodes for the job; the source was drained
    drain_seq: int = 0  # the last event before the drain: the move's commit is recorded after it
    drained: int | None = None  # source nodes the drain stopped (None: a move stored before it was kept)
    committed_at: float | None = None  # the job left the source; its newest commit is what moves
    commit_step: int | None = None
    replicated_at: float | None = None
    copy: Mapping[str, Any] = field(default_factory=dict)  # the copy's figures (step, bytes, shards, copy_s)
    markets: frozenset[str] | None = None  # the target's markets while in flight (None: the policy's)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: JSON values, ``phase`` by its value, ``markets`` sorted."""
        return {"id": self.id, "source": self.source, "target": self.target, "reason": self.reason,
                "started_at": self.started_at, "phase": self.phase.value, "why": dict(self.why),
                "from_step": self.from_step, "booted_at": self.booted_at, "drain_seq": self.drain_seq,
                "drained": self.drained,
                "committed_at": self.committed_at, "commit_step": self.commit_step,
                "replicated_at": self.replicated_at, "copy": dict(self.copy),
                "markets": None if self.markets is None else sorted(self.markets)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Migration":
        """The move :meth:`to_dict` stored. Raises TypeError (a field missing or unknown) or
        ValueError (a phase that is not one of a move in flight)."""
        fields = dict(raw)
        phase = Phase(fields.pop("phase", Phase.BOOTING.value))
        if phase.is_terminal():
            raise ValueError(f"a stored migration cannot be {phase.value}")
        markets = fields.pop("markets", None)
        return cls(**fields, phase=phase, markets=None if markets is None else frozenset(markets))

    def to(self, phase: Phase, **changes: Any) -> "Migration":
        """This move in ``phase``, with ``changes``. Raises IllegalTransition (the table)."""
        check_phase_transition(self.phase, phase)
        return replace(self, phase=phase, **changes)


@dataclass(frozen=True, slots=True)
class MigrationState:
    """Where the job is and its moves: the domain it runs in, the move in flight, the moves
    completed and failed, the last completed move's end (unix s: the cooldown), when a move
    to each domain last failed, and since when the job's domain has been starved."""

    domain: str
    migration: Migration | None = None
    completed: int = 0
    failed: int = 0
    last_ended_at: float | None = None
    failed_moves: Mapping[str, float] = field(default_factory=dict)
    starved_since: float | None = None


# -- what the migrator reports (messages) ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Begin:
    """The policy decided ``move`` (:func:`decide`); ``id`` names it; ``from_step``: the job's step."""

    move: Move
    id: str
    from_step: int | None


@dataclass(frozen=True, slots=True)
class Booted:
    """The target holds nodes for the job (:func:`ready_for_commit`); ``drain_seq``: the
    store's last event before the source is drained."""

    drain_seq: int


@dataclass(frozen=True, slots=True)
class BootFailed:
    """The target will not come up: ``boot_timeout`` or ``target_out_of_capacity`` (:func:`target_out`)."""

    reason: str


@dataclass(frozen=True, slots=True)
class SourceLeft:
    """The job left the source (:func:`job_left` and its commit recorded, or the wait ran
    out); ``commit_step``: its newest commit (None: nothing committed, nothing to copy)."""

    commit_step: int | None


@dataclass(frozen=True, slots=True)
class CopyDone:
    """The copy finished and verified: ``result`` its figures (``step``, ``bytes``,
    ``bytes_copied``, ``shards_copied``, ``shards_skipped``, ``copy_s``);
    ``egress_usd_per_gb``: the source's egress price."""

    result: Mapping[str, Any]
    egress_usd_per_gb: float = 0.0


@dataclass(frozen=True, slots=True)
class CopyFailed:
    """The copy failed (a store or verification error, one line)."""

    error: str


@dataclass(frozen=True, slots=True)
class TrainedThere:
    """The job trained in the target (:func:`trained_there`); ``step``: its step now."""

    step: int | None


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The move ends before its switch: ``paused``, ``job_<state>`` or ``daemon_restarted``."""

    reason: str


Message = Union[Begin, Booted, BootFailed, SourceLeft, CopyDone, CopyFailed, TrainedThere, GiveUp]


# -- what the migrator carries out (effects) ----------------------------------------------------

@dataclass(frozen=True, slots=True)
class Record:
    """Record event ``kind`` (a :class:`daemon.model.EventKind` value) with ``data``."""

    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StartCopy:
    """Copy commit ``step`` of the job, or a newer one the source's store holds, from
    ``source``'s store to ``target``'s, verified (:func:`trainer.replicate.replicate`); the
    result comes back as CopyDone (its ``step``: the one copied) / CopyFailed."""

    migration: str
    source: str
    target: str
    step: int


@dataclass(frozen=True, slots=True)
class ResetStart:
    """The job has left its nodes for a move: a running job goes back to ``pending`` (the
    next nodes up start it from its newest commit: the copy in the target, or its own
    commit in the source after a failed move), and the wait for its first node starts
    again (``first_ready_at`` cleared). Applied by the supervisor's actuator."""

    reason: str  # migration_switched | migration_failed


Effect = Union[Record, StartCopy, ResetStart, Drain, Terminate]


def step(st: MigrationState, msg: Message, *, s: PoolState, now: float) -> tuple[MigrationState, list[Effect]]:
    """The move's next state after ``msg`` at ``now`` (unix s), and what to carry out, in
    order: events, drains of the source (:class:`Drain`), the copy, the job's reset, and
    releases (:class:`Terminate`, from the nodes of ``s``).

    Raises:
        IllegalTransition: ``msg`` does not fit the move's phase (:data:`PHASE_TRANSITIONS`),
            a move begins while one is in flight, or a message comes with none in flight.
    """
    m = st.migration
    if isinstance(msg, Begin):
        if m is not None:
            raise IllegalTransition(f"migration {m.id} is in flight: no second move")
        mv = msg.move
        m = Migration(id=msg.id, source=mv.source, target=mv.target, reason=mv.reason, started_at=now,
                      why=dict(mv.why), from_step=msg.from_step, markets=mv.markets)
        return replace(st, migration=m), [Record("migration_started", {
            "migration": m.id, "source": m.source, "target": m.target, "reason": m.reason, "step": m.from_step,
            **dict(mv.why)})]
    if m is None:
        raise IllegalTransition(f"no migration in flight for {type(msg).__name__}")
    if isinstance(msg, Booted):
        drains: list[Effect] = [Drain(n.id, "migration") for n in s.nodes
                                if n.domain == m.source and n.state in ADMITTED]
        return replace(st, migration=m.to(_P.COMMITTING, booted_at=now, drain_seq=msg.drain_seq,
                                          drained=len(drains))), drains
    if isinstance(msg, SourceLeft):
        m = m.to(_P.COPYING, committed_at=now, commit_step=msg.commit_step)
        if m.commit_step is None:
            return _switch(replace(st, migration=m), m, [])  # nothing committed yet: the job starts afresh there
        return replace(st, migration=m), [StartCopy(m.id, m.source, m.target, m.commit_step)]
    if isinstance(msg, CopyDone):
        if m.phase is not _P.COPYING:
            raise IllegalTransition(f"migration phase {m.phase.value}: no copy to finish")
        # the copy may take a newer commit than the recorded one (source_left), never an older
        moved = msg.result.get("step")
        if isinstance(moved, int) and (m.commit_step is None or moved > m.commit_step):
            m = replace(m, commit_step=moved)
        m = replace(m, copy=dict(msg.result), replicated_at=now)
        egress = (m.copy.get("bytes_copied") or 0) / _GB * msg.egress_usd_per_gb
        return _switch(replace(st, migration=m), m, [Record("checkpoint_replicated", {
            "migration": m.id, "source": m.source, "target": m.target, "egress_usd": round(egress, 4), **m.copy})])
    if isinstance(msg, TrainedThere):
        return _complete(st, m, msg, s, now)
    reason = f"copy_failed: {msg.error}" if isinstance(msg, CopyFailed) else msg.reason
    return _fail(st, m, reason, s, now)


def _switch(st: MigrationState, m: Migration, effects: list[Effect]) -> tuple[MigrationState, list[Effect]]:
    """The job's domain is now the target: its nodes start the job from the copy."""
    m = m.to(_P.STARTING)
    return replace(st, migration=m, domain=m.target), [*effects, ResetStart("migration_switched")]


def _complete(st: MigrationState, m: Migration, msg: TrainedThere, s: PoolState,
              now: float) -> tuple[MigrationState, list[Effect]]:
    """The job trained in the target: ``migration_completed`` with the move's timeline
    (seconds), then the source's nodes, held until now, are released."""
    check_phase_transition(m.phase, _P.DONE)  # only a switched move is done
    timeline = {
        "boot_s": _dt(m.started_at, m.booted_at),
        "commit_s": _dt(m.booted_at, m.committed_at),
        "copy_s": _dt(m.committed_at, m.replicated_at),
        "first_step_s": _dt(m.replicated_at or m.committed_at, now),
        "decision_to_first_step_s": _dt(m.started_at, now),
        "paused_s": _dt(m.booted_at, now),  # the job trained nowhere from the drain to the first step
    }
    releases = _release(s, m.source, "migrated")
    done = Record("migration_completed", {
        "migration": m.id, "source": m.source, "target": m.target, "reason": m.reason, "from_step": m.from_step,
        "commit_step": m.commit_step, "step": msg.step, "bytes": m.copy.get("bytes"),
        "released": [a.node_id for a in releases], **timeline})
    return (replace(st, migration=None, completed=st.completed + 1, last_ended_at=now, starved_since=None),
            [done, *releases])


def _fail(st: MigrationState, m: Migration, reason: str, s: PoolState,
          now: float) -> tuple[MigrationState, list[Effect]]:
    """Give the move up: the target's nodes are released; a job that left the source for
    it (committing, copying) starts again there from its commit. A move to the same
    target is not tried again within the cooldown (another target may be)."""
    check_phase_transition(m.phase, _P.FAILED)  # after the switch there is no going back
    effects: list[Effect] = []
    releases = _release(s, m.target, "migration_failed")
    if m.phase in (_P.COMMITTING, _P.COPYING):
        releases += _release(s, m.source, "migration_failed")
        effects.append(ResetStart("migration_failed"))
    effects.append(Record("migration_failed", {"migration": m.id, "source": m.source, "target": m.target,
                                               "phase": m.phase.value, "reason": reason, "stays_in": st.domain}))
    return (replace(st, migration=None, failed=st.failed + 1, failed_moves={**st.failed_moves, m.target: now}),
            [*effects, *releases])


def _release(s: PoolState, domain: str, reason: str) -> list[Terminate]:
    return [Terminate(n.id, reason) for n in s.nodes if n.domain == domain and not n.state.is_terminal()]


def _dt(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)


def strays(s: PoolState, keep: Collection[str], but: Collection[str] = ()) -> list[Terminate]:
    """The live nodes of ``s`` in a domain outside ``keep`` (the job's, and a move's source
    and target), but those of ``but`` (released already): released. They come from a
    daemon restarted during a move, or a config whose domains changed."""
    return [Terminate(n.id, "outside_the_job_domain") for n in s.nodes
            if not n.state.is_terminal() and n.domain not in keep and n.id not in but]
