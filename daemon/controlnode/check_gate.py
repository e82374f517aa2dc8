"""The cloud check in the daemon: run at start, again on a backoff while one fails, and
the gate on buying (the decisions: :mod:`daemon.controlnode.cloud_check`; the calls:
:mod:`daemon.controlnode.cloud_probe`).

The supervisor's start awaits the first run (each check has its own timeout), so the
first reconcile pass already knows what it may buy; until a run has finished nothing is
bought (fail closed). An offer a failed check concerns is never bought
(:meth:`CheckGate.blocked`, fed into the planner's offer history by the fleet); the
failure is a ``cloud_check_failed`` event (its ``FAIL`` lines, the offers held back, when
it is tried again) and a line of ``spotctl status``. The check runs again after
:func:`~daemon.controlnode.cloud_check.retry_delay_s` (60 s doubling to 10 min), so a
permission granted or an image copied meanwhile is picked up without a restart; once
every check passes, ``cloud_check_passed`` says so and the gate opens.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import structlog

from daemon.controlnode.cloud_check import (CheckResult, blocked_offers, failed, merge_failures, render,
                                            retry_delay_s)
from daemon.controlnode.core import Core
from daemon.model import EventKind

__all__ = ["CheckGate"]

log = structlog.get_logger("spotvisor.daemon")


class CheckGate:
    """See the module docstring. ``run``: one full check (a list of results; it must bound
    its own time). Constructor does no I/O."""

    def __init__(self, core: Core, *, run: Callable[[], Awaitable[list[CheckResult]]]) -> None:
        self.core = core
        self._run = run
        self.results: list[CheckResult] | None = None  # None: no run has finished yet
        self.failures = 0  # failed runs in a row
        self.next_at: float | None = None  # unix s of the next run (None: all passed, none due)
        self._told: tuple[str, ...] = ()  # the FAIL lines the last event carried

    async def check_once(self, ran: list[CheckResult] | None = None) -> list[CheckResult]:
        """Run every check once, record what changed, wake the loop. A crash of the check
        itself counts as a failed check (fail closed), never as a pass. ``ran``: the
        results of a run made just before (an HA standby's, while it waited to lead),
        taken instead of running again."""
        try:
            results = await self._run() if ran is None else list(ran)
        except Exception as exc:  # noqa: BLE001 - the gate must stay closed, and say why
            log.error("cloud_check_crashed", error=repr(exc), exc_info=exc)
            results = [failed("cloud check", f"{type(exc).__name__}: {str(exc)[:300]}",
                              "see the daemon's log (journalctl -u spotvisord)")]
        core = self.core
        now = core.clock()
        self.results = results
        bad = [r for r in merge_failures(results) if not r.ok]
        if bad:
            self.failures += 1
            delay = retry_delay_s(self.failures)
            self.next_at = now + delay
            lines = tuple(render(r) for r in bad)
            log.error("cloud_check_failed", failed=list(lines), retry_in_s=delay, attempt=self.failures)
            if lines != self._told:  # a new or different failure; the same one again is only logged
                core.record(EventKind.CLOUD_CHECK_FAILED, None, failed=list(lines),
                            blocked_offers=sorted(self.blocked()), retry_in_s=delay, retry_at=round(self.next_at, 3),
                            attempt=self.failures)
                self._told = lines
        else:
            if self.failures:
                core.record(EventKind.CLOUD_CHECK_PASSED, None, checks=len(results), after_failures=self.failures)
            log.info("cloud_check_passed", checks=len(results))
            self.failures, self.next_at, self._told = 0, None, ()
        core.wake()
        return results

    async def retry_loop(self) -> None:
        """Run the check again whenever one is due, until every check passes."""
        while self.next_at is not None:
            await asyncio.sleep(max(0.0, self.next_at - self.core.clock()))  # the retry schedule, not sync
            await self.check_once()

    def blocked(self) -> dict[int, str]:
        """Offer index → the failed check that keeps it from being bought (every offer
        before the first run finished)."""
        return blocked_offers(self.results, len(self.core.config.offers))

    def status(self) -> dict[str, Any]:
        """For ``spotctl status``: ``state`` (``pending`` | ``ok`` | ``failing``), the
        ``failed`` lines, the ``blocked_offers`` and ``retry_at`` (unix s)."""
        if self.results is None:
            return {"state": "pending", "failed": [], "blocked_offers": sorted(self.blocked()), "retry_at": None}
        bad = [render(r) for r in merge_failures(self.results) if not r.ok]
        return {"state": "failing" if bad else "ok", "failed": bad, "blocked_offers": sorted(self.blocked()),
                "retry_at": self.next_at}
