"""The node agent's watch on the cloud's metadata endpoint (:mod:`daemon.gpunode.agent`).

:class:`NoticeWatch` polls the metadata dialect (:mod:`daemon.gpunode.metadata`) once per
poll interval and hands each notice it has not seen before to the agent. A poll that gets
no usable answer (:class:`~daemon.gpunode.metadata.base.MetadataUnavailable`) is never a
notice: it is retried with exponential backoff (tenacity, jittered, capped), and a streak
of ``alarm_after`` failures raises one ``metadata_unreachable`` report, followed by one
``metadata_recovered`` when a poll answers again. AWS's rebalance recommendations are
polled beside the notice (:meth:`NoticeWatch.watch_rebalance`), so a slow answer there
never delays the interruption poll.

De-duplication: a cloud gives metadata notices no id; each dialect derives one from the
body (:func:`~daemon.gpunode.metadata.base.notice_id`), and the watch reports a notice
once per id. Example: AWS serves the same ``spot/instance-action`` document on every poll
until the instance goes; the agent hears of it once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from daemon.gpunode.metadata.base import MetadataDialect, MetadataUnavailable, Notice

__all__ = ["NoticeWatch"]

log = structlog.get_logger("spotvisor.agent")


@dataclass(eq=False)
class NoticeWatch:
    """Polls one metadata dialect for this node (see the module docstring).

    Args:
        metadata: the dialect's client (closed by its owner, the agent).
        node_id: this node, for the logs.
        report: queues a report for the daemon (``report(kind, **data)``, never blocks).
        poll_interval_s: seconds between polls (a hanging GET counts as waiting).
        alarm_after: failed polls in a row before ``metadata_unreachable``.
        max_backoff_s: cap of the backoff between failed polls, seconds.

    Attributes:
        failures: failed polls in the current streak (0 while polls answer).
    """

    metadata: MetadataDialect
    _: KW_ONLY
    node_id: str
    report: Callable[..., None]
    poll_interval_s: float = 1.0
    alarm_after: int = 5
    max_backoff_s: float = 5.0
    failures: int = field(default=0, init=False)
    _alarmed: bool = field(default=False, init=False, repr=False)
    # ids of the notices handed on (bounded: a node is interrupted once)
    _seen: set[str] = field(default_factory=set, init=False, repr=False)

    async def watch(self, on_notice: Callable[[Notice], None]) -> None:
        """Poll for good; call ``on_notice`` once for each new interruption notice."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            notice = await self._poll()
            if notice is not None and notice.id not in self._seen:
                self._seen.add(notice.id)
                on_notice(notice)
            # Keep the pace: a hanging GET (GCP) already waited; a plain poll sleeps the
            # rest of the interval (GCP also answers at once after a preemption).
            await asyncio.sleep(max(0.0, self.poll_interval_s - (loop.time() - started)))

    async def watch_rebalance(self) -> None:
        """Rebalance recommendations (AWS), polled for good beside the notice; each new one
        is reported. Its errors are the notice poll's to alarm on: the same endpoint
        answers both."""
        while True:
            try:
                rb = await self.metadata.poll_rebalance()
            except MetadataUnavailable:
                rb = None
            if rb is not None and rb.id not in self._seen:
                self._seen.add(rb.id)
                log.info("rebalance_recommendation", node_id=self.node_id)
                self.report("rebalance_recommendation", notice=rb.to_dict(), seen_at=time.time())
            await asyncio.sleep(self.poll_interval_s)

    async def acknowledge(self, notice: Notice) -> None:
        """Tell the platform it may act on ``notice`` now (Azure; a no-op elsewhere). A
        failure is logged, not raised: the platform then acts at the notice's deadline."""
        try:
            await self.metadata.acknowledge(notice)
            log.info("notice_acknowledged", node_id=self.node_id, notice_id=notice.id)
        except MetadataUnavailable as exc:
            log.warning("notice_ack_failed", node_id=self.node_id, error=str(exc))

    async def _poll(self) -> Notice | None:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(MetadataUnavailable),
            wait=wait_exponential_jitter(multiplier=self.poll_interval_s, max=self.max_backoff_s, jitter=0.5),
            before_sleep=self._failed,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                notice = await self.metadata.poll()
        if self._alarmed:
            log.info("metadata_recovered", node_id=self.node_id, after_failures=self.failures)
            self.report("metadata_recovered", failures=self.failures)
        self.failures = 0
        self._alarmed = False
        return notice

    def _failed(self, state: RetryCallState) -> None:
        self.failures = state.attempt_number
        exc: Any = state.outcome.exception() if state.outcome is not None else None
        log.warning("metadata_unavailable", node_id=self.node_id, error=str(exc), streak=self.failures)
        if self.failures >= self.alarm_after and not self._alarmed:
            self._alarmed = True
            self.report("metadata_unreachable", failures=self.failures, error=str(exc),
                         url=getattr(self.metadata, "base_url", None))
