"""Records the control node keeps: the node row, the event and its kinds.

The lifecycles (node, job, trainer), their transition tables and the named sets
live in :mod:`daemon.control.lifecycle` and are re-exported here for the store's
callers.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NewType

from daemon.control.offers import offer_key
from daemon.control.lifecycle import (IllegalTransition, JobState, NodeState, TrainerState, check_transition)

__all__ = [
    "NodeId",
    "NodeState",
    "JobState",
    "EventKind",
    "Event",
    "Node",
    "TrainerState",
    "IllegalTransition",
    "check_transition",
    "TORCHRUN_ARGV",
    "NODE_ID_RE",
    "is_node_id",
    "MAX_EVENT_SEQ",
    "MAX_NOTICE_LEAD_S",
]

NodeId = NewType("NodeId", str)

# What the control API and spotctl take as a node id (one URL path segment): the daemon's
# own ids are ``<pool>-<ordinal>`` (pool names: ``[a-z0-9][a-z0-9-]{0,62}``); this allows
# more, but never a '/', a '.'/'..' segment, a '?', '%' or a space.
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_node_id(text: object) -> bool:
    """Whether ``text`` is a string of the form :data:`NODE_ID_RE` (whole)."""
    return isinstance(text, str) and NODE_ID_RE.fullmatch(text) is not None


# the largest event seq (SQLite's INTEGER PRIMARY KEY is a signed 64-bit integer): what
# ``spotctl events --since`` and ``GET /v1/events?since=`` take, from 0
MAX_EVENT_SEQ = 2**63 - 1
# ``spotctl simulate-preemption --lead-s``: seconds from the notice to the reclaim, in
# (0, this]; a day is far past any cloud's notice (AWS 120 s, Alibaba 300 s, GCP/Azure 30 s)
MAX_NOTICE_LEAD_S = 86_400.0


class EventKind(str, Enum):
    """Every step of the loop (docs/architecture.md, "The loop", step 8)."""

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
    # a started line whose world size exceeds the GPUs of the nodes in the job: ranks the daemon
    # never admitted train (daemon/control/reactions.py, world_size_mismatch)
    WORLD_SIZE_MISMATCH = "world_size_mismatch"
    JOB_RESUMED = "job_resumed"
    # no progress for a bound (every trainer exited, or no step): reported, and the trainers
    # restarted in place (daemon/control/stall.py); the job_resumed after it is the recovery
    JOB_STALLED = "job_stalled"
    JOB_COMPLETED = "job_completed"
    POOL_RELEASED = "pool_released"
    GPU_UNDERUTILIZED = "gpu_underutilized"
    CHAOS_INJECTED = "chaos_injected"
    TRAINER_EXITED = "trainer_exited"
    # a node's torchrun saw its workers fail and restarts them (daemon/gpunode/launcher.py):
    # ``failed_tries`` (the job's count then, daemon/control/tries.py; absent when it does not
    # count) of ``max_restarts_on_errors``, ``torchrun_restarts_left`` (torchrun's own budget,
    # 1000 for a status-reporting trainer, not the job's), ``last_line`` (the newest exception
    # in its log): a crash loop ends in job_failed, not in hours unseen
    WORKERS_FAILED = "workers_failed"
    METADATA_UNREACHABLE = "metadata_unreachable"  # alarm: a streak of failed metadata polls
    METADATA_RECOVERED = "metadata_recovered"
    # pre-flight (daemon/controlnode/preflight.py): an offer whose GPUs cannot hold the job (never bought),
    # and a checkpoint flush that may not fit a notice window (estimated at start, measured per commit)
    OFFER_UNUSABLE = "offer_unusable"
    CHECKPOINT_DEADLINE_RISK = "checkpoint_deadline_risk"
    # operator actions (spotctl): the target size changed; pause = commit and release every node
    # (job_pausing when asked, job_paused once no capacity is held), resume = job_unpaused
    POOL_SCALED = "pool_scaled"
    JOB_PAUSING = "job_pausing"
    JOB_PAUSED = "job_paused"
    JOB_UNPAUSED = "job_unpaused"
    # the job's life (daemon/controlnode/job_life.py): given up after job.max_restarts_on_errors tries
    # without progress (with the failing node's log tail; every node released, checkpoints kept);
    # spotctl down (job_cancelling when asked, job_cancelled once no node is left); spotctl resume
    # of a failed or cancelled job (job_relaunched)
    JOB_FAILED = "job_failed"
    JOB_CANCELLING = "job_cancelling"
    JOB_CANCELLED = "job_cancelled"
    JOB_RELAUNCHED = "job_relaunched"
    # whole-job migration between placement domains (daemon/control/migration.py)
    MIGRATION_STARTED = "migration_started"
    CHECKPOINT_REPLICATED = "checkpoint_replicated"
    MIGRATION_COMPLETED = "migration_completed"
    MIGRATION_FAILED = "migration_failed"
    # spending to a deadline: the markets the pool may buy from changed (daemon/control/deadline.py)
    MARKET_CHANGED = "market_changed"
    # the job's domain is out of spot capacity and the policy waits for it on the deadline's slack
    # (home_zone: daemon/control/homezone.py), once per outage: its figures say why
    PLACEMENT_WAITING = "placement_waiting"
    # the trainer reported the job complete, but its final commit cannot be read from the store (yet):
    # an unverifiable completion is never a completion; the daemon keeps reading (job_tracker.py)
    COMPLETION_UNVERIFIED = "completion_unverified"
    # code delivery (daemon/controlnode/code_delivery.py): the job.workdir version this daemon run
    # pins (its sha256, uploaded to each domain's store); a node whose fetch, verify or job.setup
    # failed (it is failed and replaced); job.setup_max_failures such failures in a row: the
    # daemon buys no more nodes until it is restarted (node_ready carries each node's code_version)
    CODE_PUBLISHED = "code_published"
    NODE_SETUP_FAILED = "node_setup_failed"
    SETUP_HALTED = "setup_halted"
    # the cloud check (daemon/controlnode/cloud_check.py, also ``spotvisord check``): a check failed, so the
    # offers it concerns are not bought until it passes (it is tried again on a backoff); every check passed
    CLOUD_CHECK_FAILED = "cloud_check_failed"
    CLOUD_CHECK_PASSED = "cloud_check_passed"
    # a quota or auth error at launch: that offer family (aws/us-east-1/p5; the provider, for auth) sits
    # out a backoff (daemon/control/quota.py); the event says when it is tried again
    OFFER_FAMILY_BACKOFF = "offer_family_backoff"
    # the job's rendezvous store did not answer the control node's probes for a while (no node can
    # start training), and answered again (daemon/control/rendezvous_health.py): one of each per outage
    RENDEZVOUS_UNREACHABLE = "rendezvous_unreachable"
    RENDEZVOUS_RECOVERED = "rendezvous_recovered"


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


# the job command an agent can prewarm: python -m torch.distributed.run ...
TORCHRUN_ARGV = ("-m", "torch.distributed.run")
# the job spec's --max-restarts for a torchrun started without spotvisor's launcher (its
# prewarm died), which reports its workers' failures only by its exit (daemon/control/tries.py)
UNREPORTED_MAX_RESTARTS_KEY = "unreported_max_restarts"


@dataclass(slots=True)
class Node:
    """One node of the pool, as the store keeps it.

    ``price_usd_h``: the offer's spot price at launch (USD/hour); ``gpus``: ranks it
    runs (``nproc_per_node``); times are unix seconds.
    """

    id: str
    ordinal: int
    provider: str
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
    trainer: TrainerState = TrainerState.NOT_STARTED  # the agent's view of its torchrun
    replacing: bool = False  # rebalance policy "replace": a replacement is launched, then this node drains
    detail: str = ""
    ended_at: float | None = None  # when it reached a terminal state (terminated / lost / failed)
    market: str = "spot"  # the offer's market: spot or on_demand
    joins_running: bool = False  # admitted into a running job in-process (job.grow: in_process)
    # admitted at the job's start with start_cohort - 1 others: its torchrun waits for theirs
    # until start_until (unix s) before the first round (trainer.rendezvous); 0: no wait
    start_cohort: int = 0
    start_until: float | None = None
    code_version: str = ""  # the job.workdir sha256 its agent was handed ("" none), kept for its life
    # the agent process whose numbered reports were applied, and the highest number applied:
    # a batch sent again (its answer lost with a daemon) is applied once (daemon.control.reports.fresh)
    reports_from: str = ""
    reports_applied: int = 0
    # what its launch call was built from, stored (durably) before the call, so a daemon that
    # finds the node requested after its predecessor died in the call can send it again byte
    # for byte under its client token (daemon.control.launch_replay); None: not recorded
    launch_call: dict[str, Any] | None = None

    @property
    def offer_key(self) -> str:
        """The stable key of the offer this node was bought from (:func:`daemon.control.offers.offer_key`)."""
        return offer_key(self.provider, self.region, self.zone, self.instance_type, self.market)

    def hours_held(self, now: float) -> float:
        """Hours this node's instance was paid for: from the launch request
        (``created_at``, an upper bound of the cloud's billing start) to ``ended_at``
        (or ``now`` while it lives); 0 if no instance was ever obtained."""
        if self.instance_id is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, end - self.created_at) / 3600.0
