"""What an outsider may make the daemon spend: connections, reports, feed backlog. Pure.

Whoever reaches the agent port can open connections; whoever holds a node's token can
send reports. Both are bounded here, as decisions of numbers and a clock reading the
edge passes in; the edge (:mod:`daemon.interfaces.listener`,
:mod:`daemon.controlnode.report_limits`, :mod:`daemon.feed.notify`) applies them.

- **Connections** (:func:`connection_caps`): the agent port holds at most ``total``
  connections, sized from the process's open-file limit (``RLIMIT_NOFILE``) less a
  reserve for everything else that needs a descriptor (the store, the feed, the
  providers' HTTP pools, the local provider's pipes, log files), and at most
  ``per_peer`` from one address: what the whole pool's agents need, since a cloud's
  nodes may all reach the daemon through one NAT address.
- **Reports** (:func:`triage`): per node, a batch is cut to
  :data:`MAX_REPORTS_PER_POST`, a report identical to an earlier one of the same batch
  is collapsed into it, and each report takes a token from its node's bucket for its
  :class:`ReportClass` (:class:`TokenBucket`); with none left it is dropped. Vital
  reports (a notice, a commit, the job's end, a trainer's exit) and routine ones (a
  trainer's ``started``, metadata alarms, kinds this daemon does not know) have
  buckets of their own, so a flood of one kind never starves the other. A report
  records at most a few events, so bounding reports bounds the events they record.
- **Feed backlog** (:func:`shed`): a sink more than ``bound`` events behind keeps only
  the newest event of each (kind, node) among the low-value kinds
  (:data:`SHEDDABLE_KINDS`) it reads; every other kind is still delivered.

Example: node n2's token sends 1,000 ``started`` lines at t=0 in ten POSTs of 100. The
routine bucket (burst 30, 1/s) grants the first 30; the other 970 are dropped as
``rate``; ten seconds later 10 more are granted. n2's ``checkpoint_committed`` in the
same POSTs draws on the vital bucket and is kept, and node n1's reports are untouched.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "ConnectionCaps", "connection_caps", "FD_RESERVE_MIN", "CONNECTIONS_PER_NODE", "PEER_SPARE_CONNECTIONS",
    "MIN_CONNECTIONS", "TokenBucket", "ReportClass", "report_class", "Rate", "INTAKE_RATES", "MAX_REPORTS_PER_POST",
    "MAX_AGENT_BODY_BYTES",
    "Triage", "triage", "SHEDDABLE_KINDS", "shed",
]

# -- connections -------------------------------------------------------------------------------
# descriptors kept back from the agent port: at least this many, or an eighth of the limit
FD_RESERVE_MIN = 256
# an agent holds a heartbeat connection, its command long-poll and its reports' connection;
# one more for the overlap when its HTTP pool replaces one
CONNECTIONS_PER_NODE = 4
PEER_SPARE_CONNECTIONS = 16  # a peer's allowance beyond its nodes' (a spotctl-like probe, a retry)
MIN_CONNECTIONS = 64  # below this the daemon refuses to start: raise the open-file limit


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    """The most connections the agent port holds at once: ``total``, and ``per_peer``
    from one remote address."""

    total: int
    per_peer: int


def connection_caps(nofile: int, *, max_nodes: int) -> ConnectionCaps:
    """The agent port's caps for an open-file limit of ``nofile`` descriptors (the soft
    ``RLIMIT_NOFILE``) and a pool of at most ``max_nodes`` nodes.

    ``total`` = ``nofile`` less ``max(FD_RESERVE_MIN, nofile // 8)``; ``per_peer`` =
    ``CONNECTIONS_PER_NODE * max_nodes + PEER_SPARE_CONNECTIONS``, at most ``total``.
    With systemd's ``LimitNOFILE=65536`` (``systemd/spotvisord.service``): 57,344 and,
    for 1,000 nodes, 4,016.

    Raises:
        ValueError: ``total`` would be under :data:`MIN_CONNECTIONS` (one line saying
            how to raise the limit), or ``max_nodes`` < 1.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    total = nofile - max(FD_RESERVE_MIN, nofile // 8)
    if total < MIN_CONNECTIONS:
        need = MIN_CONNECTIONS + FD_RESERVE_MIN
        raise ValueError(f"the open-file limit (RLIMIT_NOFILE) is {nofile}, which leaves the agent port {max(total, 0)} "
                         f"connections; raise it to at least {need} (systemd: LimitNOFILE=; a shell: ulimit -n {need})")
    return ConnectionCaps(total=total, per_peer=min(total, CONNECTIONS_PER_NODE * max_nodes + PEER_SPARE_CONNECTIONS))


# -- report rates ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenBucket:
    """A token bucket: ``tokens`` (at most ``burst``) as of clock reading ``at``
    (seconds), refilled at ``rate_per_s``. Immutable: :meth:`take` returns the new one.
    A clock that goes back refills nothing (and the bucket keeps its later ``at``)."""

    rate_per_s: float
    burst: float
    tokens: float
    at: float

    @classmethod
    def full(cls, rate: "Rate", now: float) -> "TokenBucket":
        return cls(rate.per_s, rate.burst, rate.burst, now)

    def refilled(self, now: float) -> "TokenBucket":
        if not now > self.at:  # also a NaN reading: nothing
            return self
        return replace(self, tokens=min(self.burst, self.tokens + (now - self.at) * self.rate_per_s), at=now)

    def take(self, n: int, now: float) -> tuple[int, "TokenBucket"]:
        """Take up to ``n`` whole tokens at ``now``; returns how many were granted and the bucket after."""
        b = self.refilled(now)
        granted = max(0, min(n, math.floor(b.tokens)))
        return granted, replace(b, tokens=b.tokens - granted)


class ReportClass(str, Enum):
    """Which of a node's buckets a report draws on."""

    VITAL = "vital"  # a notice, a rebalance recommendation, a commit, completed, a trainer's exit or failed workers
    ROUTINE = "routine"  # a trainer's started line, metadata alarms, a kind this daemon does not know, junk


_VITAL_KINDS = frozenset({"interruption_notice", "rebalance_recommendation", "trainer_exited", "workers_failed",
                          "code_ready", "setup_failed"})
_VITAL_LINES = frozenset({"checkpoint_committed", "completed"})


def report_class(kind: object, line_event: object = None) -> ReportClass:
    """The class of a report of ``kind`` (for ``trainer_status``, its line's ``event``);
    anything that is not such a string (a list, a number) is routine."""
    if not isinstance(kind, str):
        return ReportClass.ROUTINE
    if kind in _VITAL_KINDS or (kind == "trainer_status" and isinstance(line_event, str)
                                and line_event in _VITAL_LINES):
        return ReportClass.VITAL
    return ReportClass.ROUTINE


@dataclass(frozen=True, slots=True)
class Rate:
    """A bucket's refill, reports a second, and its size, reports."""

    per_s: float
    burst: float


# Per node. A healthy agent sends a handful of reports a minute: a commit per checkpoint
# (periodic, every few seconds at the fastest), a started line per restart, an alarm per
# metadata outage; a burst is a backlog sent after an outage of the daemon (the agent
# sends at most MAX_REPORTS_PER_POST a request). An attacker with a node's token gets
# ~11 events a second, not the 2,200 a second of issue 25's probe.
INTAKE_RATES: Mapping[ReportClass, Rate] = {
    ReportClass.VITAL: Rate(per_s=10.0, burst=100.0),
    ReportClass.ROUTINE: Rate(per_s=1.0, burst=30.0),
}
MAX_REPORTS_PER_POST = 100
# the most bytes an agent's request body may carry (413 beyond): a heartbeat's trainer.log
# chunk is at most 16 KiB (daemon.gpunode.nodelog), and the agent splits a report batch
# to fit. JSON-decoding 256 KiB takes the loop ~10 ms; 1 MiB (aiohttp's default) ~40 ms
MAX_AGENT_BODY_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Triage:
    """What to do with one batch: ``keep`` the reports at these indices (in order),
    ``dropped`` counts the rest by reason (``too_many``, ``duplicate``, ``rate``), and
    ``buckets`` is the node's buckets after it."""

    keep: tuple[int, ...]
    dropped: Mapping[str, int]
    buckets: Mapping[ReportClass, TokenBucket]


def triage(batch: Sequence[tuple[ReportClass, Hashable]], buckets: Mapping[ReportClass, TokenBucket], *,
           now: float, max_reports: int = MAX_REPORTS_PER_POST) -> Triage:
    """Decide which reports of one node's batch to apply.

    Args:
        batch: per report, in order, its class and a key: two reports with equal keys
            are the same report (the edge uses the report's canonical JSON).
        buckets: the node's bucket per class (a class missing: nothing of it is kept).
        now: the clock reading, seconds.
        max_reports: the most reports one batch may carry; the rest are ``too_many``.

    The first ``max_reports`` are considered; of those, a report whose key appeared
    earlier in the batch is a ``duplicate``; of the rest, per class, the first as many
    as the bucket grants are kept, in order, and the others are ``rate``.
    """
    dropped: Counter[str] = Counter()
    if len(batch) > max_reports:
        dropped["too_many"] = len(batch) - max_reports
    seen: set[Hashable] = set()
    unique: list[int] = []
    for i, (_, key) in enumerate(batch[:max_reports]):
        if key in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(key)
            unique.append(i)
    wanted = Counter(batch[i][0] for i in unique)
    after = dict(buckets)
    grants: dict[ReportClass, int] = {}
    for cls, n in wanted.items():
        bucket = buckets.get(cls)
        if bucket is None:
            grants[cls] = 0
            continue
        grants[cls], after[cls] = bucket.take(n, now)
    keep: list[int] = []
    for i in unique:
        cls = batch[i][0]
        if grants[cls] > 0:
            grants[cls] -= 1
            keep.append(i)
        else:
            dropped["rate"] += 1
    return Triage(keep=tuple(keep), dropped=dict(dropped), buckets=after)


# -- feed backlog ------------------------------------------------------------------------------
# kinds whose newest event of a node says what the older ones said: a sink far behind
# keeps only that one (the reports an agent sends, and the pool's chatter). Everything
# else (notices, commits, flush timeouts, losses, the job's end, migrations) is always sent.
SHEDDABLE_KINDS = frozenset({
    "job_resumed", "world_size_changed", "trainer_exited", "metadata_unreachable", "metadata_recovered",
    "gpu_underutilized", "rebalance_recommendation", "checkpoint_requested", "chaos_injected", "market_changed",
    "offer_unusable",
})


def shed(window: Sequence[tuple[str, str | None]], *, backlog: int, bound: int) -> tuple[bool, ...]:
    """Which events of a sink's read ``window`` (oldest first, each ``(kind, node)``) to
    send, given the sink is ``backlog`` events behind: all of them while ``backlog <=
    bound``; past it, an event of a :data:`SHEDDABLE_KINDS` kind only if no later event
    of the window has the same kind and node. One flag per event, True = send."""
    if backlog <= bound:
        return (True,) * len(window)
    later: set[tuple[str, str | None]] = set()
    keep = [True] * len(window)
    for i in range(len(window) - 1, -1, -1):
        kind_node = window[i]
        if kind_node[0] in SHEDDABLE_KINDS:
            if kind_node in later:
                keep[i] = False
            later.add(kind_node)
    return tuple(keep)
