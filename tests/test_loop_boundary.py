"""What a step boundary of :class:`trainer.loop.ElasticJob` does, decided from the guard's
decision alone (``ElasticJob._boundary``): when it commits, for what reason, and when the
survivors of a notice shrink in these processes instead of holding for a restart; and when
a rank's loop is due a periodic commit (``trainer.loop.periodic_due``: the guard makes one
rank's due every rank's)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from trainer.batch import ElasticBatch
from trainer.contract import RDZV_ENDPOINT_ENV
from trainer.guard import Decision
from trainer.loop import Boundary, periodic_due
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


def _due(job: ReferenceJob, start: int) -> bool:
    """This rank's view of a periodic commit, as ``ElasticJob._decide`` hands it to the guard."""
    return periodic_due(job.state.step, job.args.checkpoint_interval, start, job.committed_step)


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
    job = _job(step, committed=committed)
    agreed = dataclasses.replace(decision, periodic=_due(job, 0))  # the guard's, one rank alone
    assert job._boundary(agreed) == Boundary(agreed, final=step >= 40, commit=commit, shrink=shrink)


def test_no_periodic_commit_at_the_step_it_resumed_from() -> None:
    assert not _due(_job(10), 10)


def test_a_periodic_commit_any_rank_is_due_is_every_ranks() -> None:
    """Whether to enter a commit's collectives is the agreed decision's, not this rank's view."""
    job = _job(10, committed=10)  # this rank: step 10 is committed already
    assert not _due(job, 0)
    assert job._boundary(Decision(periodic=True)).commit == "periodic"  # another rank was due: commit with it


def test_with_resize_restart_a_notice_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, "127.0.0.1:29400")
    job = _job(7)
    job.args.resize = "restart"
    assert not job.resizes_in_process and not job._boundary(NOTICE).shrink


def test_a_step_the_boundary_committed_is_not_committed_again_when_the_group_changes_there() -> None:
    """A grow at step 10, a periodic commit's step: the old ranks commit, admit the joiner,
    and the new group decides step 10 again. The old ranks must not commit it again: the
    joiner, whose loop starts at step 10, does not, and trains instead (the ranks' collectives
    would not match: the DeepSpeed e2e demo hung 120 s in its first step at world 3). The loop
    records the step, whatever the job's own ``commit`` does."""
    job = _job(10)
    commits: list[str] = []
    job.commit = lambda *, reason, decision: commits.append(reason)  # records nothing itself (DeepSpeedJob's did not)
    assert _due(job, 0)
    assert job.commit_if_asked(job._boundary(Decision(periodic=True))) and commits == ["periodic"]
    assert not _due(job, 0)  # an old rank, the group grown
    assert not _due(job, 10)  # the joiner (its loop starts at step 10)
