"""The per-node rate limit on agents' reports, applied before a report is parsed.

:meth:`ReportLimiter.admit` classifies each report of a batch cheaply (its ``kind``,
and a status line's ``event``: two dictionary reads), keys it by its canonical JSON
(a duplicate in the same batch collapses into the first), and lets the pure
:func:`daemon.control.bounds.triage` decide against the node's token buckets; what it
drops is counted per node and reason (``spotvisor_agent_reports_limited_total``, see
:meth:`ReportLimiter.collect`) and logged once per node per :data:`LOG_EVERY_S`, never
per report. What it keeps goes on to :class:`~daemon.controlnode.intake.Intake`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from daemon.control.bounds import INTAKE_RATES, MAX_REPORTS_PER_POST, Rate, ReportClass, TokenBucket, report_class, triage

__all__ = ["ReportLimiter", "LOG_EVERY_S"]

log = structlog.get_logger("spotvisor.daemon")

LOG_EVERY_S = 10.0  # at most one "agent_reports_limited" line per node this often (seconds)


def _key(report: Any) -> str:
    try:
        return json.dumps(report, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError, RecursionError):  # keys of mixed types cannot sort: the report's repr
        return repr(report)


def _class(report: Any) -> ReportClass:
    if not isinstance(report, dict):
        return ReportClass.ROUTINE
    line = report.get("line")
    return report_class(report.get("kind"), line.get("event") if isinstance(line, dict) else None)


class ReportLimiter:
    """Token buckets per node and class (:data:`daemon.control.bounds.INTAKE_RATES`).

    Args:
        clock: unix seconds (the supervisor's clock).
        rates: the buckets' rates per class.
        max_reports: the most reports one POST may carry.
        is_live: whether a node id still counts (its series stay in ``/metrics`` while it does).
    """

    def __init__(self, clock: Callable[[], float], *, rates: Mapping[ReportClass, Rate] = INTAKE_RATES,
                 max_reports: int = MAX_REPORTS_PER_POST, is_live: Callable[[str], bool] = lambda _: True) -> None:
        self._clock = clock
        self._rates = dict(rates)
        self._max_reports = max_reports
        self._is_live = is_live
        self._buckets: dict[str, dict[ReportClass, TokenBucket]] = {}
        self.dropped: Counter[tuple[str, str]] = Counter()  # (node id, reason) -> reports
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, Counter[str]] = {}

    def admit(self, node_id: str, reports: list[Any]) -> list[Any]:
        """The reports of ``node_id``'s batch to apply, in order (the others are counted)."""
        now = self._clock()
        buckets = self._buckets.get(node_id)
        if buckets is None:
            buckets = self._buckets[node_id] = {c: TokenBucket.full(r, now) for c, r in self._rates.items()}
        considered = reports[:self._max_reports]
        decision = triage([(_class(r), _key(r)) for r in considered], buckets, now=now,
                          max_reports=self._max_reports)
        self._buckets[node_id] = dict(decision.buckets)
        too_many = len(reports) - len(considered)
        dropped = Counter(decision.dropped)
        if too_many:
            dropped["too_many"] += too_many
        if dropped:
            for reason, n in dropped.items():
                self.dropped[(node_id, reason)] += n
            self._log(node_id, dropped, now)
        return [considered[i] for i in decision.keep]

    def _log(self, node_id: str, dropped: Counter[str], now: float) -> None:
        pending = self._unlogged.setdefault(node_id, Counter())
        pending.update(dropped)
        last = self._logged_at.get(node_id)
        if last is not None and 0 <= now - last < LOG_EVERY_S:
            return
        self._logged_at[node_id] = now
        log.warning("agent_reports_limited", node_id=node_id, dropped=dict(pending),
                    note=f"at most one line per node per {LOG_EVERY_S:g} s; totals in /metrics")
        pending.clear()

    def collect(self) -> Iterable[Metric]:
        """``spotvisor_agent_reports_limited_total{node, reason}`` for the nodes that still
        count (a prometheus_client custom collector)."""
        fam = CounterMetricFamily("spotvisor_agent_reports_limited",
                                  "Agent reports dropped by the per-node intake limits (daemon/control/bounds.py): "
                                  "over the reports a POST may carry (too_many), a repeat within a POST (duplicate), "
                                  "or over the node's rate (rate).", labels=["node", "reason"])
        for (node, reason), n in sorted(self.dropped.items()):
            if self._is_live(node):
                fam.add_metric([node, reason], n)
        yield fam
