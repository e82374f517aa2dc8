"""The migration phase machine (daemon/control/migration.py): the transition table, and
the pure step a move in flight takes on each message the migrator reports."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.actions import Drain, NodeView, PoolState, Terminate
from daemon.control.lifecycle import IllegalTransition, JobState, NodeState, TrainerState
from daemon.control.migration import (PHASE_TRANSITIONS, Begin, BootFailed, Booted, CopyDone, CopyFailed, GiveUp,
                                      Migration, MigrationState, Move, Phase, Record, ResetStart, SourceLeft,
                                      StartCopy, TrainedThere, check_phase_transition, source_left, start_overdue,
                                      step, strays, trained_there)

T = 1_000_000.0
MOVE = Move("a", "b", "capacity", {"starved_s": 61.0})


def node(i: int, domain: str, state: NodeState = NodeState.RUNNING) -> NodeView:
    return NodeView(id=f"{domain}{i}", state=state, gpus=1, created_at=T - 100, domain=domain, ordinal=i)


# the job runs on a1 (a2 already gone); the target has b1 up and b2 booting
POOL = PoolState(nodes=(node(1, "a"), node(2, "a", NodeState.TERMINATED), node(1, "b", NodeState.READY),
                        node(2, "b", NodeState.LAUNCHING)), job=JobState.RUNNING, target_nodes=2, domain="a")


def run(*msgs, start: MigrationState | None = None, t0: float = T):
    """The state after ``msgs`` (one second apart from ``t0``) and every effect, in order."""
    st_, effects = start or MigrationState("a"), []
    for i, msg in enumerate(msgs):
        st_, out = step(st_, msg, s=POOL, now=t0 + i)
        effects += out
    return st_, effects


def records(effects) -> dict[str, dict]:
    return {e.kind: dict(e.data) for e in effects if isinstance(e, Record)}


# -- the table ----------------------------------------------------------------------------------

def test_the_table_lists_every_phase_and_only_the_last_two_end_a_move() -> None:
    assert set(PHASE_TRANSITIONS) == set(Phase)
    assert {p for p in Phase if not PHASE_TRANSITIONS[p]} == Phase.terminal() == {Phase.DONE, Phase.FAILED}
    for phase in Phase:  # from every phase a move can still end
        seen, todo = set(), [phase]
        while todo:
            p = todo.pop()
            seen.add(p)
            todo += [q for q in PHASE_TRANSITIONS[p] if q not in seen]
        assert seen & Phase.terminal(), phase


def test_before_the_switch_a_move_can_fail_after_it_only_finish() -> None:
    for phase in (Phase.BOOTING, Phase.COMMITTING, Phase.COPYING):
        check_phase_transition(phase, Phase.FAILED)
    with pytest.raises(IllegalTransition, match="starting → failed"):
        check_phase_transition(Phase.STARTING, Phase.FAILED)
    with pytest.raises(IllegalTransition, match="booting → starting"):  # no switch without the job's commit
        check_phase_transition(Phase.BOOTING, Phase.STARTING)
    with pytest.raises(IllegalTransition, match="copying → copying"):  # a message that moves nothing on
        check_phase_transition(Phase.COPYING, Phase.COPYING)


# -- the step -----------------------------------------------------------------------------------

def test_a_move_runs_from_the_decision_to_the_first_step_in_the_target() -> None:
    st_, effects = run(Begin(MOVE, "mig-1", 10), Booted(drain_seq=42), SourceLeft(commit_step=25),
                       CopyDone({"step": 25, "bytes": 4e9, "bytes_copied": 2e9, "shards_copied": 1}, 0.09),
                       TrainedThere(step=26))
    kinds = [type(e).__name__ if not isinstance(e, Record) else e.kind for e in effects]
    assert kinds == ["migration_started", "Drain", "StartCopy", "checkpoint_replicated", "ResetStart",
                     "migration_completed", "Terminate"]
    assert [e for e in effects if isinstance(e, Drain)] == [Drain("a1", "migration")]  # only the node in the job
    assert StartCopy("mig-1", "a", "b", 25) in effects
    assert [e for e in effects if isinstance(e, Terminate)] == [Terminate("a1", "migrated")]  # the source, at the end
    r = records(effects)
    assert r["migration_started"] == {"migration": "mig-1", "source": "a", "target": "b", "reason": "capacity",
                                      "step": 10, "starved_s": 61.0}
    assert r["checkpoint_replicated"]["egress_usd"] == 0.18  # 2 GB copied at 0.09 USD/GB
    done = r["migration_completed"]
    assert (done["commit_step"], done["step"], done["released"], done["bytes"]) == (25, 26, ["a1"], 4e9)
    assert (done["boot_s"], done["commit_s"], done["copy_s"], done["first_step_s"]) == (1.0, 1.0, 1.0, 1.0)
    assert st_ == MigrationState("b", completed=1, last_ended_at=T + 4)


def test_nothing_committed_yet_switches_at_once_with_nothing_to_copy() -> None:
    st_, effects = run(Begin(MOVE, "mig-1", None), Booted(1), SourceLeft(commit_step=None))
    assert st_.domain == "b" and st_.migration is not None and st_.migration.phase is Phase.STARTING
    assert not [e for e in effects if isinstance(e, StartCopy)]
    assert effects[-1] == ResetStart("migration_switched")


def test_a_move_whose_drain_stopped_no_node_copies_the_newest_commit_at_once() -> None:
    """A move started again after a takeover finds the source empty (its predecessor gave up
    and released the drained nodes): no commit can come, so it copies the newest one at
    once instead of waiting out rejoin_timeout_s while the target's nodes idle. A move that
    drained a node waits for that node's commit; a stored move from before ``drained`` was
    kept waits as it did."""
    gone = PoolState(nodes=(node(1, "a", NodeState.TERMINATED), node(1, "b", NodeState.READY)),
                     job=JobState.PENDING, target_nodes=1, domain="a")
    st_, effects = step(run(Begin(MOVE, "mig-2", 25))[0], Booted(7), s=gone, now=T + 1)
    m = st_.migration
    assert m is not None and m.drained == 0 and not [e for e in effects if isinstance(e, Drain)]
    assert Migration.from_dict(m.to_dict()) == m
    kw = dict(committed=False, last_commit_step=25, job_step=25, rejoin_timeout_s=60.0)
    assert source_left(gone, m, waited_s=0.5, **kw)
    # the predecessor's drain commit (step 32) not recorded yet, and its node still there to
    # report it: moving the periodic one of step 25 would lose 7 steps (HA job trials 19 and
    # 23 of seed 29), so the move waits for the report
    exited = PoolState(nodes=(replace(node(1, "a", NodeState.DRAINING), trainer=TrainerState.EXITED),
                              node(1, "b", NodeState.READY)), job=JobState.PENDING, target_nodes=1, domain="a")
    assert not source_left(exited, m, waited_s=0.5, **{**kw, "job_step": 32})
    assert source_left(exited, m, waited_s=0.5, **{**kw, "job_step": 32, "last_commit_step": 32})
    assert source_left(exited, m, waited_s=60.5, **{**kw, "job_step": 32})  # it never comes: the timeout
    # no node left to report it (trial 23: released by the move given up): the move goes on,
    # and the copy reads the store for it (test_replicate: the migration's copy)
    assert source_left(gone, m, waited_s=0.5, **{**kw, "job_step": 32})
    drained = run(Begin(MOVE, "mig-1", 10), Booted(7))[0].migration
    assert drained is not None and drained.drained == 1
    left = PoolState(nodes=(node(1, "a", NodeState.TERMINATED),), job=JobState.PENDING, target_nodes=1, domain="a")
    assert not source_left(left, drained, waited_s=0.5, **kw)  # its commit is not in yet
    assert source_left(left, drained, waited_s=0.5, **{**kw, "committed": True})
    assert not source_left(POOL, drained, waited_s=0.5, **{**kw, "committed": True})  # a1 still trains
    assert source_left(POOL, drained, waited_s=60.5, **kw)  # a hung trainer: the timeout
    legacy = {k: v for k, v in m.to_dict().items() if k != "drained"}
    assert not source_left(gone, Migration.from_dict(legacy), waited_s=0.5, **kw)


def test_the_move_records_the_commit_it_copied_when_the_store_held_a_newer_one() -> None:
    """The copy found the drain's commit (step 32) in the source's store, its report lost:
    the move and its completion name step 32, not the recorded 25; a copy never goes back."""
    st_, effects = run(Begin(MOVE, "mig-1", 32), Booted(drain_seq=42), SourceLeft(commit_step=25),
                       CopyDone({"step": 32, "bytes": 4e9, "bytes_copied": 4e9, "shards_copied": 1}),
                       TrainedThere(step=33))
    r = records(effects)
    assert r["checkpoint_replicated"]["step"] == 32
    assert r["migration_completed"]["commit_step"] == 32
    st_, _ = run(Begin(MOVE, "mig-1", 32), Booted(drain_seq=42), SourceLeft(commit_step=25),
                 CopyDone({"step": 20, "bytes": 4e9}))
    assert st_.migration is not None and st_.migration.commit_step == 25


def test_a_move_given_up_while_booting_releases_the_target_and_leaves_the_job_alone() -> None:
    st_, effects = run(Begin(MOVE, "mig-1", 10), BootFailed("boot_timeout"))
    assert [e for e in effects if isinstance(e, (Terminate, ResetStart))] == \
        [Terminate("b1", "migration_failed"), Terminate("b2", "migration_failed")]
    assert records(effects)["migration_failed"] == {"migration": "mig-1", "source": "a", "target": "b",
                                                    "phase": "booting", "reason": "boot_timeout", "stays_in": "a"}
    assert st_ == MigrationState("a", failed=1, failed_moves={"b": T + 1})


@pytest.mark.parametrize("last", [CopyFailed("StorageError: shard 3 missing"), GiveUp("paused")])
def test_a_move_given_up_after_the_drain_restarts_the_job_where_it_was(last) -> None:
    st_, effects = run(Begin(MOVE, "mig-1", 10), Booted(1), SourceLeft(commit_step=25), last)
    assert ResetStart("migration_failed") in effects
    assert {e.node_id for e in effects if isinstance(e, Terminate)} == {"a1", "b1", "b2"}
    failed = records(effects)["migration_failed"]
    assert failed["phase"] == "copying" and failed["reason"] in ("copy_failed: StorageError: shard 3 missing",
                                                                  "paused")
    assert st_.domain == "a" and st_.migration is None and st_.failed == 1


@pytest.mark.parametrize("msgs", [
    (Booted(1),),  # no move in flight
    (Begin(MOVE, "mig-1", 0), Begin(MOVE, "mig-2", 0)),  # a second move while one is in flight
    (Begin(MOVE, "mig-1", 0), SourceLeft(3)),  # the job did not leave: nothing drained it
    (Begin(MOVE, "mig-1", 0), CopyDone({})),  # no copy started
    (Begin(MOVE, "mig-1", 0), TrainedThere(5)),  # not switched
    (Begin(MOVE, "mig-1", 0), Booted(1), Booted(2)),  # booted twice
    (Begin(MOVE, "mig-1", 0), Booted(1), SourceLeft(None), GiveUp("paused")),  # after the switch: no way back
])
def test_a_message_that_does_not_fit_the_phase_is_refused(msgs) -> None:
    with pytest.raises(IllegalTransition):
        run(*msgs)


_MESSAGES = st.sampled_from([Begin(MOVE, "mig-1", 0), Booted(1), BootFailed("boot_timeout"), SourceLeft(7),
                             SourceLeft(None), CopyDone({"bytes_copied": 1}), CopyFailed("x"), TrainedThere(9),
                             GiveUp("paused")])


@settings(max_examples=300, deadline=None)
@given(st.lists(_MESSAGES, max_size=12))
def test_in_any_order_of_messages_a_move_only_follows_the_table(msgs) -> None:
    """Whatever the migrator reports, in whatever order: each phase change is one the
    table lists (a refused message changes nothing), the job's domain changes only at the
    switch, the source's nodes are released only once the job trained in the target, and
    the target's only when the move failed."""
    st_ = MigrationState("a")
    for i, msg in enumerate(msgs):
        try:
            new, effects = step(st_, msg, s=POOL, now=T + i)
        except IllegalTransition:
            continue
        old = st_.migration.phase if st_.migration is not None else None
        phase = new.migration.phase if new.migration is not None else None
        if old is not None:
            end = phase if phase is not None else (Phase.DONE if new.completed > st_.completed else Phase.FAILED)
            assert end in PHASE_TRANSITIONS[old] or (old, end) == (Phase.COMMITTING, Phase.STARTING), (old, end)
        assert new.domain == st_.domain or phase is Phase.STARTING
        released = {e.node_id for e in effects if isinstance(e, Terminate)}
        if "a1" in released:
            assert new.completed == st_.completed + 1 or st_.migration.phase in (Phase.COMMITTING, Phase.COPYING)
        if "b1" in released:
            assert new.failed == st_.failed + 1
        st_ = new


def test_a_stored_move_reads_back_as_it_was_and_a_torn_one_is_refused() -> None:
    m = Migration("mig-1", "a", "b", "capacity", T, Phase.COPYING, {"x": 1}, 10, T + 1, 42, T + 2, 25,
                  markets=frozenset({"spot"}))
    raw = m.to_dict()
    assert raw["phase"] == "copying" and raw["markets"] == ["spot"]
    assert Migration.from_dict(raw) == m
    with pytest.raises(ValueError):
        Migration.from_dict({**raw, "phase": "done"})  # never stored: a move ended is none
    with pytest.raises(TypeError):
        Migration.from_dict({**raw, "surprise": 1})


def test_a_switched_move_is_done_once_the_job_steps_past_the_copy_after_resuming_from_it() -> None:
    m = Migration("mig-1", "a", "b", "capacity", T, Phase.STARTING, commit_step=25, committed_at=T + 5,
                  replicated_at=T + 9)
    assert trained_there(m, JobState.RUNNING, 26, T + 10)
    assert not trained_there(m, JobState.RUNNING, 25, T + 10)  # the moved step itself
    assert not trained_there(m, JobState.RUNNING, 26, T + 1)  # resumed before the copy: not from it
    assert not trained_there(m, JobState.PENDING, 30, T + 10)
    assert trained_there(m, JobState.COMPLETED, None, None)


def test_a_switched_move_past_its_deadline_hands_the_job_back_to_the_stall_rules() -> None:
    """The job's domain is the target, its trainers started there, and no step is
    recorded (one trainer died in the first round; the other's claim to rank 0 waits for
    its word): the move can do no more. Until its boot timeout after the copy the move
    answers for the job; past it the stall rules do, and restart the target's trainers
    in place (before, the move waited for good and logged each reconcile pass)."""
    from daemon.control.actions import JobStalled
    from daemon.control.stall import Progress, StallRules, check, recover

    m = Migration("mig-1", "a", "b", "capacity", T, Phase.STARTING, commit_step=25, committed_at=T + 5,
                  replicated_at=T + 9)
    assert not start_overdue(m, T + 9 + 240, 240) and start_overdue(m, T + 9 + 241, 240)
    assert not start_overdue(replace(m, phase=Phase.COPYING), T + 10_000, 240)  # before the switch: its own deadlines
    s = PoolState(nodes=(node(1, "b", NodeState.RUNNING), node(2, "b", NodeState.RUNNING)), job=JobState.RUNNING,
                  target_nodes=2, domain="b")
    rules = StallRules(first_step_s=120, floor_s=60, step_factor=10, exit_grace_s=30)
    waiting = Progress(since=T + 10)
    for now in (T + 200, T + 249):  # the move holds the job: no stall, however long the silence
        assert check(waiting, s, now=now, rules=rules, exit_codes={}, migrating=not start_overdue(m, now, 240)) is None
    stall = check(waiting, s, now=T + 250, rules=rules, exit_codes={}, migrating=not start_overdue(m, T + 250, 240))
    assert stall is not None and stall.reason == "no_step"
    [stalled] = [a for a in recover(s, stall, frozenset({1, 2})) if isinstance(a, JobStalled)]
    assert stalled.restart == ("b1", "b2")


def test_nodes_outside_the_domains_a_job_uses_are_released() -> None:
    s = PoolState(nodes=(node(1, "a"), node(1, "b"), node(1, "c"), node(2, "c", NodeState.TERMINATED),
                         node(3, "c")), job=JobState.RUNNING)
    assert strays(s, {"a", "b"}, but={"c3"}) == [Terminate("c1", "outside_the_job_domain")]
