"""Chaos cells: one node's token steers nothing (issue 25, items 1-3).

Only the node that leads the running attempt (its workers hold global rank 0,
:mod:`daemon.control.attempts`) changes the job: its start, its commits, its completion
and its heartbeat's step. Another node's claim to lead a new attempt needs another node's
word; a completion needs its final commit read from the store, however long that takes.
Each test runs the real Supervisor (:class:`chaos.conftest.Sim`) with reports as agents
post them; the last one is a hypothesis property over the whole report intake.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.conftest import ChaosProvider, Matrix, Sim, sim_config
from conftest import ManualClock
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor
from daemon.model import JobState, NodeState
from trainer.checkpoint import Manifest, commit, open_store, write_shard

pytestmark = pytest.mark.chaos


def _line(event: str, step: int, attempt: str, **fields: Any) -> dict[str, Any]:
    return {"kind": "trainer_status", "line": {"event": event, "time": time.time(), "attempt": attempt,
                                               "step": step, **fields}}


async def _running(sim: Sim, count: int) -> list:
    nodes = [await sim.launched(i) for i in range(1, count + 1)]
    for n in nodes:
        sim.boot(n)
    await sim.until(lambda: all(n.state is NodeState.RUNNING for n in nodes), what="job start")
    return nodes


def _commit_in_store(sim: Sim, step: int, world_size: int) -> None:
    store = open_store(sim.sup.config.checkpoint_uri())
    info = write_shard(store, step, "model.pt", b"x" * 64)
    commit(store, Manifest(step=step, world_size=world_size, global_batch_size=12,
                           data_position={"consumed_samples": step * 12}, shards=(info,), time=time.time(),
                           extra={"notice_ids": [], "attempt": "a1", "reason": "final"}))


async def _passes(sim: Sim, count: int, advance_s: float) -> None:
    """``count`` reconcile passes, the clock ``advance_s`` later before each."""
    for _ in range(count):
        sim.clock.advance(advance_s)
        seq = sim.store.last_seq()
        sim.sup.wake()
        await sim.sup.wait_for_events(seq, timeout_s=0.05)


async def test_an_unverifiable_completion_is_never_a_completion(make_sim, monkeypatch, matrix: Matrix) -> None:
    """Item 1: the final step's manifest cannot be read (the store out of reach, a
    manifest that is a symlink to itself): rank 0's ``completed`` waits, says so once
    (``completion_unverified``) and completes only when the commit reads back; node 2's
    ``completed`` of a new attempt at rank 0 and the target step is never taken."""
    from daemon.controlnode.job_tracker import CONFIRM_ATTEMPTS, RESUME_HOLD_S
    from trainer.storage import StorageError

    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _running(sim, 2)
        a1 = sim.start([n1, n2], step=0)
        real_read = sim.sup.tracker._read_manifest
        reads: list[int] = []

        def unreachable(step: int) -> None:
            reads.append(step)
            raise StorageError("manifest.json: Too many levels of symbolic links")

        monkeypatch.setattr(sim.sup.tracker, "_read_manifest", unreachable)
        sim.commit(n1, a1, 100, reason="final")
        await sim.until(lambda: sim.events("checkpoint_committed"), what="the final commit, unconfirmed")
        assert sim.events("checkpoint_committed")[0].data["commit_unconfirmed"] is True
        sim.sup.intake.on_reports(n2, [_line("completed", 100, "evil-b", rank=0, world_size=1)])
        sim.complete(n1, a1, 100)
        for _ in range(CONFIRM_ATTEMPTS + 2):
            before = len(reads)
            sim.clock.advance(RESUME_HOLD_S + 1)
            sim.sup.wake()
            await sim.until(lambda: len(reads) > before, what="the final commit read again")
        assert not sim.events("job_completed") and sim.sup.job.state is JobState.RUNNING
        (said,) = sim.events("completion_unverified")  # once, however many reads fail
        assert said.node == n1.id and said.data["step"] == 100 and "symbolic links" in said.data["error"]
        assert sim.provider.live(), "the pool is not released on an unverified completion"
        # the store reads back: the completion is rank 0's, at its attempt
        monkeypatch.setattr(sim.sup.tracker, "_read_manifest", real_read)
        _commit_in_store(sim, 100, world_size=2)
        sim.clock.advance(RESUME_HOLD_S + 1)
        sim.sup.wake()
        await sim.until(lambda: sim.events("job_completed"), what="the verified completion")
        (done,) = sim.events("job_completed")
        assert done.node == n1.id and done.data["attempt"] == a1
        matrix.row("completion whose final commit cannot be read", job_completed=True, lost_checkpoints=0,
                   leaked_instances=0, lost_events=sim.lost_events())


async def test_a_final_manifest_that_is_a_symlink_to_itself_completes_nothing(make_sim) -> None:
    """Item 1 as the probe did it: the final step's ``manifest.json`` replaced by a symlink
    to itself. Rank 0's commit and ``completed`` at the target are reported; the job is
    not completed and the pool is not released."""
    from daemon.controlnode.job_tracker import RESUME_HOLD_S

    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _running(sim, 2)
        a1 = sim.start([n1, n2], step=0)
        _commit_in_store(sim, 100, world_size=2)
        root = Path(sim.sup.config.checkpoint_uri().removeprefix("file://"))
        (manifest,) = [p for p in root.rglob("manifest.json") if "100" in str(p)]
        manifest.unlink()
        manifest.symlink_to(manifest)
        sim.commit(n1, a1, 100, reason="final")
        sim.complete(n1, a1, 100)
        for _ in range(5):
            await _passes(sim, 1, RESUME_HOLD_S + 1)
            await sim.until(lambda: not sim.sup.tracker._confirming, what="the store read")
        assert not sim.events("job_completed") and sim.sup.job.state is JobState.RUNNING
        assert not sim.sup._released.is_set() and sim.provider.live()


async def test_a_completion_of_an_attempt_nobody_leads_is_dropped(make_sim) -> None:
    """Item 1, the report itself: ``completed`` of a new attempt, rank 0, at the target,
    from a node that leads nothing, with its commit in the store: never the job's end."""
    from daemon.controlnode.job_tracker import RESUME_HOLD_S

    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _running(sim, 2)
        sim.start([n1, n2], step=0)
        _commit_in_store(sim, 100, world_size=1)
        sim.sup.intake.on_reports(n2, [_line("checkpoint_committed", 100, "evil-a", rank=0, world_size=1),
                                       _line("completed", 100, "evil-a", rank=0, world_size=1)])
        await _passes(sim, 3, RESUME_HOLD_S + 1)
        assert not sim.events("job_completed") and sim.sup.job.state is JobState.RUNNING
        assert sim.sup.reports_dropped["trainer_status"] >= 1


async def test_a_node_that_does_not_hold_rank_0_cannot_claim_an_attempt(make_sim, matrix: Matrix) -> None:
    """Item 2: node 2's ``started`` of ``evil-a`` at rank 0, world size 1, step 0 records
    nothing (no resume, no world size change, no restart), however long it waits."""
    from daemon.controlnode.job_tracker import RESUME_HOLD_S

    async with make_sim() as sim:
        n1, n2 = await _running(sim, 2)
        sim.start([n1, n2], step=0)
        sim.beat(n1, step=40)
        before = sim.store.last_seq()
        sim.sup.intake.on_reports(n2, [_line("started", 0, "evil-a", rank=0, world_size=1)])
        await _passes(sim, 3, RESUME_HOLD_S + 1)
        assert [e.kind for e in sim.store.events(since=before)] == []
        job = sim.sup.job
        assert (job.attempt, job.world_size, job.step, len(job.attempts)) == ("a1", 2, 40, 1)
        matrix.row("a non-leader claims an attempt", job_completed=None, lost_checkpoints=0,
                   leaked_instances=0, lost_events=sim.lost_events())


async def test_a_new_leader_is_taken_on_another_nodes_word(make_sim) -> None:
    """Rank 0 moves to another node in a restart: the claim waits until the node that
    held rank 0 reports its own workers in the new attempt (rank 1): then it is taken, and
    that node's steps are the job's from then on. A rival claim to the same attempt
    makes neither count."""
    async with make_sim() as sim:
        n1, n2 = await _running(sim, 2)
        sim.start([n1, n2], step=0)
        sim.sup.intake.on_reports(n2, [_line("started", 50, "a2", rank=0, world_size=2, resumed_from=None)])
        assert sim.sup.job.attempt == "a1"  # waits for n1's word
        sim.sup.intake.on_reports(n1, [_line("started", 50, "a2", rank=1, world_size=2)])
        assert sim.sup.job.attempt == "a2" and sim.events("job_resumed")[-1].node == n2.id
        sim.beat(n1, step=70)
        sim.beat(n2, step=60)
        assert sim.sup.job.step == 60  # n2 leads now
        # n1 and n2 both claim rank 0 of a3: neither is taken while n2 ... n2 leads, so its claim stands
        sim.sup.intake.on_reports(n1, [_line("started", 60, "a3", rank=0, world_size=2)])
        sim.sup.intake.on_reports(n2, [_line("started", 60, "a3", rank=0, world_size=2)])
        assert sim.sup.job.attempt == "a3" and sim.events("job_resumed")[-1].node == n2.id


async def test_a_heartbeat_step_counts_only_from_the_leader(make_sim, matrix: Matrix) -> None:
    """Item 3: node 2's heartbeat at step target-1 moves neither ``spotctl status``'s
    step nor the lost steps a later resize records."""
    async with make_sim() as sim:
        n1, n2 = await _running(sim, 2)
        a1 = sim.start([n1, n2], step=0)
        sim.beat(n1, step=30)
        sim.beat(n2, step=99)
        assert sim.sup.job.step == 30 and n2.step == 99
        assert sim.sup.status()["job"]["step"] == 30
        sim.commit(n1, a1, 30, reason="periodic")
        sim.start([n1, n2], step=30, resumed_from=30)
        assert sim.events("job_resumed")[-1].data["lost_steps"] == 0
        matrix.row("a non-leader's heartbeat step", job_completed=None, lost_checkpoints=0,
                   leaked_instances=0, lost_events=sim.lost_events())


# -- the property: non-leader tokens change nothing -------------------------------------------------

TARGET = 100


@contextlib.asynccontextmanager
async def _fresh_sim(root: Path):
    config = sim_config(root, pool={"target_nodes": 3})
    store = Store(root / "state" / "spotvisord.db").open()
    provider, clock = ChaosProvider(), ManualClock(time.time())
    sup = Supervisor(config, provider=provider, store=store, clock=clock)
    sim = Sim(sup, provider, clock, store)
    try:
        await sup.start(agent_url="http://127.0.0.1:9")
        yield sim
    finally:
        await sup.aclose()
        store.close()


def _honest(op: tuple) -> tuple[str, dict[str, Any] | None]:
    """Rank 0's own report for one op of the script: (kind, payload)."""
    kind, arg = op
    if kind == "beat":
        return "beat", {"step": arg}
    if kind == "restart":
        attempt, world = arg
        return "status", _line("started", 0, attempt, rank=0, world_size=world)
    if kind == "commit":
        return "status", _line("checkpoint_committed", arg[1], arg[0], rank=0, reason="periodic", bytes=10)
    return "status", _line("completed", TARGET, arg, rank=0)


_attempt_ids = st.sampled_from(["a1", "r1", "r2", "r3", "evil", "x" * 40])
_hostile = st.one_of(
    st.builds(lambda a, r, s, w, f: ("status", _line("started", s, a, rank=r, world_size=w,
                                                     **({"resumed_from": f} if f is not None else {}))),
              _attempt_ids, st.integers(0, 5), st.integers(0, TARGET), st.integers(1, 6),
              st.none() | st.integers(0, TARGET)),
    st.builds(lambda a, r, s: ("status", _line("completed", s, a, rank=r)), _attempt_ids, st.integers(0, 2),
              st.sampled_from([TARGET, TARGET - 1])),
    st.builds(lambda a, r, s: ("status", _line("checkpoint_committed", s, a, rank=r, bytes=1)), _attempt_ids,
              st.integers(0, 2), st.integers(0, TARGET)),
    st.builds(lambda s: ("beat", {"step": s}), st.integers(0, TARGET)),
)


@st.composite
def _scenarios(draw) -> tuple[list[tuple], list[tuple[int, int, tuple]]]:
    """Rank 0's script on n1 (steps forward, restarts that keep rank 0 on n1, commits, the
    completion last or not at all), and hostile reports from n2 and n3 interleaved at any point."""
    script: list[tuple] = []
    step, restarts = 0, 0
    for _ in range(draw(st.integers(1, 8))):
        choice = draw(st.sampled_from(["beat", "beat", "restart", "commit"]))
        if choice == "beat":
            step = min(TARGET, step + draw(st.integers(1, 30)))
            script.append(("beat", step))
        elif choice == "restart":
            restarts += 1
            script.append(("restart", (f"r{restarts}", draw(st.sampled_from([1, 2, 3])))))
        else:
            script.append(("commit", (f"r{restarts}" if restarts else "a1", step)))
    if draw(st.booleans()):
        current = f"r{restarts}" if restarts else "a1"
        script += [("beat", TARGET), ("commit", (current, TARGET)), ("done", current)]
    hostile = draw(st.lists(st.tuples(st.integers(0, len(script)), st.sampled_from([2, 3]), _hostile), max_size=25))
    return script, hostile


async def _run(root: Path, script: list[tuple], hostile: list[tuple[int, int, tuple]]) -> tuple:
    from daemon.controlnode.job_tracker import RESUME_HOLD_S

    async with _fresh_sim(root) as sim:
        nodes = {i: await sim.launched(i) for i in (1, 2, 3)}
        for n in nodes.values():
            sim.boot(n)
        await sim.until(lambda: all(n.state is NodeState.RUNNING for n in nodes.values()), what="job start")
        sim.start([nodes[1], nodes[2], nodes[3]], step=0)  # attempt a1, led by n1

        def post(node, report: tuple) -> None:
            kind, payload = report
            if kind == "beat":
                sim.sup.agents.on_heartbeat(node, {**payload, "trainer": {"state": "running"}})
            else:
                sim.sup.intake.on_reports(node, [payload])

        for i, op in enumerate([*script, None]):
            for at, who, report in hostile:
                if at == i:
                    post(nodes[who], report)
            if op is not None:
                post(nodes[1], _honest(op))
        sim.clock.advance(RESUME_HOLD_S + 1)
        sim.sup.tracker.confirm_held_resumes()  # what a reconcile pass does with whatever waits
        job = sim.sup.job
        resumed = [(e.node, e.data["attempt"], e.data["world_size"], e.data["step"], e.data["lost_steps"])
                   for e in sim.events("job_resumed")]
        return (job.state, job.step, job.world_size, job.attempt, sorted(job.attempts), resumed,
                [(e.node, e.data["step"]) for e in sim.events("job_completed")])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenarios())
def test_reports_of_tokens_that_do_not_hold_rank_0_change_nothing(scenario) -> None:
    """For any sequence of reports from the tokens of n2 and n3 (any attempt id, rank,
    step, world size, heartbeat step), interleaved anywhere in rank 0's own reports (n1
    leads throughout: a1, then its restarts), the job's recorded state (state, step,
    world size, attempt, the resumes, the completion) is what n1's reports alone give."""
    script, hostile = scenario
    with tempfile.TemporaryDirectory() as alone, tempfile.TemporaryDirectory() as attacked:
        expected = asyncio.run(_run(Path(alone), script, []))
        got = asyncio.run(_run(Path(attacked), script, hostile))
    assert got == expected


async def test_one_token_cannot_queue_commits_without_bound(make_sim) -> None:
    """Commits of attempts nobody leads yet wait for their manifest's read: one node's
    token queues at most VERIFY_PENDING_MAX of them; the leader's own still goes in."""
    from daemon.controlnode.job_tracker import VERIFY_PENDING_MAX

    async with make_sim(daemon={"verify_commits": True}) as sim:
        n1, n2 = await _running(sim, 2)
        a1 = sim.start([n1, n2], step=0)
        sim.sup.intake.on_reports(n2, [_line("checkpoint_committed", s, f"evil-{s}", rank=0, world_size=1)
                                       for s in range(1, 91)])
        queued = sim.sup.tracker._to_verify.qsize()
        assert queued <= VERIFY_PENDING_MAX
        sim.commit(n1, a1, 95, reason="periodic")
        assert sim.sup.tracker._to_verify.qsize() == queued + 1
