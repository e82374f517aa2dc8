"""What the control plane's decisions return: actions, each carrying its reason.

A decision (:func:`daemon.control.pool.plan`, :func:`daemon.control.admission.admit`,
a :class:`~daemon.control.policies.RecoveryPolicy`) reads a :class:`PoolState` and
returns a list of these; the supervisor's actuators carry them out (provider calls,
agent commands, store writes, events). Nothing here does I/O.

- :class:`Launch` / :class:`Terminate` / :class:`MarkLost`: the pool's capacity.
- :class:`Admit`: a ``ready`` or ``admitting`` node joins the job (``running``).
- :class:`StartJob` / :class:`RestartJob`: the job's own lifecycle
  (``pending → running``; ``running → pending`` with the whole pool relaunched).
- :class:`RequestRejoin` / :class:`EndRejoin`: a grow's rejoin commit, asked of the
  nodes in the job, then ended (answered, withdrawn or timed out).
- :class:`Drain`: a node leaves the job cleanly (commit, then stop).
- :class:`NoteFirstReady`: the first node of a pending job is up (the wait for the
  rest starts now).
- :class:`Leave` / :class:`AvoidZone` / :class:`WatchFlush`: a node's interruption
  notice (:func:`daemon.control.reactions.on_notice`).
- :class:`RequestCheckpoint` / :class:`MarkReplacing`: a rebalance recommendation
  (:func:`daemon.control.reactions.on_rebalance`).
- :class:`JobStalled`: the job made no progress (:mod:`daemon.control.stall`): report it,
  and restart its trainers in place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Union

from daemon.control.lifecycle import JobState, NodeState, TrainerState

__all__ = [
    "NodeView",
    "RejoinView",
    "PoolState",
    "Launch",
    "Terminate",
    "MarkLost",
    "Admit",
    "StartJob",
    "RestartJob",
    "RequestRejoin",
    "EndRejoin",
    "Drain",
    "NoteFirstReady",
    "Leave",
    "AvoidZone",
    "WatchFlush",
    "RequestCheckpoint",
    "MarkReplacing",
    "Action",
    "WakeSurvivors",
    "JobStalled",
]


@dataclass(frozen=True, slots=True)
class NodeView:
    """A decision's view of a node; times are unix seconds."""

    id: str
    state: NodeState
    gpus: int
    created_at: float
    last_heartbeat: float | None = None
    deadline: float | None = None
    # a rebalance recommendation with policy ``replace``: keeps running, but is
    # not counted as capacity, so its replacement is launched now
    replacing: bool = False
    # the agent's view of its torchrun; a draining node whose trainer is not running has left the job
    trainer: TrainerState = TrainerState.NOT_STARTED
    # the heartbeat interval (seconds) the daemon last told this node; None: not told yet
    heartbeat_interval_s: float | None = None
    ordinal: int = 0  # launch order: admission goes oldest first
    ready_at: float | None = None  # when its agent registered
    domain: str = ""  # its placement domain ("" in a decision that does not look at domains)
    market: str = "spot"  # the market it was bought on: spot or on_demand
    # in the domain a migration is leaving: kept (not released as drained) until the job
    # has trained its first step in the new domain
    held: bool = False
    # the trainer attempt its workers last reported starting ("" unknown): a node of the
    # job's running attempt holds ranks its peers may be blocked on
    attempt: str = ""
    # seconds from its launch request to its agent registering before it is terminated as
    # launch_timeout: its offer's (OfferSpec.launch_timeout_s); None: Timeouts.launch_timeout_s
    launch_timeout_s: float | None = None
    # since when (unix s) its agent has said it holds reports the daemon has not answered
    # (a drained node is released only once they are in: its last commit report dies with
    # it otherwise); None: none owed. A daemon that has not heard it since it started
    # passes its own start.
    reports_owed_since: float | None = None

    @property
    def trainer_exited(self) -> bool:
        """Its trainer is not (or no longer) running."""
        return self.trainer is not TrainerState.RUNNING


@dataclass(frozen=True, slots=True)
class RejoinView:
    """The grow in flight: checkpoint request ``id`` (``requested_at``, unix s) for ``nodes``."""

    id: str
    nodes: frozenset[str]
    requested_at: float
    answered: bool = False


@dataclass(frozen=True, slots=True)
class PoolState:
    """One value for the pool: what every decision reads.

    ``desired_nodes``: what the pool should hold now (0 while paused or once the job is
    over); ``target_nodes``: the operator's target (``spotctl scale``), which a pending
    job waits for; ``first_ready_at``: when the first node of a pending job was up.
    """

    nodes: tuple[NodeView, ...]
    job: JobState
    paused: bool = False
    desired_nodes: int = 0
    target_nodes: int = 0
    rejoin: RejoinView | None = None
    first_ready_at: float | None = None
    # the placement domain the job runs in: admission looks at its nodes only ("" = all)
    domain: str = ""
    # the trainer attempt the job runs now, and its world size ("" and 0: none reported)
    attempt: str = ""
    world_size: int = 0

    def in_domain(self) -> PoolState:
        """This state with only the nodes of the job's domain (all of them when ``domain`` is "")."""
        if not self.domain:
            return self
        return replace(self, nodes=tuple(n for n in self.nodes if n.domain == self.domain))

    def in_state(self, *states: NodeState) -> list[NodeView]:
        """Nodes in any of ``states``, oldest (lowest ordinal) first."""
        return sorted((n for n in self.nodes if n.state in states), key=lambda n: n.ordinal)


@dataclass(frozen=True, slots=True)
class Launch:
    offer_index: int  # position in this daemon's config.offers (the node keeps the offer's key)
    reason: str


@dataclass(frozen=True, slots=True)
class Terminate:
    node_id: str
    reason: str
    # the state the node ends in: terminated (planned) or failed (never came up)
    final_state: NodeState = NodeState.TERMINATED
    # extra fields of its node_terminated event (e.g. the losses a restart answers)
    context: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class MarkLost:
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Admit:
    node_id: str
    reason: str  # job_start | rejoin | no_survivors | join_running | elastic_join | restart (job.command)
    #: job_start: how many nodes are admitted together, whose torchruns wait for each other
    #: before the first round (``rendezvous.start_wait_s``, :mod:`trainer.rendezvous`); 0 otherwise
    cohort: int = 0


@dataclass(frozen=True, slots=True)
class StartJob:
    reason: str


@dataclass(frozen=True, slots=True)
class RestartJob:
    """The job goes back to ``pending``: the next nodes up start it together from its
    newest commit. ``lost``: the nodes whose loss caused it."""

    lost: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class RequestRejoin:
    """Ask the nodes in the job (``ask``) for a rejoin commit; ``nodes`` wait in
    ``admitting`` and are admitted once it is answered."""

    nodes: tuple[str, ...]
    ask: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class EndRejoin:
    """End the grow in flight (``request_id``; ``""``: none is, e.g. after a daemon
    restart): withdraw its request from ``withdraw_from`` and put ``back_to_ready``
    back in ``ready`` (an answered rejoin withdraws nothing)."""

    request_id: str
    reason: str
    withdraw_from: tuple[str, ...] = ()
    back_to_ready: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Drain:
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class NoteFirstReady:
    at: float  # unix s
    reason: str = "first_ready"


@dataclass(frozen=True, slots=True)
class Leave:
    """The node leaves on its own (its agent acts on its notice): ``draining`` now, no
    longer counted as capacity, and no longer awaited by a grow in flight."""

    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class AvoidZone:
    """Replacements prefer a zone other than ``node_id``'s for a while."""

    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class WatchFlush:
    """Notice ``notice_id``'s commit is due by ``due`` (unix s); past it, say so."""

    notice_id: str
    node_id: str
    due: float
    reason: str = "notice flush"


@dataclass(frozen=True, slots=True)
class RequestCheckpoint:
    """Ask ``node_ids`` for a commit at the next step boundary, training on (request ``request_id``)."""

    request_id: str
    node_ids: tuple[str, ...]
    reason: str
    about: str | None = None  # the node the request is about (its event names it), if one


@dataclass(frozen=True, slots=True)
class MarkReplacing:
    """The node stops counting as capacity (a replacement launches) and keeps training
    until the replacement is up; then admission drains it."""

    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class WakeSurvivors:
    """Nodes of the running attempt were lost without notice (``lost``, ids): wake every
    rank of ``attempt`` (``world_size`` ranks) through the rendezvous store, so the
    survivors blocked in a collective on a silent peer re-form without it now
    (:func:`trainer.membership.wake_survivors`), not at the collective's timeout."""

    attempt: str
    world_size: int
    lost: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class JobStalled:
    """The job stalled (:func:`daemon.control.stall.check`): record ``job_stalled`` with
    ``reason``, ``message``, the seconds with no step (``idle_s``) and the bound that
    applied (``bound_s``), then restart the trainers of ``restart`` (node ids) in place,
    under a new rendezvous id; they resume from the newest commit. ``restart`` empty:
    reported only."""

    reason: str
    message: str
    idle_s: float
    bound_s: float
    restart: tuple[str, ...] = ()


Action = Union[Launch, Terminate, MarkLost, Admit, StartJob, RestartJob, RequestRejoin, EndRejoin, Drain,
               NoteFirstReady, Leave, AvoidZone, WatchFlush, RequestCheckpoint, MarkReplacing, WakeSurvivors,
               JobStalled]
