"""The event log is causal both ways: a resume never before the commit it resumes from
(tests/chaos/test_trust.py), and a commit never before its own attempt's start.

The survivors of an in-process shrink start a new attempt and may commit at its first
step (a second notice at the same moment); the noticed node reports that commit itself,
and its agent can be faster than rank 0's reporting the attempt's start. Seen once in
tests/chaos/test_mass_notice.py under load: commit 41 (attempt B) was logged before
"resumed from 40" (attempt B).
"""

from __future__ import annotations

import pytest

from chaos.conftest import Sim
from daemon.controlnode.job_tracker import RESUME_HOLD_S

pytestmark = pytest.mark.chaos


async def _two_running(sim: Sim):
    n1, n2 = await sim.two_running()
    sim.start([n1, n2], step=0)
    return n1, n2


def _seq(sim: Sim, kind: str, **match) -> int:
    return next(e.seq for e in sim.events(kind) if all(e.data.get(k) == v for k, v in match.items()))


async def test_a_commit_reported_before_its_attempts_start_is_logged_after_it(make_sim) -> None:
    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        nid = sim.notice(n2)
        sim.commit(n2, "b", 41, ids=(nid,), kinds=("interruption",))  # attempt b's commit, from the noticed node
        assert not [e for e in sim.events("checkpoint_committed") if e.data["step"] == 41]  # held: b not started
        sim._status(n1, "started", 40, attempt="b", world_size=1, resumed_from=None)  # noqa: SLF001
        await sim.until(lambda: [e for e in sim.events("checkpoint_committed") if e.data["step"] == 41],
                        what="the commit, once its attempt started")
        assert _seq(sim, "job_resumed", attempt="b") < _seq(sim, "checkpoint_committed", step=41)


async def test_a_commit_whose_attempt_never_reports_its_start_is_logged_after_the_hold(make_sim) -> None:
    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        nid = sim.notice(n2)
        sim.commit(n2, "c", 12, ids=(nid,), kinds=("interruption",))
        sim.clock.advance(RESUME_HOLD_S + 1)  # rank 0's node died before it reported c's start
        sim.sup.wake()
        await sim.until(lambda: [e for e in sim.events("checkpoint_committed") if e.data["step"] == 12],
                        what="the commit after the hold")
