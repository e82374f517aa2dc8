"""What a step boundary of :class:`trainer.loop.ElasticJob` does, decided from the guard's
decision alone (``ElasticJob._boundary``): when it commits, for what reason, and when the
survivors of a notice shrink in these processes instead of holding for a restart."""

from __future__ import annotations

import argparse

import pytest
import torch

from trainer.batch import ElasticBatch
from trainer.contract import RDZV_ENDPOINT_ENV
from trainer.guard import Decision
from trainer.loop import Boundary
from trainer.run import ReferenceJob
from trainer.runtime import DistContext

NOTICE = Decision(True, True, ("n",), ("interruption",), (2,))  # rank 2's node is taken
REJOIN = Decision(True, True, ("r",), ("rejoin",), ())


def _job(step: int, *, committed: int | None = None, interval: int = 10, target: int = 40) -> ReferenceJob:
    """A world of 3 at ``step`` (no group, no model: only what a boundary reads)."""
    job = object.__new__(ReferenceJob)
    job.args = argparse.Namespace(resize="in-process", target_steps=target, checkpoint_interval=interval)
    job.ctx = DistContext(0, 0, 3, "gloo", torch.device("cpu"), True)
    job.G, job.plan = 12, ElasticBatch(12, 1).plan(3)
    job.state = argparse.Namespace(step=step)
    job.committed_step = committed
    return job


@pytest.mark.parametrize("step, committed, decision, commit, shrink", [
    (7, None, Decision(), None, False),  # a plain step: train
    (10, None, Decision(), "periodic", False),  # every --checkpoint-interval steps
    (10, 10, Decision(), None, False),  # the survivors of a shrink are back at a committed step
    (7, None, NOTICE, "notice", True),  # commit, then the survivors go on at world 2
    (7, None, REJOIN, "notice", False),  # a rejoin holds for the restart
    (40, None, NOTICE, "final", False),  # the target step: commit and end, whatever else
])
def test_what_a_boundary_does(monkeypatch: pytest.MonkeyPatch, step: int, committed: int | None,
                              decision: Decision, commit: str | None, shrink: bool) -> None:
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, "127.0.0.1:29400")
    at = _job(step, committed=committed)._boundary(decision, start=0)
    assert at == Boundary(decision, final=step >= 40, commit=commit, shrink=shrink)


def test_no_periodic_commit_at_the_step_it_resumed_from() -> None:
    assert _job(10)._boundary(Decision(), start=10).commit is None


def test_with_resize_restart_a_notice_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, "127.0.0.1:29400")
    job = _job(7)
    job.args.resize = "restart"
    assert not job.resizes_in_process and not job._boundary(NOTICE, start=0).shrink
