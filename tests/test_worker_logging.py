"""A worker's log lines after a resize renumbered the ranks (``trainer.runtime.configure_logging``)."""

from __future__ import annotations

import io
import logging

from trainer.runtime import _CurrentRank


def test_a_worker_logs_the_jobs_progress_while_it_is_rank_0_and_names_its_rank_now() -> None:
    """A worker that started as rank 1 logs warnings only; once a resize made it rank 0
    (the first rank 0 left) its progress lines are logged, with the rank it has now."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("rank%(rank)s %(levelname)s %(message)s"))
    current = _CurrentRank(1)
    handler.addFilter(current)
    log = logging.getLogger("spotvisor.test.worker_logging")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(handler)
    try:
        log.info("step 10/150")
        log.warning("a collective failed at step 11")
        current.rank = 0  # what the filter reads from the new group (no group in this test)
        log.info("step 20/150")
    finally:
        log.removeHandler(handler)
    assert out.getvalue().splitlines() == ["rank1 WARNING a collective failed at step 11", "rank0 INFO step 20/150"]
