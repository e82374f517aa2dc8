"""The agents' reports (``POST /v1/agent/events``): parsed at the edge, decided, acted on.

Each report is parsed and bounded once (:func:`daemon.control.reports.parse_report`)
into a typed message; a notice or a rebalance recommendation goes to its pure
reaction (:mod:`daemon.control.reactions`) and the supervisor carries out the actions;
a trainer's status line goes to the :class:`~daemon.controlnode.job_tracker.JobTracker`;
a metadata alarm and a trainer's exit are recorded as they are, and a failure of its
workers that torchrun restarts (``workers_failed``) with the job's secrets masked in its
line (the job's tries count it: :mod:`daemon.control.tries`); a node's preparation
(``code_ready``, ``setup_failed``, its line masked the same way) goes to :class:`~daemon.controlnode.code_delivery.CodeDelivery`.
Before any of that, the node's rate limit (:class:`~daemon.controlnode.report_limits.ReportLimiter`) keeps a batch
within its bounds: a node's token cannot make the daemon record events without end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import structlog

from daemon.control.reactions import on_notice, on_rebalance, on_trainer_exit
from daemon.control.reports import (CodeReady, Limits, MetadataAlarm, NoticeReport, ReportError, SetupFailed,
                                    StatusLine, TrainerExited, WorkersFailed, fresh, parse_report)
from daemon.controlnode.code_delivery import CodeDelivery
from daemon.controlnode.core import Core
from daemon.controlnode.report_limits import ReportLimiter
from daemon.gpunode.metadata.registry import DOCUMENTED_LEAD_S
from daemon.model import EventKind, Node, TrainerState

__all__ = ["Intake"]

log = structlog.get_logger("spotvisor.daemon")


class Intake:
    """Applies one agent's batch of reports, in order."""

    def __init__(self, core: Core, *, seen: Callable[[Node], None], on_status: Callable[[Node, StatusLine], None],
                 code: CodeDelivery, published_at: Callable[[Node, str | None, float | None], float | None],
                 redact: Callable[[str], str] = str,
                 failure_count: Callable[[Node, float], dict[str, int]] = lambda node, at: {}) -> None:
        self.core = core
        self._failure_count = failure_count  # JobLife.workers_failed_count: what a workers_failed counts
        self._redact = redact  # NodeLogs.redact: the job's secrets in a line a node sends
        self._seen = seen  # AgentLink.seen: a report is a sign of life
        self._on_status = on_status  # JobTracker.on_status
        self._code = code  # a node's preparation: code_ready, setup_failed
        self._published_at = published_at  # Fleet.notice_published_at
        self.limiter = ReportLimiter(core.clock, is_live=self._is_live)  # per-node rates, before any parsing

    def on_reports(self, node: Node, reports: list[dict[str, Any]], agent: str | None = None) -> None:
        """Apply an agent's batch of reports, in order, each once: a report ``agent``
        numbered that this node's record says was applied is left out
        (:func:`daemon.control.reports.fresh`; the batch came again because its answer was
        lost), and the record keeps the highest number applied. One that cannot be used is dropped
        whole with one log line and one count (``Supervisor.drop``), never stored, and the
        rest of the batch goes on: raising here would answer 500, and the agent resends a
        failed batch until it is accepted, re-applying the reports before the bad one each
        time and holding back every report after it (a notice, a commit) for good.

        Before any of that, the node's limits (:class:`ReportLimiter`) cut the batch: past
        the per-POST cap, a repeat within it, or over the node's rate, a report is counted
        (``spotvisor_agent_reports_limited_total``) and never parsed."""
        core = self.core
        self._seen(node)
        limits = core.limits()
        reports, applied = fresh(reports, agent, node.reports_from, node.reports_applied)
        self._apply(node, reports, limits)
        if agent is not None and (agent, applied) != (node.reports_from, node.reports_applied):
            # written after the batch's own writes: a daemon killed in between applies some
            # reports twice when the batch comes again, never none
            node.reports_from, node.reports_applied = agent, applied
            core.store.put_node(node)

    def _apply(self, node: Node, reports: list[Any], limits: Limits) -> None:
        core = self.core
        for r in self.limiter.admit(node.id, reports):
            kind = r.get("kind") if isinstance(r, dict) else None
            try:
                msg = parse_report(r, limits)
            except ReportError as exc:
                core.drop(node, str(kind)[:40], str(exc), r)
                continue
            if msg is None:
                log.warning("unknown_report", node_id=node.id, kind=str(kind)[:40])
            elif isinstance(msg, NoticeReport) and msg.kind == "interruption_notice":
                self._notice(node, msg)
            elif isinstance(msg, NoticeReport):
                self._rebalance(node, msg)
            elif isinstance(msg, StatusLine):
                self._on_status(node, msg)
            elif isinstance(msg, MetadataAlarm):
                if msg.kind == "metadata_unreachable":
                    core.record(EventKind.METADATA_UNREACHABLE, node.id, failures=msg.failures,
                                error=msg.error, url=msg.url)
                else:
                    core.record(EventKind.METADATA_RECOVERED, node.id, failures=msg.failures)
            elif isinstance(msg, CodeReady):
                self._code.on_ready(node, msg)
            elif isinstance(msg, SetupFailed):  # (the agent masked the secrets it knows; so does the daemon)
                self._code.on_setup_failed(node, replace(msg, last_line=self._redact(msg.last_line)))
            elif isinstance(msg, WorkersFailed):  # the job's count of failed tries, then torchrun's budget
                core.record(EventKind.WORKERS_FAILED, node.id, **self._failure_count(node, core.clock()),
                            torchrun_restarts_left=msg.restarts_left, last_line=self._redact(msg.last_line))
            elif isinstance(msg, TrainerExited):
                node.trainer = TrainerState.EXITED
                core.store.put_node(node)
                core.record(EventKind.TRAINER_EXITED, node.id, exit_code=msg.exit_code)
                for action in on_trainer_exit(core.view(node), exit_code=msg.exit_code,
                                              joined_in_process=node.joins_running):
                    core.act(action)
                core.wake()

    def _is_live(self, node_id: str) -> bool:
        node = self.core.nodes.get(node_id)
        return node is not None and not node.state.is_terminal()

    def _notice(self, node: Node, n: NoticeReport) -> None:
        core = self.core
        node.deadline = n.deadline
        published_at = self._published_at(node, n.provider, node.deadline)
        core.record(EventKind.INTERRUPTION_NOTICE, node.id, notice_id=n.notice_id,
                    action=n.action, deadline=n.notice_deadline, provider=n.provider,
                    notice_published_at=published_at, notice_seen_at=n.seen_at,
                    detection_latency_s=None if published_at is None or n.seen_at is None
                    else round(n.seen_at - published_at, 3))
        view = core.view(node)
        for action in on_notice(view, notice_id=n.notice_id, deadline=node.deadline,
                                lead_s=DOCUMENTED_LEAD_S.get(n.provider or "", 120.0), now=core.clock(),
                                commits=core.config.job.command is None):
            core.act(action)
        core.wake()

    def _rebalance(self, node: Node, n: NoticeReport) -> None:
        """A rebalance recommendation: the pool's ``rebalance_policy`` decides (:func:`on_rebalance`)."""
        core = self.core
        policy = core.config.pool.rebalance_policy
        core.record(EventKind.REBALANCE_RECOMMENDATION, node.id, notice_id=n.notice_id, policy=policy,
                    provider=n.provider, notice_seen_at=n.seen_at)
        for action in on_rebalance(core.view(node), policy=policy, notice_id=n.notice_id):
            core.act(action)
