"""Chaos cells: what one node's agent token can and cannot do to the job, and the causal
order of the event log (issue 13).

A node's token vouches for that node, not for the job: trainer status that changes the
job (``started``, ``checkpoint_committed``, ``completed``) counts only from the node of
the attempt's rank 0, or, for a commit, from the node whose own notice it answers; every
number is bounded at the edge (:mod:`daemon.control.reports`) and a report that fails is dropped
(counted in ``Supervisor.reports_dropped``), never stored. A resume is recorded only after
the commit it resumes from, whichever node reports which.

Each test runs the real Supervisor (the :class:`chaos.conftest.Sim` harness) and
reports as an agent would post them.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from chaos.conftest import Matrix, Sim
from daemon.model import NodeState
from trainer.checkpoint import Manifest, ShardInfo, commit, open_store, write_shard

pytestmark = pytest.mark.chaos


async def _two_running(sim: Sim) -> tuple:
    n1, n2 = await sim.two_running()
    return n1, n2


def _line(event: str, step: int, attempt: str, **fields) -> dict:
    return {"kind": "trainer_status", "line": {"event": event, "time": time.time(), "attempt": attempt,
                                               "step": step, **fields}}


def _kinds(sim: Sim) -> list[tuple[str, dict]]:
    return [(e.kind, e.data) for e in sim.store.events()]


def _commit_in_store(sim: Sim, step: int, world_size: int, notice_ids: tuple[str, ...] = ("n1:abc",)) -> None:
    """What a trainer's rank 0 leaves in the job's store for ``step``."""
    store = open_store(sim.sup.config.checkpoint_uri())
    info: ShardInfo = write_shard(store, step, "model.pt", b"x" * 64)
    commit(store, Manifest(step=step, world_size=world_size, global_batch_size=12,
                           data_position={"consumed_samples": step * 12}, shards=(info,), time=time.time(),
                           extra={"notice_ids": list(notice_ids), "attempt": "a1", "reason": "notice"}))


async def test_a_resume_reported_before_its_commit_is_recorded_after_it(make_sim, matrix: Matrix) -> None:
    """The mass-notice inversion: node 1 (rank 0) is noticed and commits step 26; the
    survivors' shrink (node 2, the new rank 0) reports its resume from 26 before node 1's
    commit report arrives. The log says commit, then resume."""
    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        nid = sim.notice(n1)
        sim.sup.intake.on_reports(n2, [_line("started", 26, "a2", rank=0, world_size=1, resumed_from=26,
                                      resized="in_process")])
        assert not sim.events("job_resumed") or sim.events("job_resumed")[-1].data["resumed_from"] != 26
        sim.commit(n1, a1, 26, ids=(nid,), kinds=("interruption",))  # node 1's report comes later
        kinds = [k for k, d in _kinds(sim) if k in ("checkpoint_committed", "job_resumed")]
        resumed = [d for k, d in _kinds(sim) if k == "job_resumed"]
        assert kinds == ["job_resumed", "checkpoint_committed", "job_resumed"]  # attempt a1, then commit, then a2
        assert resumed[-1]["resumed_from"] == 26 and resumed[-1]["resized"] == "in_process"
        assert sim.sup.job.world_size == 1 and sim.sup.job.resizes_in_process == 1
        matrix.row("resume reported before its commit", job_completed=None, lost_checkpoints=0,
                   leaked_instances=0, lost_events=sim.lost_events())


async def test_a_resume_whose_commit_nobody_reports_is_settled_from_the_store(make_sim, matrix: Matrix) -> None:
    """The committing node dies before its report gets out: after RESUME_HOLD_S the daemon
    reads the commit's manifest from the job's store and records it, then the resume."""
    from daemon.controlnode.job_tracker import RESUME_HOLD_S

    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        sim.start([n1, n2], step=0)
        sim.notice(n1)
        _commit_in_store(sim, 26, world_size=2)
        sim.sup.intake.on_reports(n2, [_line("started", 26, "a2", rank=0, world_size=1, resumed_from=26)])
        sim.sup.intake.on_reports(n2, [_line("started", 30, "a3", rank=0, world_size=1, resumed_from=30)])  # no such commit
        sim.clock.advance(RESUME_HOLD_S + 1)
        sim.sup.wake()
        await sim.until(lambda: len(sim.events("job_resumed")) == 2, what="the held resume settled")
        await sim.until(lambda: sim.sup.reports_dropped["trainer_status"] == 1, what="the unfounded resume dropped")
        kinds = [(k, d.get("step"), d.get("source")) for k, d in _kinds(sim)
                 if k in ("checkpoint_committed", "job_resumed")]
        assert kinds == [("job_resumed", 0, None), ("checkpoint_committed", 26, "store"), ("job_resumed", 26, None)]
        matrix.row("resume whose commit nobody reported", job_completed=None, lost_checkpoints=0,
                   leaked_instances=0, lost_events=sim.lost_events())


async def test_one_nodes_token_cannot_end_or_rewrite_the_job(make_sim, matrix: Matrix) -> None:
    """Defect 2 and 7: node 2 (not rank 0) posts ``completed`` at step 52 of 100, a commit
    of a step that exists nowhere, a world size "pwned", a heartbeat at step 10^12. None
    of it is stored; the job runs on and completes when rank 0 says so at the target."""
    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        sim.beat(n1, step=52)
        before = sim.store.last_seq()
        sim.sup.intake.on_reports(n2, [
            _line("completed", 52, a1, rank=1),  # not rank 0, not the target step
            _line("completed", 100, a1, rank=0),  # claims rank 0 of an attempt node 1 holds
            _line("checkpoint_committed", 99999, a1, rank=0, bytes=10),  # beyond the job's steps
            _line("checkpoint_committed", 40, a1, rank=0, bytes=-1),  # a negative size
            _line("started", 52, "x", rank=0, world_size="pwned"),
            _line("started", 52, "y", rank=0, world_size=1, resumed_from=None, time=float("inf")),
            {"kind": "metadata_unreachable", "failures": float("inf"), "error": "e", "url": "u"},
            {"kind": "interruption_notice", "deadline": float("inf"), "notice": {"id": "n2:1"}},
        ])
        sim.sup.agents.on_heartbeat(n2, {"step": 10**12, "trainer": {"state": "running"}})
        sim.sup.agents.on_heartbeat(n2, {"step": float("nan"), "trainer": {"state": "running"}})
        assert sim.store.last_seq() == before, [e.kind for e in sim.store.events(since=before)]
        assert sim.sup.job.step == 52 and sim.sup.job.world_size == 2
        assert sum(sim.sup.reports_dropped.values()) == 10
        from daemon.controlnode.metrics import DaemonMetrics

        exposition = DaemonMetrics(sim.sup).text()  # one count each, by report kind
        assert 'spotvisor_agent_reports_dropped_total{kind="trainer_status"} 6.0' in exposition
        assert 'spotvisor_agent_reports_dropped_total{kind="heartbeat"} 2.0' in exposition
        assert n2.state is NodeState.RUNNING and n1.state is NodeState.RUNNING
        # the real rank 0 ends the job at its target
        sim.commit(n1, a1, 100, reason="final")
        sim.complete(n1, a1, 100)
        await sim.until(lambda: sim.sup._released.is_set(), what="pool released")
        assert [e.data["step"] for e in sim.events("job_completed")] == [100]
        json.dumps([e.data for e in sim.store.events()], allow_nan=False)  # nothing non-finite was stored
        matrix.row("hostile reports from one node's token", job_completed=True, lost_checkpoints=0,
                   leaked_instances=len(sim.provider.live()), lost_events=sim.lost_events())


async def test_a_noticed_node_reports_the_commit_that_answers_its_own_notice(make_sim) -> None:
    """Node 2 is not rank 0, but the commit names its own notice: that report counts (and
    one naming another node's notice does not)."""
    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        nid = sim.notice(n2)
        sim.sup.intake.on_reports(n2, [_line("checkpoint_committed", 12, a1, rank=1, notice_ids=["chaos-1:ff"])])
        assert not sim.events("checkpoint_committed")
        sim.sup.intake.on_reports(n2, [_line("checkpoint_committed", 12, a1, rank=1, notice_ids=[nid],
                                      kinds=["interruption"], reason="notice", seconds=0.2, bytes=100)])
        (c,) = sim.events("checkpoint_committed")
        assert c.node == n2.id and c.data["step"] == 12 and c.data["notice_ids"] == [nid]
        sim.commit(n1, a1, 12, ids=(nid,), kinds=("interruption",))  # rank 0's own report of it: once per step
        assert len(sim.events("checkpoint_committed")) == 1


async def test_a_held_resume_is_recorded_unconfirmed_when_the_store_is_out_of_reach(make_sim, monkeypatch) -> None:
    """Nobody reported the commit and the control node cannot read the store: after
    CONFIRM_ATTEMPTS reads RESUME_HOLD_S apart, the resume is recorded all the same
    (``commit_unconfirmed``), so the job's world size and step do not freeze."""
    from daemon.controlnode.job_tracker import CONFIRM_ATTEMPTS, RESUME_HOLD_S
    from trainer.storage import StorageError

    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        sim.start([n1, n2], step=0)
        sim.notice(n1)
        reads = []

        def unreachable(step: int):
            reads.append(step)
            raise StorageError("connect timeout")

        monkeypatch.setattr(sim.sup.tracker, "_read_manifest", unreachable)
        sim.sup.intake.on_reports(n2, [_line("started", 26, "a2", rank=0, world_size=1, resumed_from=26)])
        for attempt in range(1, CONFIRM_ATTEMPTS + 1):
            assert len(sim.events("job_resumed")) == 1  # still held
            sim.clock.advance(RESUME_HOLD_S + 1)
            sim.sup.wake()
            await sim.until(lambda: len(reads) == attempt, what=f"manifest read {attempt}")
        await sim.until(lambda: len(sim.events("job_resumed")) == 2, what="the resume recorded")
        resumed = sim.events("job_resumed")[-1]
        assert resumed.data["resumed_from"] == 26 and resumed.data["commit_unconfirmed"] is True
        assert sim.sup.job.world_size == 1


async def test_a_held_resume_goes_on_from_a_manifest_whose_extra_is_malformed(make_sim, monkeypatch) -> None:
    """The manifest read for a held resume verifies but its free-form ``extra`` is not what
    the trainer writes (``notice_ids`` a number): the commit is recorded from the store
    without the ids and the resume after it. (The read used to crash its task and leave
    the step "being read" for good: the resume held forever.)"""
    from types import SimpleNamespace

    from daemon.controlnode.job_tracker import RESUME_HOLD_S

    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        sim.start([n1, n2], step=0)
        sim.notice(n1)
        manifest = SimpleNamespace(extra={"attempt": "a1", "notice_ids": 5}, world_size=2, time=1.0, shards=[])
        monkeypatch.setattr(sim.sup.tracker, "_read_manifest", lambda step: manifest)
        sim.sup.intake.on_reports(n2, [_line("started", 26, "a2", rank=0, world_size=1, resumed_from=26)])
        sim.clock.advance(RESUME_HOLD_S + 1)
        sim.sup.wake()
        await sim.until(lambda: len(sim.events("job_resumed")) == 2, what="the resume recorded")
        (commit,) = [c for c in sim.events("checkpoint_committed") if c.data["step"] == 26]
        assert commit.data["source"] == "store" and commit.data["notice_ids"] == []
        assert "commit_unconfirmed" not in sim.events("job_resumed")[-1].data


async def test_a_commit_is_recorded_only_once_its_manifest_verifies(make_sim, matrix: Matrix) -> None:
    """``daemon.verify_commits`` (the default): rank 0's own report of a commit that is not in
    the store, or whose manifest does not name the notice it claims to answer, is dropped;
    a real one is recorded; ``completed`` waits for its final commit's verification."""
    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        nid = sim.notice(n2)
        sim.commit(n1, a1, 40, reason="periodic")  # nothing in the store at step 40
        _commit_in_store(sim, 50, world_size=2, notice_ids=())
        sim.commit(n1, a1, 50, ids=(nid,), kinds=("interruption",))  # the manifest names no notice
        _commit_in_store(sim, 60, world_size=2, notice_ids=(nid,))
        sim.commit(n1, a1, 60, ids=(nid,), kinds=("interruption",))
        await sim.until(lambda: sim.events("checkpoint_committed"), what="the verified commit")
        assert [(e.data["step"], e.data["notice_ids"]) for e in sim.events("checkpoint_committed")] == [(60, [nid])]
        assert sim.sup.reports_dropped["trainer_status"] == 2
        _commit_in_store(sim, 100, world_size=2, notice_ids=(nid,))
        sim.commit(n1, a1, 100, reason="final")
        sim.complete(n1, a1, 100)  # reported before the final commit is verified: it waits for it
        sim.exit(n2)  # the noticed node left after its commit
        await sim.until(lambda: sim.sup._released.is_set(), what="pool released")
        kinds = [e.kind for e in sim.store.events() if e.kind in ("checkpoint_committed", "job_completed")]
        assert kinds == ["checkpoint_committed", "checkpoint_committed", "job_completed"]
        matrix.row("commits reported that the store does not hold", job_completed=True, lost_checkpoints=0,
                   leaked_instances=len(sim.provider.live()), lost_events=sim.lost_events())


async def test_a_reported_commit_is_settled_before_its_report_is_answered(make_sim, monkeypatch) -> None:
    """An agent's report batch is answered (``POST /v1/agent/events``) only once the commits
    it reported are decided: answered while the manifest was still being read, a daemon
    SIGKILLed in between lost the commit (and the resume held for it), and the agent,
    answered, never sent it again (a clean-clone run of 2026-12-04,
    tests/chaos/test_control_node_kill.py: "the notice's commit never reached the daemon")."""
    import threading

    release = threading.Event()

    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        _commit_in_store(sim, 20, world_size=2, notice_ids=())
        real_read = sim.sup.tracker._read_manifest

        def slow_read(step: int):
            release.wait(30)
            return real_read(step)

        monkeypatch.setattr(sim.sup.tracker, "_read_manifest", slow_read)
        sim.commit(n1, a1, 20, reason="periodic")
        settled = asyncio.create_task(sim.sup.tracker.settled(n1.id, 30))
        done, _ = await asyncio.wait({settled}, timeout=0.3)
        assert not done and not sim.events("checkpoint_committed")  # the answer waits for the read
        release.set()
        assert await settled is True
        assert [e.data["step"] for e in sim.events("checkpoint_committed")] == [20]  # recorded before the answer
        assert await sim.sup.tracker.settled(n1.id, 0.1) is True  # nothing left to wait for


async def test_a_resume_held_for_another_nodes_commit_is_answered_once_that_commit_is_in(make_sim) -> None:
    """The survivor's shrink reports its resume from step 20 before the noticed node's
    commit of 20 is in: the survivor's report batch is not answered while the resume is
    held (answered, a daemon SIGKILLed then lost the resume with its memory: a clean-clone
    CI run of 2026-12-04, tests/chaos/test_control_node_kill.py); the noticed node's commit
    comes, the resume is recorded after it, and then the batch is answered."""
    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        nid = sim.notice(n1)
        _commit_in_store(sim, 20, world_size=2, notice_ids=(nid,))
        sim.start([n2], step=20, resumed_from=20)  # before n1's commit report
        assert sim.sup.tracker.state.undecided(n2.id) == 1 and not sim.events("job_resumed")[1:]
        assert await sim.sup.tracker.settled(n2.id, 0.05) is False  # the batch would not be answered
        answered = asyncio.create_task(sim.sup.tracker.settled(n2.id, 30))
        sim.commit(n1, a1, 20, ids=(nid,), kinds=("interruption",))
        assert await answered is True
        kinds = [(e.kind, e.data["step"]) for e in sim.store.events() if e.kind in ("checkpoint_committed",
                                                                                     "job_resumed")]
        assert kinds[-2:] == [("checkpoint_committed", 20), ("job_resumed", 20)]


async def test_a_commit_is_recorded_unconfirmed_when_the_store_is_out_of_reach(make_sim, monkeypatch) -> None:
    """With the store out of reach for every try, a reported commit is still recorded
    (``commit_unconfirmed``): a flush or a rejoin must not wait for the control node."""
    from daemon.controlnode.job_tracker import CONFIRM_ATTEMPTS
    from trainer.storage import StorageError

    reads = []

    def unreachable(step: int):
        reads.append(step)
        raise StorageError("connect timeout")

    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        monkeypatch.setattr(sim.sup.tracker, "_read_manifest", unreachable)
        sim.commit(n1, a1, 10, reason="periodic")
        await sim.until(lambda: sim.events("checkpoint_committed"), what="the commit, unconfirmed")
        (c,) = sim.events("checkpoint_committed")
        assert c.data["step"] == 10 and c.data["commit_unconfirmed"] is True
        assert reads == [10] * CONFIRM_ATTEMPTS


async def test_a_world_larger_than_the_daemon_admitted_is_flagged(make_sim, matrix: Matrix) -> None:
    """Issue 25, item 11: two nodes of one GPU run the job; rank 0 reports an attempt at
    world size 3 (an outsider joined through the rendezvous store): the daemon records
    ``world_size_mismatch`` beside the resume, once. A world the nodes account for, or a
    smaller one (a joiner still importing, a loss the heartbeats have not shown yet), is
    not flagged."""
    async with make_sim() as sim:
        n1, n2 = await _two_running(sim)
        sim.start([n1, n2], step=0)
        sim.sup.intake.on_reports(n1, [_line("started", 5, "a2", rank=0, world_size=3, resumed_from=None,
                                             resized="in_process", joined=1)])
        sim.sup.intake.on_reports(n1, [_line("started", 5, "a2", rank=0, world_size=3, resumed_from=None)])  # again
        sim.sup.intake.on_reports(n1, [_line("started", 8, "a3", rank=0, world_size=1, resumed_from=None,
                                             resized="in_process")])
        (flag,) = sim.events("world_size_mismatch")
        assert flag.node == n1.id and flag.data == {"attempt": "a2", "world_size": 3, "admitted_ranks": 2,
                                                    "admitted_nodes": 2}
        assert [e.data["world_size"] for e in sim.events("job_resumed")] == [2, 3, 1]  # recorded all the same
        matrix.row("a world larger than the nodes admitted", job_completed=None, lost_checkpoints=0,
                   leaked_instances=0, lost_events=sim.lost_events())


async def test_a_drained_node_is_released_only_once_its_agent_owes_no_report(make_sim) -> None:
    """The noticed node's trainer exited, but its agent still holds the report of the
    commit that answers its notice (a daemon just restarted: the heartbeat got through
    first, the outbox was backing off). Released now, the report dies with the instance;
    so the node is kept until a heartbeat says ``reports_pending: 0``, and the commit is
    recorded."""
    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _two_running(sim)
        a1 = sim.start([n1, n2], step=0)
        nid = sim.notice(n1)
        _commit_in_store(sim, 20, world_size=2, notice_ids=(nid,))
        sim.sup.agents.on_heartbeat(n1, {"step": 20, "trainer": {"state": "exited"}, "reports_pending": 2})
        sim.sup.wake()
        await sim.until(lambda: sim.events("node_launch_requested")[2:], what="the replacement asked for")
        assert n1.state is NodeState.DRAINING  # kept: its reports are owed
        sim.commit(n1, a1, 20, ids=(nid,), kinds=("interruption",))
        sim.exit(n1)  # the reports, then a heartbeat that owes none
        await sim.until(lambda: n1.state is NodeState.TERMINATED, what="the drained node released")
        assert [e.data["notice_ids"] for e in sim.events("checkpoint_committed")] == [[nid]]
