"""Types the control plane's parts share: node and job lifecycles, events.

Each lifecycle is a string enum whose members are commented and whose legal
transitions are listed; the store refuses any other transition, so a bug shows
up as an error at the moment it happens, not as a leaked instance later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NewType

__all__ = [
    "NodeId",
    "NodeState",
    "JobState",
    "EventKind",
    "Event",
    "Node",
    "IllegalTransition",
    "TRAINER_STATES",
    "TORCHRUN_ARGV",
]

NodeId = NewType("NodeId", str)


class IllegalTransition(RuntimeError):
    """A lifecycle change that the transition table does not allow."""


class NodeState(str, Enum):
    """Where one node (one spot instance) is in its life.

    requested → launching → ready → (admitting →) running → draining → terminated,
    with ``lost`` (gone without notice) and ``failed`` (launch failed) as the other ends.
    """

    REQUESTED = "requested"  # launch decided, provider call in flight
    LAUNCHING = "launching"  # provider accepted; instance boots; no heartbeat yet
    READY = "ready"  # agent registered; not yet part of the training job
    ADMITTING = "admitting"  # waiting for the job's rejoin checkpoint before joining
    RUNNING = "running"  # its torchrun agent is part of the job
    DRAINING = "draining"  # interruption notice (or drain request): leaving soon
    TERMINATED = "terminated"  # gone, as planned (after a drain, a release, a scale-in)
    LOST = "lost"  # gone without notice (heartbeat lost or provider says it's gone)
    FAILED = "failed"  # the launch itself failed (capacity, quota, boot timeout)

    @classmethod
    def terminal(cls) -> frozenset["NodeState"]:
        return frozenset({cls.TERMINATED, cls.LOST, cls.FAILED})

    def is_terminal(self) -> bool:
        return self in self.terminal()


_S = NodeState
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _S.REQUESTED: frozenset({_S.LAUNCHING, _S.FAILED, _S.TERMINATED}),
    _S.LAUNCHING: frozenset({_S.READY, _S.LOST, _S.FAILED, _S.TERMINATED, _S.DRAINING}),
    _S.READY: frozenset({_S.ADMITTING, _S.RUNNING, _S.DRAINING, _S.LOST, _S.TERMINATED}),
    _S.ADMITTING: frozenset({_S.RUNNING, _S.READY, _S.DRAINING, _S.LOST, _S.TERMINATED}),
    _S.RUNNING: frozenset({_S.DRAINING, _S.LOST, _S.TERMINATED}),
    _S.DRAINING: frozenset({_S.TERMINATED, _S.LOST}),
    _S.TERMINATED: frozenset(),
    _S.LOST: frozenset(),
    _S.FAILED: frozenset(),
}


def check_transition(old: NodeState, new: NodeState) -> None:
    """Raises IllegalTransition unless ``old → new`` is in the table (same state is a no-op)."""
    if old is not new and new not in NODE_TRANSITIONS[old]:
        raise IllegalTransition(f"node state {old.value} → {new.value} is not allowed")


class JobState(str, Enum):
    """The training job's life, as the daemon sees it."""

    PENDING = "pending"  # waiting for the first nodes
    RUNNING = "running"  # at least one node's trainer is part of the job
    COMPLETED = "completed"  # the trainer reported its target step, final checkpoint committed
    FAILED = "failed"  # cannot continue (e.g. no valid world size reachable)
    PAUSED = "paused"  # operator's `spotctl pause`: committed, capacity released; `resume` → pending

    @classmethod
    def terminal(cls) -> frozenset["JobState"]:
        return frozenset({cls.COMPLETED, cls.FAILED})

    def is_terminal(self) -> bool:
        return self in self.terminal()


class EventKind(str, Enum):
    """Every step of the loop (DESIGN.md "The loop", step 8)."""

    NODE_LAUNCH_REQUESTED = "node_launch_requested"
    NODE_LAUNCHED = "node_launched"
    NODE_LAUNCH_FAILED = "node_launch_failed"
    NODE_READY = "node_ready"
    INTERRUPTION_NOTICE = "interruption_notice"
    REBALANCE_RECOMMENDATION = "rebalance_recommendation"
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    # a notice's flush that did not commit by the notice deadline (+ grace): a hung flush is news too
    CHECKPOINT_FLUSH_TIMED_OUT = "checkpoint_flush_timed_out"
    NODE_LOST = "node_lost"
    NODE_TERMINATED = "node_terminated"
    NODE_ADMITTED = "node_admitted"
    WORLD_SIZE_CHANGED = "world_size_changed"
    JOB_RESUMED = "job_resumed"
    JOB_COMPLETED = "job_completed"
    POOL_RELEASED = "pool_released"
    GPU_UNDERUTILIZED = "gpu_underutilized"
    CHAOS_INJECTED = "chaos_injected"
    TRAINER_EXITED = "trainer_exited"
    METADATA_UNREACHABLE = "metadata_unreachable"  # alarm: a streak of failed metadata polls
    METADATA_RECOVERED = "metadata_recovered"
    # pre-flight (daemon/preflight.py): an offer whose GPUs cannot hold the job (never bought),
    # and a checkpoint flush that may not fit a notice window (estimated at start, measured per commit)
    OFFER_UNUSABLE = "offer_unusable"
    CHECKPOINT_DEADLINE_RISK = "checkpoint_deadline_risk"
    # operator actions (spotctl): the target size changed; pause = commit and release every node
    # (job_pausing when asked, job_paused once no capacity is held), resume = job_unpaused
    POOL_SCALED = "pool_scaled"
    JOB_PAUSING = "job_pausing"
    JOB_PAUSED = "job_paused"
    JOB_UNPAUSED = "job_unpaused"


@dataclass(frozen=True, slots=True)
class Event:
    """An immutable record. ``seq`` is monotonic and persisted; ``time`` is unix seconds."""

    seq: int
    time: float
    kind: str
    node: str | None
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "kind": self.kind, "node": self.node, "data": self.data}


# the agent's view of its node's torchrun, as its heartbeats report it: "warming" is
# torchrun's process started and importing, not yet handed the job (daemon/launcher.py)
TRAINER_STATES = frozenset({"not_started", "warming", "running", "exited"})
# the job command an agent can prewarm: python -m torch.distributed.run ...
TORCHRUN_ARGV = ("-m", "torch.distributed.run")


@dataclass(slots=True)
class Node:
    """One node of the pool, as the store keeps it.

    ``price_usd_h``: the offer's spot price at launch (USD/hour); ``gpus``: ranks it
    runs (``nproc_per_node``); times are unix seconds.
    """

    id: str
    ordinal: int
    provider: str
    offer_index: int
    region: str
    zone: str | None
    instance_type: str
    gpus: int
    price_usd_h: float
    token: str
    state: NodeState = NodeState.REQUESTED
    instance_id: str | None = None
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    last_heartbeat: float | None = None
    deadline: float | None = None
    step: int | None = None
    trainer: str = "not_started"  # the agent's view of its torchrun: one of TRAINER_STATES
    replacing: bool = False  # rebalance policy "replace": a replacement is launched, then this node drains
    detail: str = ""
    ended_at: float | None = None  # when it reached a terminal state (terminated / lost / failed)

    def hours_held(self, now: float) -> float:
        """Hours this node's instance was paid for: from the launch request
        (``created_at``, an upper bound of the cloud's billing start) to ``ended_at``
        (or ``now`` while it lives); 0 if no instance was ever obtained."""
        if self.instance_id is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, end - self.created_at) / 3600.0
