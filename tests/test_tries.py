"""The rule that gives a job up (daemon/control/tries.py): tries that fail without
progress, counted in a row; preemptions never count; progress resets the count.
Property tests over arbitrary sequences of observations (hypothesis), plus the
issue's examples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control.lifecycle import JOB_TRANSITIONS, IllegalTransition, JobState, check_job_transition
from daemon.control.tries import Began, Crashed, Disturbed, Ended, Observation, Stepped, Tries, gives_up, observe

LONG_S = 900.0


def fold(obs: list[Observation], t: Tries = Tries()) -> Tries:
    for o in obs:
        t = observe(t, o, long_s=LONG_S)
    return t


def crash_try(at: float, attempt: str | None = None, step: int = 0) -> list[Observation]:
    """A try that begins at ``at`` and exits 1 a second later without a step."""
    return [Began(at, step, attempt), Ended(at + 1, "exit", exit_code=1, node="n1")]


# -- the examples ----------------------------------------------------------------------
def test_a_crash_loop_gives_up_at_the_third_try() -> None:
    t = Tries()
    for i in range(3):
        assert not gives_up(t, 3)
        t = fold(crash_try(10.0 * i), t)
    assert t.failed == 3 and gives_up(t, 3)
    assert t.last == Ended(21.0, "exit", exit_code=1, node="n1")


def test_a_torchrun_exit_after_its_own_restarts_stands_for_its_tries() -> None:
    t = fold([Began(0.0), Ended(9.0, "exit", tries=3, exit_code=1, node="n2")])
    assert gives_up(t, 3)


def test_started_lines_of_torchrun_restarts_are_tries() -> None:
    # status-reporting trainer: torchrun restarts its crashing workers; each attempt is a try
    t = fold([Began(0.0), Began(1.0, 0, "a1"), Began(3.0, 0, "a2"), Began(5.0, 0, "a3"), Began(7.0, 0, "a4")])
    assert t.failed == 3 and t.attempt == "a4"


def test_a_preempted_try_never_counts() -> None:
    t = fold([*crash_try(0.0), *crash_try(10.0), Began(20.0, 0), Disturbed("interruption_notice"),
              Ended(21.0, "exit", exit_code=1)])
    assert t.failed == 2 and not gives_up(t, 3)


def test_progress_resets_the_count() -> None:
    t = fold([*crash_try(0.0), *crash_try(10.0), Began(20.0, 0, "a"), Stepped(5), Ended(50.0, "exit", exit_code=1)])
    assert t.failed == 0
    t = fold(crash_try(60.0, step=5), t)
    assert t.failed == 1


def test_a_long_try_of_a_trainer_reporting_no_step_is_progress() -> None:
    t = fold([*crash_try(0.0), *crash_try(10.0), Began(20.0), Ended(20.0 + LONG_S, "exit", exit_code=1)])
    assert t.failed == 0


def test_the_daemon_starting_more_nodes_of_one_try_is_one_try() -> None:
    t = fold([Began(0.0), Began(0.5), Began(1.0, 0, "a1"), Ended(2.0, "exit", exit_code=1)])
    assert t.failed == 1


def test_a_second_exit_of_the_same_try_counts_once() -> None:
    t = fold([Began(0.0), Ended(1.0, "exit", exit_code=1, node="n1"), Ended(1.2, "exit", exit_code=1, node="n2")])
    assert t.failed == 1


def test_workers_failing_before_their_first_started_line_give_up_at_the_third_failure() -> None:
    """The H200 trial of 2026-12-04: two nodes on one GPU, NCCL refused each start
    ("Duplicate GPU detected") before any started line, and torchrun (max_restarts
    1000) restarted the workers 56 times in 6.5 minutes unseen. Each node's launcher
    now reports each failure; the two nodes failing in one round count once."""
    t = fold([Began(0.0, 0)])
    for i in range(3):
        assert not gives_up(t, 3)
        t = fold([Crashed(5.0 + 7 * i, "n1"), Crashed(5.2 + 7 * i, "n2")], t)
        assert t.failed == i + 1 and not t.running
    assert gives_up(t, 3) and t.last == Ended(19.2, "workers_failed", node="n2")


def test_one_node_crash_looping_alone_is_counted_and_a_step_resets_it() -> None:
    # the first failure ends a try that had trained: it resets the count, the next ones add
    t = fold([Began(0.0, 0, "a"), Stepped(3), Crashed(10.0, "n2"), Crashed(12.0, "n2"), Crashed(14.0, "n2")])
    assert t.failed == 2 and t.crashes == (("n2", 2, 14.0),)
    t = fold([Began(14.0, 3, "b"), Stepped(4)], t)  # the workers came back and trained
    assert t.failed == 0 and t.crashes == ()
    assert fold([Crashed(20.0, "n2")], t).failed == 0  # that try had progressed: not a failure


def test_failures_after_a_preemption_do_not_count() -> None:
    # a peer lost without notice: every survivor's workers fail on their collectives; the
    # first ends the disturbed try, the others are its round: none counts
    t = fold([Began(0.0, 0, "a"), Disturbed("node_lost"), Crashed(1.0, "n1"), Crashed(1.3, "n2"),
              Ended(1.5, "exit", exit_code=1, node="n3")])
    assert t.failed == 0 and not gives_up(t, 1)
    # then they fail again, a crash loop: from that round on it counts
    t = fold([Crashed(8.0, "n1"), Crashed(8.2, "n2")], t)
    assert t.failed == 1 and t.crashes == (("n1", 1, 8.0), ("n2", 1, 8.2))
    # amid a crash loop (no try running): a preemption explains each node's next failure
    t = fold([Crashed(15.0, "n1"), Disturbed("node_lost"), Crashed(16.0, "n1"), Crashed(23.0, "n1")], t)
    assert t.failed == 2 and t.crashes == (("n1", 1, 23.0),)


def test_a_torchrun_exit_after_failures_it_restarted_is_one_more() -> None:
    """``job.command``: torchrun given 2 restarts, so two reported failures and its exit."""
    t = fold([Began(0.0), Crashed(3.0, "n1"), Crashed(6.0, "n1"), Crashed(9.0, "n1", exit_code=1)])
    assert t.failed == 3 and t.last == Ended(9.0, "exit", node="n1", exit_code=1)


def test_workers_of_a_trainer_reporting_no_step_that_ran_long_start_the_count_again() -> None:
    t = fold([Began(0.0), Crashed(1.0, "n1"), Crashed(2.0, "n1"), Crashed(2.0 + LONG_S, "n1")])
    assert t.failed == 2 and t.crashes == (("n1", 1, 2.0 + LONG_S),)


# -- properties ---------------------------------------------------------------------------------
times = st.floats(min_value=0, max_value=1e6, allow_nan=False)
steps = st.integers(min_value=0, max_value=1000)
observations = st.one_of(
    st.builds(Began, times, st.one_of(st.none(), steps), st.one_of(st.none(), st.sampled_from("abcdef"))),
    st.builds(Stepped, steps),
    st.builds(Disturbed, st.sampled_from(["interruption_notice", "node_lost", "node_admitted"])),
    st.builds(Ended, times, st.sampled_from(["exit", "stalled"]), st.integers(1, 5)),
    st.builds(Crashed, times, st.sampled_from(["n1", "n2", "n3"])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(observations, max_size=40))
def test_the_count_never_goes_negative_and_only_ended_tries_add(obs: list[Observation]) -> None:
    t = Tries()
    for o in obs:
        nxt = observe(t, o, long_s=LONG_S)
        assert nxt.failed >= 0
        assert all(c <= nxt.failed for _, c, _ in nxt.crashes)  # no node counts past the job
        if nxt.failed > t.failed and isinstance(o, Crashed):  # a node's workers failed again
            assert nxt.failed - t.failed == 1 and not (t.running and (t.progressed or t.disturbed))
        elif nxt.failed > t.failed:  # else only the end of an undisturbed try without progress adds
            assert t.running and not t.progressed and not t.disturbed
            assert isinstance(o, (Ended, Began))
            assert nxt.failed - t.failed == (o.tries if isinstance(o, Ended) else 1)
        t = nxt


@settings(max_examples=300, deadline=None)
@given(st.lists(observations, max_size=40), st.integers(1, 10))
def test_a_disturbed_try_never_counts(prefix: list[Observation], tries: int) -> None:
    t = fold([*prefix, Ended(2e6 - 1, "exit")])  # whatever ran is over
    before = t.failed
    t = fold([Began(2e6, 0, "z"), Disturbed("node_lost"), Ended(2e6 + 1, "exit", tries=tries)], t)
    assert t.failed <= before and not t.running  # (less: a long try of a trainer reporting no step)


@settings(max_examples=300, deadline=None)
@given(st.lists(observations, max_size=40))
def test_a_step_past_the_start_resets_the_count(prefix: list[Observation]) -> None:
    t = fold([*prefix, Began(2e6, 10, "z"), Stepped(11)])
    assert t.failed == 0 and not gives_up(t, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(observations, max_size=30), st.integers(1, 8))
def test_n_crash_tries_in_a_row_always_give_up(prefix: list[Observation], n: int) -> None:
    t = fold(prefix)
    t = fold([Ended(2e6, "exit")], t)  # whatever ran is over
    for i in range(n):
        t = fold(crash_try(2e6 + 10 * i, attempt=f"c{i}"), t)
    assert gives_up(t, n)


# -- the job's states -------------------------------------------------------------------------
def test_failed_and_cancelled_are_terminal_and_only_resume_leaves_them() -> None:
    for state in (JobState.FAILED, JobState.CANCELLED):
        assert state.is_terminal()
        check_job_transition(state, JobState.PENDING)
        try:
            check_job_transition(state, JobState.RUNNING)
        except IllegalTransition:
            pass
        else:
            raise AssertionError(f"{state} → running must be refused")
    assert JobState.FAILED in JOB_TRANSITIONS[JobState.RUNNING]
    assert JobState.CANCELLED in JOB_TRANSITIONS[JobState.PAUSED]
    assert JOB_TRANSITIONS[JobState.COMPLETED] == frozenset()
