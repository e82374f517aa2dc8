"""What the daemon measures: Prometheus metrics, the job's timeline, and cost.

- :class:`DaemonMetrics`: a per-daemon ``CollectorRegistry`` (never the global
  one, so one process can run several daemons, as the tests do), served as the
  Prometheus text exposition by ``GET /metrics`` on the control socket and, with
  ``daemon.metrics_port``, on ``daemon.metrics_host:PORT``. Counters are tallied from the
  event log at scrape time (only the events since the last scrape are read), so
  a restarted daemon's counters start from the pool's whole history; gauges are
  read from the supervisor's state at scrape time.
- :func:`job_timeline`: submitted / running durations and recoveries, from events.
- :func:`cost_report`: spot USD spent so far, the on-demand equivalent, savings.

**Goodput** (``spotvisor_goodput_ratio``) is work-based: steps completed ÷ steps
executed = ``step / (step + lost_steps)``, where ``step`` is the job's current
step (the steps the model keeps) and ``lost_steps`` the steps computed and then
discarded by restarts. 1.0: nothing was thrown away. It does not count the time
spent without training (boot, rendezvous, restarts); ``spotvisor_job_running_seconds``
over ``spotvisor_job_total_seconds`` shows that side.

**Lost steps** are counted at each resume as the highest step the trainer had
reported (status lines and heartbeats, so up to one heartbeat late) minus the step
it resumed from: an estimate from the daemon's view. The run summary
(:mod:`daemon.analysis.summary`) counts them exactly from the per-rank step logs.

**Cost**: each node costs its spot price at launch (``price_usd_h``) × the hours
it was held (:meth:`daemon.model.Node.hours_held`: from the launch request, an
upper bound of the cloud's billing start, to its terminal state, or now while it
lives). Changes of the spot price during a node's life are not followed (a cloud
bills them); a failed launch costs nothing. The on-demand equivalent is the offer's
``on_demand_price_usd_h`` (config) × the same hours; a node whose offer has none
is listed as unpriced and left out of the savings.

**Bad values in the log**: the counters are rebuilt from the event log, which may hold
what an older daemon stored unchecked from a node (``bytes: -1``, ``seconds: NaN``,
``lost_steps: true``, a string, a number too large for a float). Such a value is
ignored, never raised (a Prometheus counter refuses a negative increment, and one
raise would fail every scrape, also after a restart): the rest of its event still
counts, one log line (``metrics_event_value_ignored``) names the event, and
``spotvisor_event_values_ignored_total{kind, field}`` counts them. Gauges read from the
supervisor's state show only finite numbers (a series with anything else is left out).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from daemon.control.progress import goodput
from daemon.controlnode.gpu_watch import mean_sm_util
from daemon.controlnode.progress_view import job_progress
from daemon.model import Event, EventKind, JobState, Node, NodeState

if TYPE_CHECKING:
    from daemon.config import OfferSpec
    from daemon.controlnode.supervisor import Supervisor

__all__ = ["DaemonMetrics", "JobTimeline", "job_timeline", "cost_report", "goodput", "TIMELINE_KINDS"]

log = structlog.get_logger("spotvisor.metrics")

_K = EventKind
TIMELINE_KINDS = [k.value for k in (_K.NODE_LAUNCH_REQUESTED, _K.NODE_ADMITTED, _K.JOB_RESUMED, _K.JOB_COMPLETED,
                                    _K.JOB_PAUSING, _K.JOB_UNPAUSED, _K.INTERRUPTION_NOTICE, _K.NODE_LOST)]
_BILLED = frozenset({NodeState.LAUNCHING, NodeState.PREPARING, NodeState.READY, NodeState.ADMITTING,
                     NodeState.RUNNING, NodeState.DRAINING})


# -- timeline -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JobTimeline:
    """The job's durations (seconds) and recoveries, as ``spotctl status`` shows them.

    ``submitted_at``: the first node launch request (unix s). ``started_at``: the
    trainer's first start. ``total_s``: submitted → now (or completion). ``running_s``:
    first start → now (or completion), minus the time paused. ``recoveries``: nodes
    that were in the job and were lost (interruption notice, or gone without one).
    """

    submitted_at: float | None
    started_at: float | None
    ended_at: float | None
    total_s: float | None
    running_s: float | None
    paused_s: float
    recoveries: int

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(self).items()}


def job_timeline(events: Iterable[Event], now: float) -> JobTimeline:
    """Build the timeline from events (any superset of :data:`TIMELINE_KINDS`), oldest first."""
    submitted = started = ended = None
    paused_at: float | None = None
    paused_s = 0.0
    admitted: set[str] = set()
    recovered: set[str] = set()
    for ev in events:
        k = ev.kind
        if k == _K.NODE_LAUNCH_REQUESTED and submitted is None:
            submitted = ev.time
        elif k == _K.JOB_RESUMED and started is None:
            started = ev.time
        elif k == _K.JOB_COMPLETED and ended is None:
            ended = ev.time
        elif k == _K.NODE_ADMITTED and ev.node:
            admitted.add(ev.node)
        elif k in (_K.INTERRUPTION_NOTICE, _K.NODE_LOST) and ev.node in admitted:
            recovered.add(ev.node)
        elif k == _K.JOB_PAUSING and paused_at is None:
            paused_at = ev.time
        elif k == _K.JOB_UNPAUSED and paused_at is not None:
            paused_s += _after(ev.time, started) - _after(paused_at, started)
            paused_at = None
    end = ended if ended is not None else now
    if paused_at is not None:
        paused_s += _after(end, started) - _after(paused_at, started)
    return JobTimeline(
        submitted_at=submitted, started_at=started, ended_at=ended,
        total_s=None if submitted is None else max(0.0, end - submitted),
        running_s=None if started is None else max(0.0, end - started - paused_s),
        paused_s=paused_s, recoveries=len(recovered),
    )


def _after(t: float, start: float | None) -> float:
    """``t`` clipped to the job's first start (pauses before it do not count against running time)."""
    return t if start is None else max(t, start)


# -- cost ---------------------------------------------------------------------------------------
def cost_report(nodes: Sequence[Node], offers: Sequence["OfferSpec"], now: float,
                egress_usd: float = 0.0) -> dict[str, Any]:
    """Spot USD so far, the on-demand equivalent and the savings (derivation: module docstring).

    Args:
        nodes: the pool's nodes (price at launch, offer index, :meth:`Node.hours_held`).
        offers: the config's offers (``on_demand_price_usd_h``, ``market``).
        now: unix s; live nodes are billed up to it.
        egress_usd: what the migrations' checkpoint copies cost (USD: bytes × the source
            domain's ``egress_usd_per_gb``, from the ``checkpoint_replicated`` events).

    Returns a JSON-able dict: ``nodes`` (one row per node that got an instance), totals
    ``spot_usd``, ``on_demand_usd`` and ``savings_usd`` over the priced nodes (None
    when no node is priced), ``savings_pct``, ``unpriced_nodes``, ``spot_usd_h_now``.
    The spot total is the same figure as the final bill in ``pool_released``
    (:meth:`daemon.controlnode.supervisor.Supervisor.spot_cost`).
    """
    rows = []
    spot_total = od_total = spot_priced = 0.0
    unpriced: list[str] = []
    usd_h_now = 0.0
    by_key = {o.key: o for o in offers}
    for n in sorted(nodes, key=lambda n: n.ordinal):
        if n.instance_id is None:
            continue  # never got an instance (failed launch): nothing billed
        hours = n.hours_held(now)
        offer = by_key.get(n.offer_key)
        od_h = None if offer is None else offer.on_demand_price_usd_h
        if offer is not None and offer.market == "on_demand":
            od_h = n.price_usd_h  # an on-demand fallback node costs what it costs: no saving
        spot = n.price_usd_h * hours
        od = None if od_h is None else od_h * hours
        spot_total += spot
        if od is None:
            unpriced.append(n.id)
        else:
            od_total += od
            spot_priced += spot
        if n.state in _BILLED:
            usd_h_now += n.price_usd_h
        rows.append({
            "id": n.id, "offer": _offer_key(offer, n), "market": "spot" if offer is None else offer.market,
            "state": n.state.value, "billed_from": n.created_at,
            "billed_to": n.ended_at if n.ended_at is not None else now, "hours": round(hours, 6),
            "price_usd_h": n.price_usd_h, "spot_usd": round(spot, 6),
            "on_demand_price_usd_h": od_h, "on_demand_usd": None if od is None else round(od, 6),
        })
    priced = len(rows) > len(unpriced)
    savings = od_total - spot_priced if priced else None
    return {
        "as_of": now,
        "nodes": rows,
        "hours": round(sum(r["hours"] for r in rows), 6),
        "spot_usd": round(spot_total, 6),
        "spot_usd_h_now": round(usd_h_now, 6),
        "on_demand_usd": round(od_total, 6) if priced else None,
        "spot_usd_priced": round(spot_priced, 6) if priced else None,
        "savings_usd": None if savings is None else round(savings, 6),
        "savings_pct": None if savings is None or od_total <= 0 else round(100.0 * savings / od_total, 2),
        "unpriced_nodes": unpriced,
        "egress_usd": round(egress_usd, 6),
        # what the on-demand nodes cost: with job.deadline, what keeping the deadline cost
        "on_demand_nodes_usd": round(sum(r["spot_usd"] for r in rows if r["market"] == "on_demand"), 6),
        "how": ("spot: each node's price at launch x its hours held (launch request to its end, or now); "
                "on-demand: its offer's on_demand_price_usd_h x the same hours; savings over the priced nodes only; "
                "egress: each migration's checkpoint bytes copied x its source domain's egress_usd_per_gb"),
    }


def egress_usd(store: Any) -> float:
    """USD of every migration's checkpoint copy so far (the ``checkpoint_replicated`` events)."""
    total = 0.0
    for ev in store.events(kinds=[EventKind.CHECKPOINT_REPLICATED.value]):
        v = _amount(ev.data.get("egress_usd")) if isinstance(ev.data, Mapping) else None
        total += v or 0.0
    return total


def _offer_key(offer: "OfferSpec | None", n: Node) -> str:
    zone = n.zone or "-"
    return f"{n.provider}/{n.region}/{zone}/{n.instance_type}" if offer is None else \
        f"{offer.provider}/{offer.region}/{offer.zone or '-'}/{offer.instance_type}"


# -- Prometheus ---------------------------------------------------------------------------------
_COMMIT_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, float("inf"))
_LABEL_MAX_CHARS = 64  # a label value taken from event data (a commit's reason)


def _finite(v: Any) -> float | None:
    """``v`` as a finite float if it is a real number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int past 1.8e308
        return None
    return f if math.isfinite(f) else None


def _amount(v: Any) -> float | None:
    """``v`` as what a counter may add or a histogram observe: a finite number >= 0, else None."""
    f = _finite(v)
    return f if f is not None and f >= 0 else None


def _label(v: Any, default: str = "unknown") -> str:
    """A label value from event data: a non-empty string (cut, valid UTF-8), else ``default``."""
    if not isinstance(v, str) or not v:
        return default
    return v[:_LABEL_MAX_CHARS].encode("utf-8", "replace").decode("utf-8")


class DaemonMetrics:
    """The daemon's Prometheus metrics in a registry of its own; see the module docstring.

    Constructor does no I/O. :meth:`refresh` tallies the events recorded since the
    last call (it runs before every scrape); :meth:`handler` is the aiohttp handler
    for ``GET /metrics``; :meth:`text` the exposition as a string.
    """

    def __init__(self, sup: "Supervisor") -> None:
        self.sup = sup
        self.registry = CollectorRegistry()
        r = self.registry
        self._seen_seq = 0
        self.lost_steps = 0
        self.events = Counter("spotvisor_events", "Events recorded, by kind.", ["kind"], registry=r)
        for kind in EventKind:  # each kind's series from 0: a first event is an increase, not a new series
            self.events.labels(kind=kind.value)
        self.notices = Counter("spotvisor_interruption_notices", "Spot interruption notices seen by the agents.",
                               ["provider"], registry=r)
        self.rebalances = Counter("spotvisor_rebalance_recommendations", "Rebalance recommendations seen.",
                                  ["provider"], registry=r)
        self.lost = Counter("spotvisor_nodes_lost", "Nodes gone without notice (heartbeat lost, instance gone).",
                            ["provider"], registry=r)
        self.commits = Counter("spotvisor_checkpoints_committed", "Checkpoint commits, by reason.", ["reason"],
                               registry=r)
        self.commit_seconds = Histogram("spotvisor_checkpoint_commit_seconds",
                                        "Seconds from the commit decision to the manifest written.",
                                        buckets=_COMMIT_BUCKETS_S, registry=r)
        self.commit_bytes = Counter("spotvisor_checkpoint_bytes", "Bytes written by committed checkpoints.",
                                    registry=r)
        self.last_commit_bytes = Gauge("spotvisor_checkpoint_last_bytes", "Size of the last committed checkpoint.",
                                       registry=r)
        self.lost_steps_total = Counter("spotvisor_lost_steps",
                                        "Steps computed, then discarded by a restart (daemon's estimate).",
                                        registry=r)
        self.underutilized = Counter("spotvisor_gpu_underutilized", "gpu_underutilized episodes reported.",
                                     registry=r)
        self.migrations = Counter("spotvisor_migrations", "Whole-job migrations between placement domains, "
                                  "by outcome (completed, failed).", ["outcome"], registry=r)
        self.migration_seconds = Gauge("spotvisor_migration_last_seconds", "The last completed migration's "
                                       "seconds from the decision to the first step in the new domain.", registry=r)
        self.replicated_bytes = Counter("spotvisor_checkpoint_replicated_bytes",
                                        "Checkpoint bytes copied between domains' stores by migrations.", registry=r)
        self.egress_usd = Counter("spotvisor_migration_egress_usd", "USD of the migrations' checkpoint copies "
                                  "(bytes x the source domain's egress price).", registry=r)
        self.ignored = Counter("spotvisor_event_values_ignored",
                               "Values in stored events the metrics ignored (negative, not finite, not a number; "
                               "field=event: a whole event that could not be tallied).", ["kind", "field"],
                               registry=r)
        r.register(_StateCollector(self))
        self._inner = make_aiohttp_handler(r)

    def refresh(self) -> None:
        """Tally the events recorded since the last refresh (the whole log the first time).
        Never raises for an event's content: a bad value is ignored (module docstring)."""
        for ev in self.sup.store.events(since=self._seen_seq):
            try:
                self._tally(ev)
            except Exception as exc:  # noqa: BLE001 - one stored event must not fail every scrape
                self._ignore(ev, "event", repr(exc))
            self._seen_seq = ev.seq

    def text(self) -> str:
        self.refresh()
        return generate_latest(self.registry).decode()

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.refresh()
        return await self._inner(request)

    def _provider(self, ev: Event) -> str:
        node = self.sup.nodes.get(ev.node or "")
        return node.provider if node is not None else "unknown"

    def _ignore(self, ev: Event, field: str, value: Any) -> None:
        """A value of ``ev`` that no metric can take: one log line, one count."""
        try:
            shown = repr(value)[:100]
        except Exception:  # noqa: BLE001 - an int past the 4,300-digit limit
            shown = f"<{type(value).__name__}>"
        log.warning("metrics_event_value_ignored", seq=ev.seq, kind=ev.kind, node=ev.node, field=field,
                    value=shown)
        self.ignored.labels(_label(ev.kind), field).inc()

    def _amount(self, ev: Event, d: Mapping[str, Any], key: str) -> float | None:
        """``d[key]`` as a finite number >= 0; None when absent, or ignored (logged, counted)."""
        v = d.get(key)
        if v is None:
            return None
        f = _amount(v)
        if f is None:
            self._ignore(ev, key, v)
        return f

    def _tally(self, ev: Event) -> None:
        d = ev.data
        if not isinstance(d, Mapping):
            self._ignore(ev, "data", d)
            d = {}
        self.events.labels(ev.kind).inc()
        if ev.kind == _K.INTERRUPTION_NOTICE:
            self.notices.labels(self._provider(ev)).inc()
        elif ev.kind == _K.REBALANCE_RECOMMENDATION:
            self.rebalances.labels(self._provider(ev)).inc()
        elif ev.kind == _K.NODE_LOST:
            self.lost.labels(self._provider(ev)).inc()
        elif ev.kind == _K.CHECKPOINT_COMMITTED:
            self.commits.labels(_label(d.get("reason"))).inc()
            seconds = self._amount(ev, d, "seconds")
            if seconds is not None:
                self.commit_seconds.observe(seconds)
            size = self._amount(ev, d, "bytes")
            if size is not None:
                self.commit_bytes.inc(size)
                self.last_commit_bytes.set(size)
        elif ev.kind == _K.JOB_RESUMED and d.get("lost_steps") is not None:
            lost = d["lost_steps"]
            if isinstance(lost, int) and _amount(lost) is not None:  # a count: an int >= 0 (not a bool)
                if lost > 0:
                    self.lost_steps += lost
                    self.lost_steps_total.inc(lost)
            else:
                self._ignore(ev, "lost_steps", lost)
        elif ev.kind == _K.GPU_UNDERUTILIZED:
            self.underutilized.inc()
        elif ev.kind in (_K.MIGRATION_COMPLETED, _K.MIGRATION_FAILED):
            self.migrations.labels("completed" if ev.kind == _K.MIGRATION_COMPLETED else "failed").inc()
            seconds = self._amount(ev, d, "decision_to_first_step_s") if ev.kind == _K.MIGRATION_COMPLETED else None
            if seconds is not None:
                self.migration_seconds.set(seconds)
        elif ev.kind == _K.CHECKPOINT_REPLICATED:
            for key, metric in (("bytes_copied", self.replicated_bytes), ("egress_usd", self.egress_usd)):
                amount = self._amount(ev, d, key)
                if amount is not None:
                    metric.inc(amount)


class _StateCollector:
    """Gauges read from the supervisor's state at scrape time."""

    def __init__(self, m: DaemonMetrics) -> None:
        self.m = m

    def collect(self) -> Iterable[Metric]:
        sup = self.m.sup
        now = sup.clock()
        providers = sorted({o.provider for o in sup.config.offers} | {n.provider for n in sup.nodes.values()})
        nodes = GaugeMetricFamily("spotvisor_nodes", "Nodes by state and provider.", labels=["state", "provider"])
        for p in providers:
            for s in NodeState:
                nodes.add_metric([s.value, p], sum(1 for n in sup.nodes.values() if n.provider == p and n.state is s))
        yield nodes

        job = sup.job
        state = GaugeMetricFamily("spotvisor_job_state", "1 for the job's current state.", labels=["state"])
        for s in JobState:
            state.add_metric([s.value], 1.0 if job.state is s else 0.0)
        yield state
        yield GaugeMetricFamily("spotvisor_job_target_steps", "The job's target step.",
                                value=sup.config.job.target_steps)
        # the job's step and world size come from what nodes reported (stored by an older
        # daemon unchecked): a series shows only a finite number
        step = _finite(job.step)
        if step is not None:
            yield GaugeMetricFamily("spotvisor_job_step", "The job's current step.", value=step)
        world = _finite(job.world_size)
        if world is not None:
            yield GaugeMetricFamily("spotvisor_world_size", "Ranks in the job now.", value=world)
        g = None if step is None else goodput(step, self.m.lost_steps)
        if g is not None:
            yield GaugeMetricFamily("spotvisor_goodput_ratio", "Steps completed / steps executed (1 = none lost).",
                                    value=g)
        yield from _progress_families(job_progress(sup, now, self.m.lost_steps))
        yield GaugeMetricFamily("spotvisor_pool_target_nodes", "The pool's target size (nodes).",
                                value=sup.target_nodes)
        yield GaugeMetricFamily("spotvisor_paused", "1 while the job is paused.",
                                value=1.0 if sup.paused else 0.0)
        dropped = CounterMetricFamily("spotvisor_agent_reports_dropped",
                                      "Agent reports (and heartbeat fields) dropped at the edge: the wrong type, "
                                      "out of bounds, or not the node's to send (daemon/control/reports.py).",
                                      labels=["kind"])
        for kind, n in sorted(getattr(sup, "reports_dropped", {}).items()):
            dropped.add_metric([kind], n)
        yield dropped

        tl = job_timeline(sup.store.events(kinds=TIMELINE_KINDS), now)
        if tl.total_s is not None:
            yield GaugeMetricFamily("spotvisor_job_total_seconds", "Seconds since the job was submitted.",
                                    value=tl.total_s)
        if tl.running_s is not None:
            yield GaugeMetricFamily("spotvisor_job_running_seconds",
                                    "Seconds since the trainer first started, minus time paused.", value=tl.running_s)
        yield CounterMetricFamily("spotvisor_job_recoveries", "Job members lost (notice or not) and recovered from.",
                                  value=tl.recoveries)

        cost = cost_report(list(sup.nodes.values()), sup.config.offers, now, egress_usd=egress_usd(sup.store))
        yield _pool_family(sup)
        domain = GaugeMetricFamily("spotvisor_placement_domain", "1 for the placement domain the job runs in.",
                                   labels=["domain"])
        for d in sup.config.domains_resolved():
            domain.add_metric([d.name], 1.0 if d.name == sup.domain else 0.0)
        yield domain
        yield GaugeMetricFamily("spotvisor_spot_usd_per_hour", "Sum of the spot prices of the nodes billed now.",
                                value=cost["spot_usd_h_now"])
        yield CounterMetricFamily("spotvisor_spot_cost_usd", "Spot USD spent so far (price at launch x hours).",
                                  value=cost["spot_usd"])
        if cost["on_demand_usd"] is not None:
            yield CounterMetricFamily("spotvisor_on_demand_equivalent_usd",
                                      "What the priced nodes' hours would cost on demand.",
                                      value=cost["on_demand_usd"])

        util = GaugeMetricFamily("spotvisor_gpu_sm_utilization_percent",
                                 "NVML utilization.gpu of each GPU of each live node (absent: no GPU).",
                                 labels=["node", "gpu"])
        used = GaugeMetricFamily("spotvisor_gpu_memory_used_bytes", "GPU memory used.", labels=["node", "gpu"])
        total = GaugeMetricFamily("spotvisor_gpu_memory_total_bytes", "GPU memory.", labels=["node", "gpu"])
        for n in sup.nodes.values():
            if n.state.is_terminal():
                continue
            for s in sup.agents.gpu_watch.latest(n.id) or ():
                for fam, value in ((util, s.sm_util_pct), (used, s.mem_used_bytes), (total, s.mem_total_bytes)):
                    v = _finite(value)
                    if v is not None:
                        fam.add_metric([n.id, str(s.index)], v)
        yield util
        yield used
        yield total


#: the progress gauges: (job_progress key, metric name, help)
_PROGRESS = (
    ("steps_per_s", "spotvisor_job_steps_per_second", "Optimizer steps per second over the last 5 minutes "
     "(the leading node's heartbeats; progress kept: a restart's redone steps start the window over)."),
    ("tokens_per_s", "spotvisor_job_tokens_per_second", "Tokens trained per second over the last 5 minutes "
     "(the trainer's step lines' tokens)."),
    ("loss", "spotvisor_job_loss", "The newest step's training loss (absent: none reported, or not finite)."),
    ("expected_finish", "spotvisor_job_expected_finish_timestamp_seconds", "When the job reaches job.target_steps "
     "at the measured step rate (unix seconds)."),
    ("deadline", "spotvisor_job_deadline_timestamp_seconds", "job.deadline (unix seconds)."),
    ("deadline_slack_s", "spotvisor_job_deadline_slack_seconds", "Seconds between the expected finish and "
     "job.deadline (negative: late)."),
)


def _progress_families(p: Mapping[str, Any]) -> Iterable[Metric]:
    """The progress gauges of :func:`~daemon.controlnode.progress_view.job_progress`; a
    value not known (or not finite) has no series."""
    for key, name, help_text in _PROGRESS:
        v = _finite(p.get(key))
        if v is not None:
            yield GaugeMetricFamily(name, help_text, value=v)


def _pool_family(sup: "Supervisor") -> Metric:
    """``spotvisor_pool_nodes{domain, market}``: live nodes (launching to draining) by
    placement domain and market, every configured pair present (0 included)."""
    fam = GaugeMetricFamily("spotvisor_pool_nodes", "Live nodes (launching to draining) by placement domain "
                            "and market (spot, on_demand).", labels=["domain", "market"])
    counts: dict[tuple[str, str], int] = {}
    markets = {o.market for o in sup.config.offers} | {"spot"}
    for d in sup.config.domains_resolved():
        for m in markets:
            counts[(d.name, m)] = 0
    for n in sup.nodes.values():
        if n.state in _BILLED:
            key = (sup.domain_of(n), n.market)
            counts[key] = counts.get(key, 0) + 1
    for (domain, market), c in sorted(counts.items()):
        fam.add_metric([domain, market], c)
    return fam


def node_gpu_view(sup: "Supervisor", node_id: str) -> dict[str, Any] | None:
    """A node's latest GPU sample for ``spotctl`` (None: absent or not heard)."""
    samples = sup.agents.gpu_watch.latest(node_id)
    if samples is None:
        return None
    mean = mean_sm_util(samples)
    return {"sm_util_pct": None if mean is None else round(mean, 1), "gpus": [s.to_dict() for s in samples]}
