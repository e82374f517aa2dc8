"""The job's commits as the store holds them: the daemon's reads of a step's manifest.

A node's report of a commit is a claim; the manifest in the job's checkpoint store
(:func:`trainer.checkpoint.scan_step`: present, and every shard's size and sha256 as it
says) is the fact. :class:`ManifestReader` reads it (blocking: call it in a thread),
:func:`read_retried` retries a store out of reach, :func:`commit_problem` says why a
reported commit does not match what the store holds.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import structlog
from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from daemon.control.reports import StatusLine
from daemon.controlnode.core import Core

__all__ = ["ManifestReader", "read_retried", "commit_problem", "CONFIRM_ATTEMPTS"]

log = structlog.get_logger("spotvisor.daemon")

# reads of a manifest that fail (the store out of reach) before the caller gives up on this round
CONFIRM_ATTEMPTS = 3


class ManifestReader:
    """Reads a step's verified manifest from the job's checkpoint store (its placement domain's)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._client: tuple[str, Any] | None = None  # (uri, the store): one client per store

    def read(self, step: int) -> Any:
        """The verified manifest of ``step``, or None (blocking: a thread).

        Raises:
            trainer.storage.StorageError: the store failed (out of reach, no access).
        """
        from trainer.checkpoint import open_store, scan_step

        domain = self.core.config.domain(self.core.domain)
        uri = self.core.config.checkpoint_uri(domain.name)
        if self._client is None or self._client[0] != uri:
            self._client = (uri, open_store(uri, s3_endpoint_url=domain.s3_endpoint_url,
                                            oss_endpoint=domain.oss_endpoint))
        return scan_step(self._client[1], step)


async def read_retried(read: Callable[[int], Any], step: int) -> Any:
    """``read(step)`` in a thread, :data:`CONFIRM_ATTEMPTS` times at most (1 s, then 2 s apart).

    Raises:
        Exception: the last try's error (the store out of reach or misconfigured).
    """
    async for attempt in AsyncRetrying(
            stop=stop_after_attempt(CONFIRM_ATTEMPTS), wait=wait_exponential(min=1, max=4), reraise=True,
            before_sleep=lambda rs: log.warning("commit_verify_failed", step=step, attempt=rs.attempt_number,
                                                error=str(rs.outcome.exception())[:200] if rs.outcome else None)):
        with attempt:
            return await asyncio.to_thread(read, step)
    return None  # not reached: the last failure is re-raised


def commit_problem(line: StatusLine, manifest: Any, uri: str) -> str | None:
    """Why the store does not bear out a reported commit (None: it does)."""
    if manifest is None:
        return f"step {line.step} is not committed in {uri}"
    named = manifest.extra.get("notice_ids") if isinstance(manifest.extra, dict) else None
    if isinstance(named, list) and not set(line.notice_ids) <= set(named):
        return f"the manifest of step {line.step} does not name notices {sorted(set(line.notice_ids) - set(named))}"
    return None
