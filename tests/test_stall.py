"""daemon/control/stall.py: when a job that makes no progress is a stall, and what is done
about it. Pure, with an injected clock (``now``): a job whose trainers all exited (the
rendezvous store restarted under them, issue 25), or that reports no step for a bound
from its step time, is reported and its trainers restarted in place; never silent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.control import actions as a
from daemon.control.lifecycle import JobState, NodeState, TrainerState
from daemon.control.stall import STEP_WINDOW, Progress, Stall, StallRules, check, left_behind, observe, recover

T0 = 100_000.0
RULES = StallRules(first_step_s=900.0, floor_s=300.0, step_factor=20.0, exit_grace_s=10.0)
VALID = frozenset({1, 2, 3, 6})
R, X, N = TrainerState.RUNNING, TrainerState.EXITED, TrainerState.NOT_STARTED


def pool(*trainers: TrainerState, job: JobState = JobState.RUNNING, attempt: str = "a1",
         states: tuple[NodeState, ...] = (), started: tuple[str, ...] = (), **kw) -> a.PoolState:
    """Nodes n1, n2, ... running (or ``states``) with these trainers (and the attempts their
    workers last started, ``started``)."""
    nodes = tuple(a.NodeView(id=f"n{i}", state=states[i - 1] if states else NodeState.RUNNING, gpus=1,
                             created_at=0.0, trainer=t, ordinal=i, attempt=started[i - 1] if started else "")
                  for i, t in enumerate(trainers, 1))
    return a.PoolState(nodes=nodes, job=job, attempt=attempt, target_nodes=len(trainers), **kw)


class Run:
    """One job's progress, looked at every ``dt`` seconds (a reconcile pass)."""

    def __init__(self, s: a.PoolState, *, step: int | None = 0) -> None:
        self.now, self.s, self.step = T0, s, step
        self.p = observe(Progress(since=T0), s, step=step, now=T0)

    def look(self, dt: float, *, step: int | None = None, s: a.PoolState | None = None) -> Progress:
        self.now += dt
        self.s = s or self.s
        self.step = self.step if step is None else step
        self.p = observe(self.p, self.s, step=self.step, now=self.now)
        return self.p

    def stall(self, codes: dict[str, int] | None = None, **kw) -> Stall | None:
        return check(self.p, self.s, now=self.now, rules=RULES, exit_codes=codes or {}, **kw)

    def behind(self, codes: dict[str, int], **kw) -> list[a.Action]:
        return left_behind(self.p, self.s, now=self.now, rules=RULES, exit_codes=codes, **kw)

    def train(self, steps: int, step_s: float) -> None:
        for _ in range(steps):
            self.look(step_s, step=self.step + 1)


# -- every trainer exited --------------------------------------------------------------------------------

def test_every_trainer_exited_nonzero_is_a_stall_after_the_grace() -> None:
    """Issue 25's hang: the store restarted empty, every torchrun exited 1 within 5 s, and
    nothing ever happened again. Now: a stall 10 s (exit_grace_s) after the last exit."""
    run = Run(pool(R, R, R))
    run.train(40, 0.5)
    run.look(1.0, s=pool(X, R, R))
    run.look(2.0, s=pool(X, X, X))
    run.look(9.0)
    assert run.stall({"n1": 1, "n2": 1, "n3": 1}) is None  # 9 s: inside the grace
    run.look(1.0)
    stall = run.stall({"n1": 1, "n2": 1, "n3": 1})
    assert stall is not None and stall.reason == "trainers_exited" and stall.bound_s == 10.0
    assert "status 1" in stall.message


def test_every_trainer_exited_zero_is_the_jobs_end_not_a_stall() -> None:
    """Trainers exit 0 only at the job's end, whose completion may still be being verified:
    no restart for that (only the no-step bound, much later, if nothing comes)."""
    run = Run(pool(R, R))
    run.train(10, 0.5)
    run.look(1.0, s=pool(X, X))
    run.look(60.0)
    assert run.stall({"n1": 0, "n2": 0}) is None
    # a status the daemon never heard (a restarted daemon): not known to be the end
    assert run.stall({"n1": 0}).reason == "trainers_exited"


def test_some_trainers_still_running_is_not_the_exit_stall() -> None:
    run = Run(pool(R, R, R))
    run.train(10, 0.5)
    run.look(1.0, s=pool(X, R, R))
    run.look(120.0, step=run.step + 100)  # the others train on
    assert run.stall({"n1": 1}) is None


def test_a_scripts_torchrun_that_exits_nonzero_while_others_run_is_a_stall() -> None:
    """The user's own script reports no step, so no ``no_step`` bound can see it hang. A
    node's torchrun that exits non-zero has closed the rendezvous (torch's launcher does
    on any end but a signal): the others can only exit too or hang where they wait for
    it. Seen in CI: one node's first round failed, the others sat in their group set-up,
    and nothing happened for 10 minutes. Now: a stall after the exit grace."""
    run = Run(pool(R, R, R), step=None)
    run.look(30.0)
    run.look(1.0, s=pool(X, R, R))
    run.look(9.0)
    assert run.stall({"n1": 1}, steps_expected=False) is None  # inside the grace: they may exit on their own
    run.look(1.0)
    stall = run.stall({"n1": 1}, steps_expected=False)
    assert stall is not None and stall.reason == "rendezvous_closed" and stall.bound_s == 10.0
    assert "n1 (status 1)" in stall.message and "2 trainer(s) still run" in stall.message
    # recovered: a new wait, the restarted trainers get the grace anew (doubled: no progress came)
    run.p = run.p.recovered(run.now)
    run.look(1.0, s=pool(R, R, R))
    run.look(1.0, s=pool(R, X, R))
    run.look(19.0)
    assert run.stall({"n2": 1}, steps_expected=False) is None
    run.look(1.0)
    assert run.stall({"n2": 1}, steps_expected=False).bound_s == 20.0


def test_a_scripts_torchrun_that_exits_zero_first_is_its_end_not_a_stall() -> None:
    """A node whose script finished before the others' (exit 0): they finish too."""
    run = Run(pool(R, R, R), step=None)
    run.look(1.0, s=pool(X, R, R))
    run.look(120.0)
    assert run.stall({"n1": 0}, steps_expected=False) is None
    # the same for a trainer that reports steps: its no_step bound watches it instead
    assert run.stall({"n1": 1}, steps_expected=True) is None


def test_a_script_whose_torchruns_all_exit_is_the_exit_stall() -> None:
    run = Run(pool(R, R), step=None)
    run.look(1.0, s=pool(X, R))
    run.look(2.0, s=pool(X, X))
    run.look(10.0)
    assert run.stall({"n1": 1, "n2": 1}, steps_expected=False).reason == "trainers_exited"


def test_a_restart_into_a_store_still_down_backs_off() -> None:
    """Each recovery that brought no step doubles the exit grace (10, 20, 40 s ...), so a
    store that stays down for minutes is reported a few times, not every 10 s."""
    run = Run(pool(R, R))
    run.train(5, 0.5)
    run.look(1.0, s=pool(X, X))
    graces = []
    for _ in range(4):
        waited = 0.0
        while run.stall({"n1": 1, "n2": 1}) is None:
            run.look(1.0)
            waited += 1.0
        graces.append(run.stall({"n1": 1, "n2": 1}).bound_s)
        run.p = run.p.recovered(run.now)
        # the restarted trainers fail at once again
        run.look(1.0, s=pool(R, R))
        run.look(1.0, s=pool(X, X))
    assert graces == [10.0, 20.0, 40.0, 80.0]
    run.look(1.0, s=pool(R, R))
    run.look(1.0, step=run.step + 1)  # a step: the next failure gets the short grace again
    assert run.p.recoveries == 0


# -- no step ------------------------------------------------------------------------------------------------

def test_no_step_bound_is_derived_from_the_step_time() -> None:
    """max(floor_s, step_factor x median step interval): 2 s steps → 300 s (the floor),
    30 s steps → 600 s."""
    fast = Run(pool(R, R))
    fast.train(STEP_WINDOW + 5, 2.0)
    assert fast.p.step_s() == pytest.approx(2.0)
    assert fast.p.bound_s(RULES) == 300.0
    fast.look(299.0)
    assert fast.stall() is None
    fast.look(1.0)
    assert fast.stall().reason == "no_step"

    slow = Run(pool(R, R))
    slow.train(5, 30.0)
    assert slow.p.bound_s(RULES) == pytest.approx(600.0)
    slow.look(599.0)
    assert slow.stall() is None
    slow.look(1.0)
    stall = slow.stall()
    assert stall.reason == "no_step" and stall.idle_s == pytest.approx(600.0) and "after step" in stall.message


def test_steps_seen_in_batches_estimate_the_step_time_per_step() -> None:
    """Heartbeats carry the newest step about once a second: 0.2 s steps are seen 5 at a time."""
    run = Run(pool(R))
    for _ in range(10):
        run.look(1.0, step=run.step + 5)
    assert run.p.step_s() == pytest.approx(0.2)


def test_the_first_step_gets_the_generous_bound() -> None:
    """Import and load time: the first step of an attempt may take first_step_s."""
    run = Run(pool(R, R), step=None)
    run.look(899.0)
    assert run.stall() is None
    run.look(1.0)
    stall = run.stall()
    assert stall.reason == "no_step" and stall.bound_s == 900.0 and "no first step" in stall.message


def test_a_new_attempt_or_a_change_of_who_trains_begins_a_new_wait() -> None:
    """A torchrun restart after a node lost without notice: no step until the survivors'
    new attempt has loaded; that is waited for with first_step_s, not the running bound."""
    run = Run(pool(R, R, R))
    run.train(30, 1.0)
    run.look(200.0, s=pool(R, R, states=(NodeState.RUNNING, NodeState.RUNNING)))  # n3 lost
    run.look(200.0)
    assert run.p.idle_s(run.now) == 200.0  # counted from the change
    assert run.stall() is None  # 400 s without a step: the floor (300 s) no longer applies
    run.look(100.0, s=pool(R, R, attempt="a2"), step=20)  # resumed from the commit at step 20
    assert run.p.last_step_at is None and run.p.since == run.now
    run.look(1.0, step=21)
    assert run.p.last_step_at == run.now and run.p.bound_s(RULES) == 300.0


def test_a_pending_job_is_reported_after_first_step_s_and_never_restarted() -> None:
    run = Run(pool(job=JobState.PENDING, attempt=""), step=None)
    run.look(899.0)
    assert run.stall() is None
    run.look(1.0)
    stall = run.stall()
    assert stall.reason == "not_started" and "pending for 900 s" in stall.message
    assert recover(run.s, stall, VALID) == [a.JobStalled("not_started", stall.message, 900.0, 900.0)]


@pytest.mark.parametrize("kw", [dict(job=JobState.PAUSED), dict(job=JobState.COMPLETED), dict(paused=True)])
def test_a_paused_or_completed_job_never_stalls(kw) -> None:
    run = Run(pool(X, X, **kw))
    run.look(10_000.0)
    assert run.stall({"n1": 1, "n2": 1}) is None


def test_a_migration_in_flight_never_stalls() -> None:
    run = Run(pool(X, X))
    run.look(10_000.0)
    assert run.stall({"n1": 1}, migrating=True) is None
    assert run.stall({"n1": 1}) is not None


def test_rules_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="floor_s"):
        StallRules(floor_s=0)
    with pytest.raises(ValueError, match="step_factor"):
        StallRules(step_factor=0.5)


# -- recovery ------------------------------------------------------------------------------------------------

STALL = Stall("trainers_exited", 12.0, 10.0, "every trainer of the job exited (status 1) 10 s ago")


def test_recovery_restarts_the_trainers_of_the_nodes_in_the_job_in_place() -> None:
    s = pool(X, X, X)
    assert recover(s, STALL, VALID) == [a.JobStalled("trainers_exited", STALL.message, 12.0, 10.0,
                                                     restart=("n1", "n2", "n3"))]


def test_recovery_keeps_a_world_the_global_batch_splits_over() -> None:
    """Four nodes left in the job, valid world sizes {1, 2, 3, 6}: three restart, the
    youngest leaves (the planner replaces it)."""
    s = pool(X, X, X, X)
    acts = recover(s, STALL, VALID)
    assert acts[0].restart == ("n1", "n2", "n3")
    assert acts[1:] == [a.Leave("n4", "job stalled: its world size cannot share the global batch")]


def test_recovery_ends_a_grow_in_flight() -> None:
    """The restarted job resumes from its newest commit: the rejoin request is withdrawn
    (a restarted trainer would otherwise commit and hold for it) and the waiting node
    goes back to ready."""
    s = pool(X, X, N, states=(NodeState.RUNNING, NodeState.RUNNING, NodeState.ADMITTING),
             rejoin=a.RejoinView("r1", frozenset({"n3"}), T0))
    acts = recover(s, STALL, VALID)
    assert acts[0] == a.EndRejoin("r1", "job_stalled", withdraw_from=("n1", "n2"), back_to_ready=("n3",))
    assert acts[1].restart == ("n1", "n2")


def test_nothing_to_restart_is_reported_only() -> None:
    s = pool(X, states=(NodeState.LOST,))
    assert recover(s, STALL, VALID) == [a.JobStalled("trainers_exited", STALL.message, 12.0, 10.0)]


# -- a job that trains on without a node ------------------------------------------------------------------

def test_a_node_whose_torchrun_exited_while_the_job_trains_on_leaves() -> None:
    """n3's torchrun agent died (exit 1: a store blip in a rendezvous round) and its workers
    with it; n1 and n2 shrank in-process and train on. n3's instance is up and heartbeats,
    so it counts as capacity and nobody would replace it: the job would train short for
    good. It leaves (the planner replaces it) once the exit grace has passed with a step
    after the exit."""
    run = Run(pool(R, R, R))
    run.train(40, 0.5)
    run.look(1.0, s=pool(R, R, X))
    run.look(1.0, step=run.step + 1)  # trained on without it
    assert run.behind({"n3": 1}) == []  # inside the grace
    run.look(9.0)
    assert run.behind({"n3": 1}) == [a.Leave("n3", "its torchrun exited 1 and the job goes on without it")]
    # a status the daemon never heard (it restarted since): not known to be the end either
    assert [x.node_id for x in run.behind({})] == ["n3"]


def test_a_node_the_others_started_an_attempt_without_leaves_before_any_step() -> None:
    """n2's torchrun agent died in the first round; n1 formed it alone (world size 1) and
    its claim to rank 0 waits for n2's word, which never comes: no step is recorded. The
    attempt n1 started without n2 is the evidence; n2 leaves, and n1's claim stands alone."""
    run = Run(pool(R, R))
    run.look(1.0, s=pool(R, X, started=("a2", "")))
    run.look(9.0)
    assert run.behind({"n2": 1}) == []  # inside the grace
    run.look(1.0)
    assert [x.node_id for x in run.behind({"n2": 1})] == ["n2"]
    # the exited node had started that attempt too: no evidence it goes on without it
    run = Run(pool(R, R, started=("a2", "a2")))
    run.look(1.0, s=pool(R, X, started=("a2", "a2")))
    run.look(600.0)
    assert run.behind({"n2": 1}) == []


def test_without_a_step_after_the_exit_nothing_leaves() -> None:
    """No step since the exit: the job may be failing as a whole (its torchruns ending one
    after another) and replacing a node would only buy an instance. That is the stall
    rules' to judge (:func:`check`)."""
    run = Run(pool(R, R, R))
    run.train(40, 0.5)
    run.look(1.0, s=pool(R, X, R))
    run.look(600.0)
    assert run.behind({"n2": 1}) == []


@pytest.mark.parametrize("case", ["exit_0", "paused", "migrating", "completed", "all_exited"])
def test_the_jobs_end_a_pause_or_a_move_leaves_every_node_in_place(case: str) -> None:
    run = Run(pool(R, R))
    run.train(10, 0.5)
    run.look(1.0, s=pool(R, X, job=JobState.COMPLETED) if case == "completed"
             else pool(X, X) if case == "all_exited" else pool(R, X, paused=case == "paused"))
    run.look(20.0, step=run.step + 5)
    codes = {"n2": 0} if case == "exit_0" else {"n1": 1, "n2": 1}
    assert run.behind(codes, migrating=case == "migrating") == []


TRAINER_STATES = st.sampled_from([R, X, N])


NODE = st.tuples(TRAINER_STATES, st.sampled_from(["", "a1", "a2"]))


@settings(max_examples=300, deadline=None)
@given(looks=st.lists(st.tuples(st.floats(0.1, 30.0), st.integers(0, 2), st.lists(NODE, min_size=1, max_size=4)),
                      min_size=1, max_size=12),
       codes=st.dictionaries(st.sampled_from(["n1", "n2", "n3", "n4"]), st.integers(-15, 2), max_size=4))
def test_only_a_node_that_failed_while_others_went_on_ever_leaves(looks, codes) -> None:
    """Over any history of passes (trainers starting and exiting, attempts started, steps
    or none): a node left behind is one in the job whose trainer exited with a status
    other than 0, while another trainer of the job ran, at least the exit grace after
    the first exit was seen, and either a step came after it or a running node started
    an attempt the node never reported."""
    run = Run(pool(R, R, R, R))
    for dt, steps, nodes in looks:
        run.look(dt, step=run.step + steps, s=pool(*(t for t, _ in nodes), started=tuple(x for _, x in nodes)))
        out = run.behind(codes)
        view = {n.id: n for n in run.s.nodes}
        running = {n.attempt for n in run.s.nodes if n.trainer is R and n.attempt}
        p = run.p
        for action in out:
            assert isinstance(action, a.Leave)
            n = view[action.node_id]
            assert n.trainer is X and codes.get(n.id) != 0
            assert p.partly_exited_since is not None and run.now - p.partly_exited_since >= RULES.exit_grace_s
            stepped = p.last_step_at is not None and p.last_step_at > p.partly_exited_since
            assert stepped or running - {n.attempt}
        if out:
            assert any(n.trainer is R for n in view.values())
