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
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
@given(interval=st.integers(1, 7), target=st.integers(1, 40),
       grows=st.lists(st.integers(0, 40), max_size=4), decisions_again=st.lists(st.integers(0, 40), max_size=3))
def test_each_periodic_step_is_committed_once_wherever_the_group_changes(
        interval: int, target: int, grows: list[int], decisions_again: list[int]) -> None:
    """The boundary protocol over a whole run: ranks decide together (the guard's MAX of
    their views), commit through ``commit_if_asked`` with a ``commit`` that records
    nothing itself (as DeepSpeed's), and at a grow's step a joiner arrives (its loop starts
    there; it takes ``committed_step`` from rank 0, as ``Resizer.send_state`` gives it) and
    the step is decided again; at other steps a shrink's survivors decide it again. Every
    multiple of the interval before the target is committed exactly once, and no other."""
    ranks: list[tuple[ReferenceJob, int]] = []  # (job, the step its loop started at)
    commits: list[int] = []

    def rank(start: int, committed: int | None) -> tuple[ReferenceJob, int]:
        job = _job(start, committed=committed, interval=interval, target=target)
        job.commit = lambda *, reason, decision: commits.append(job.state.step) if job.ctx.is_leader else None
        job.ctx = DistContext(len(ranks), 0, 3, "gloo", torch.device("cpu"), True)
        return job, start

    ranks.append(rank(0, None))
    for step in range(target):
        rounds = 1 + grows.count(step) + decisions_again.count(step)
        for n in range(rounds):
            if 0 < n <= grows.count(step):  # a joiner, admitted at the previous round of this step
                ranks.append(rank(step, ranks[0][0].committed_step))
            for job, _ in ranks:
                job.state.step = step
            agreed = Decision(periodic=any(_due(job, start) for job, start in ranks))
            for job, _ in ranks:
                assert job.commit_if_asked(job._boundary(agreed))
    assert commits == [s for s in range(1, target) if s % interval == 0]
