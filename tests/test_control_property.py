"""Property tests of the pure control layer (daemon/control/): random sequences of agent
reports, provider observations and operator commands, driven through the real decisions
(plan, the default policy's admission and after_loss, the notice and rebalance reactions,
the operator's scale and pause) on a small model of the pool that applies their actions.

After every step:
- no lifecycle change outside its transition table (node, job, trainer);
- never more nodes counted as capacity than the pool's ``max_nodes``;
- every admission leaves the job at a world size the global batch can be split over;
- a noticed node whose commit has not happened is never released before its deadline
  (+ grace): only its heartbeat's loss or its instance's end take it;
- a stall restarts only trainers of nodes in the job, at a valid world size;
and once capacity is back and the disruptions stop, the job reaches its target again,
with every trainer of the job running and steps coming (trainers that all exited, or
hung, are restarted: :mod:`daemon.control.stall`).

And the stall detector's property (issue 25): every reachable state with the job not
completed has an action that makes progress or an operator-visible reason. Once the
world goes quiet (no step, no boot, no report), a job neither completed nor paused
is reported stalled (``JobStalled``) within twice its first-step bound, whatever
happened before.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from daemon.control import actions as a  # noqa: E402
from daemon.control import operator as op  # noqa: E402
from daemon.control.admission import Rules  # noqa: E402
from daemon.control.lifecycle import (  # noqa: E402
    ADMITTED, COUNTED, LIVE, JobState, NodeState, TrainerState, check_transition, check_trainer_transition, leaving,
)
from daemon.control.offers import History, Offer  # noqa: E402
from daemon.control.policies import Spotvisor, lost_from_job  # noqa: E402
from daemon.control.pool import Desired, Timeouts, plan  # noqa: E402
from daemon.control.reactions import on_notice, on_rebalance  # noqa: E402
from daemon.control.stall import Progress, StallRules, check, observe, recover  # noqa: E402
from daemon.control.state import JobView  # noqa: E402

MIN_NODES, MAX_NODES = 1, 4
VALID = frozenset({1, 2, 4})  # world sizes a global batch of 8 in micro batches of 2 splits over
COUNTS = [1, 2, 4]
TIMEOUTS = Timeouts(heartbeat_timeout_s=20.0, launch_timeout_s=180.0, drain_grace_s=30.0)
RULES = Rules(min_nodes=MIN_NODES, valid_world_sizes=VALID, rejoin_timeout_s=120.0, prewarm_wait_s=60.0)
STALL = StallRules(first_step_s=600.0, floor_s=120.0, step_factor=10.0, exit_grace_s=10.0)
OFFERS = [Offer(index=0, provider="local", region="local", zone="a", instance_type="t", gpus_per_node=1,
                price_usd_h=1.0)]


class Violation(AssertionError):
    pass


@dataclasses.dataclass
class N:
    id: str
    ordinal: int
    created_at: float
    state: NodeState = NodeState.REQUESTED
    trainer: TrainerState = TrainerState.NOT_STARTED
    gpus: int = 1
    last_heartbeat: float | None = None
    deadline: float | None = None
    replacing: bool = False
    ready_at: float | None = None
    silent: bool = False  # its heartbeats stopped (the node died without a word)


class Model:
    """The pool as the supervisor keeps it, with its actions applied the way the
    supervisor's actuators apply them (daemon/controlnode/actuator.py, fleet.py)."""

    def __init__(self, target: int, rules: Rules = RULES) -> None:
        self.rules = rules
        self.now = 1_000.0
        self.nodes: dict[str, N] = {}
        self.job = JobView()
        self.target = self.desired = target
        self.paused = False
        self.rejoin: a.RejoinView | None = None
        self.first_ready_at: float | None = None
        self.capacity = True
        self.policy = Spotvisor()
        self.ids = itertools.count(1)
        # the trainer's progress, as the daemon hears it, and the stall watch (controlnode/stall_watch.py)
        self.steps = 0  # the newest step the job reported
        self.attempt = ""
        self.hung = False  # the trainers run but make no step (until restarted)
        self.exit_codes: dict[str, int] = {}
        self.progress = Progress(since=self.now)
        self.stalls: list[a.JobStalled] = []

    # -- the pool as one value ------------------------------------------------------------
    def state(self) -> a.PoolState:
        return a.PoolState(
            nodes=tuple(a.NodeView(id=n.id, state=n.state, gpus=n.gpus, created_at=n.created_at,
                                   last_heartbeat=n.last_heartbeat, deadline=n.deadline, replacing=n.replacing,
                                   trainer=n.trainer, ordinal=n.ordinal, ready_at=n.ready_at,
                                   heartbeat_interval_s=1.0) for n in self.nodes.values()),
            job=self.job.state, paused=self.paused, desired_nodes=self.desired, target_nodes=self.target,
            rejoin=self.rejoin, first_ready_at=self.first_ready_at, attempt=self.attempt)

    def to(self, n: N, state: NodeState) -> None:
        check_transition(n.state, state)  # IllegalTransition fails the test
        n.state = state

    def trainer_to(self, n: N, state: TrainerState) -> None:
        check_trainer_transition(n.trainer, state)
        n.trainer = state
        if state is TrainerState.RUNNING:  # torchrun's next round: a new attempt
            self.attempt = f"a{next(self.ids)}"

    # -- actions --------------------------------------------------------------------------
    def apply(self, actions: list[a.Action]) -> None:
        s = self.state()
        for act in actions:
            if isinstance(act, a.Terminate):
                n = self.nodes[act.node_id]
                if n.state is NodeState.DRAINING and n.trainer is TrainerState.RUNNING:
                    due = (n.deadline or 0.0) + TIMEOUTS.drain_grace_s
                    if self.now <= due:
                        raise Violation(f"{n.id} released ({act.reason}) before its notice commit, {due - self.now} s early")
                self.to(n, act.final_state)
            elif isinstance(act, a.MarkLost):
                self.to(self.nodes[act.node_id], NodeState.LOST)
            elif isinstance(act, a.Launch):
                o = next(self.ids)
                self.nodes[f"n{o}"] = N(f"n{o}", o, self.now)
            elif isinstance(act, a.Admit):
                self.to(self.nodes[act.node_id], NodeState.RUNNING)
            elif isinstance(act, a.StartJob):
                self.job.to(JobState.RUNNING)
            elif isinstance(act, a.NoteFirstReady):
                self.first_ready_at = act.at
            elif isinstance(act, a.Drain):
                n = self.nodes[act.node_id]
                if not n.state.is_terminal() and n.state is not NodeState.DRAINING:
                    n.deadline = self.now + RULES.rejoin_timeout_s
                    self.to(n, NodeState.DRAINING)
            elif isinstance(act, a.RequestRejoin):
                self.rejoin = a.RejoinView(f"r{next(self.ids)}", frozenset(act.nodes), self.now)
                for nid in act.nodes:
                    self.to(self.nodes[nid], NodeState.ADMITTING)
            elif isinstance(act, a.EndRejoin):
                if (self.rejoin.id if self.rejoin else "") == act.request_id:
                    for nid in act.back_to_ready:
                        if self.nodes[nid].state is NodeState.ADMITTING:
                            self.to(self.nodes[nid], NodeState.READY)
                    self.rejoin = None
            elif isinstance(act, a.RestartJob):
                self.job.to(JobState.PENDING)
                self.first_ready_at, self.rejoin = None, None
            elif isinstance(act, a.Leave):
                n = self.nodes[act.node_id]
                if not n.state.is_terminal():
                    self.to(n, NodeState.DRAINING)
                if self.rejoin is not None:
                    self.rejoin = dataclasses.replace(self.rejoin, nodes=self.rejoin.nodes - {n.id})
            elif isinstance(act, a.MarkReplacing):
                self.nodes[act.node_id].replacing = True
            elif isinstance(act, a.JobStalled):
                self.stalls.append(act)
                world = sum(self.nodes[nid].gpus for nid in act.restart)
                if act.restart and world not in VALID:
                    raise Violation(f"a stall restarts {act.restart}: world size {world}, not in {sorted(VALID)}")
                for nid in act.restart:  # the agent stops what still runs, then starts it again
                    n = self.nodes[nid]
                    if n.state not in ADMITTED:
                        raise Violation(f"a stall restarts {nid}, which is {n.state.value}, not in the job")
                    if n.trainer is TrainerState.RUNNING:
                        self.trainer_to(n, TrainerState.EXITED)
                    if n.trainer is TrainerState.EXITED:
                        self.trainer_to(n, TrainerState.NOT_STARTED)
                    self.exit_codes.pop(nid, None)
                if act.restart:
                    self.hung = False
            elif isinstance(act, (a.AvoidZone, a.WatchFlush, a.RequestCheckpoint)):
                pass  # ranking, feed and agent commands: no state of the pool's
            else:
                raise AssertionError(f"unhandled action {act!r}")
        del s

    # -- one reconcile pass (daemon/controlnode/supervisor.py reconcile_once) ---------------
    def reconcile(self) -> None:
        for n in self.nodes.values():
            if n.state in LIVE and n.last_heartbeat is not None and not n.silent:
                n.last_heartbeat = self.now
        members = {n.id for n in self.nodes.values() if n.state in ADMITTED}
        self._after_loss(members)
        self.apply(plan(Desired(self.desired, VALID), self.state().nodes, OFFERS, History(), now=self.now,
                        timeouts=TIMEOUTS))
        self._after_loss(members)
        admits = self.policy.admit(self.state(), self.rules, now=self.now)
        self.apply(admits)
        if any(isinstance(x, a.Admit) for x in admits):
            world = sum(n.gpus for n in self.nodes.values() if n.state in ADMITTED)
            if world not in VALID:
                raise Violation(f"admitted into world size {world}, not in {sorted(VALID)}")
        counted = [n for n in self.nodes.values() if n.state in COUNTED and not n.replacing]
        if len(counted) > MAX_NODES:
            raise Violation(f"{len(counted)} nodes counted as capacity, max_nodes {MAX_NODES}")
        self.watch_stall()

    def watch_stall(self) -> None:
        s = self.state()
        self.progress = observe(self.progress, s, step=self.steps, now=self.now)
        stall = check(self.progress, s, now=self.now, rules=STALL, exit_codes=self.exit_codes)
        if stall is not None:
            self.progress = self.progress.recovered(self.now)
            self.apply(recover(s, stall, VALID))

    def _after_loss(self, members: set[str]) -> None:
        lost = lost_from_job(members, {n.id: n.state for n in self.nodes.values()})
        if lost:
            self.apply(self.policy.after_loss(self.state(), lost, now=self.now))

    # -- the world's inputs ------------------------------------------------------------------
    def pick(self, k: int, states: frozenset[NodeState] | set[NodeState]) -> N | None:
        cands = sorted((n for n in self.nodes.values() if n.state in states), key=lambda n: n.ordinal)
        return cands[k % len(cands)] if cands else None

    def play(self, events: list[tuple]) -> None:
        """From the start: a reconcile pass, then each event in turn."""
        self.reconcile()
        for ev in events:
            self.step(ev)

    def step(self, ev: tuple) -> None:
        kind, k = ev[0], ev[1]
        if kind == "launched":
            n = self.pick(k, {NodeState.REQUESTED})
            if n is not None:
                self.to(n, NodeState.LAUNCHING if self.capacity else NodeState.FAILED)
        elif kind == "registered":
            n = self.pick(k, {NodeState.LAUNCHING})
            if n is not None:
                n.last_heartbeat = n.ready_at = self.now
                self.to(n, NodeState.READY)
        elif kind == "trainer_started":
            n = self.pick(k, {NodeState.RUNNING})
            if n is not None and n.trainer in (TrainerState.NOT_STARTED, TrainerState.WARMING):
                self.trainer_to(n, TrainerState.RUNNING)
        elif kind == "notice":
            n = self.pick(k, LIVE)
            if n is not None:
                n.deadline = self.now + 120.0
                view = next(v for v in self.state().nodes if v.id == n.id)
                self.apply(on_notice(view, notice_id=f"{n.id}:x", deadline=n.deadline, lead_s=120.0, now=self.now))
        elif kind == "rebalance":
            n = self.pick(k, {NodeState.RUNNING})
            if n is not None:
                view = next(v for v in self.state().nodes if v.id == n.id)
                self.apply(on_rebalance(view, policy="replace", notice_id="rb"))
        elif kind == "trainer_exited":  # one node's torchrun gave up (its workers failed past its restarts)
            n = self.pick(k, {NodeState.RUNNING})
            if n is not None and n.trainer is TrainerState.RUNNING:
                self.trainer_to(n, TrainerState.EXITED)
                self.exit_codes[n.id] = 1
        elif kind == "store_restart":  # the rendezvous store restarted empty: every torchrun exits 1
            for n in self.nodes.values():
                if n.state in (NodeState.RUNNING, NodeState.DRAINING) and n.trainer is TrainerState.RUNNING:
                    self.trainer_to(n, TrainerState.EXITED)
                    self.exit_codes[n.id] = 1
        elif kind == "hang":  # the trainers block (a collective on a peer that never answers)
            self.hung = True
        elif kind == "committed":  # a noticed (or drained) node's commit landed: its trainer leaves
            n = self.pick(k, {NodeState.DRAINING})
            if n is not None and n.trainer is TrainerState.RUNNING:
                self.trainer_to(n, TrainerState.EXITED)
        elif kind == "rejoin_answered":
            if self.rejoin is not None:
                self.rejoin = dataclasses.replace(self.rejoin, answered=True)
        elif kind == "instance_gone":
            n = self.pick(k, LIVE)
            if n is not None:
                self.to(n, NodeState.TERMINATED if n.state is NodeState.DRAINING else NodeState.LOST)
        elif kind == "silent":
            n = self.pick(k, LIVE)
            if n is not None:
                n.silent = True
        elif kind == "tick":
            self.now += k
        elif kind == "capacity":
            self.capacity = bool(k % 2)
        elif kind == "scale":
            self.scale(COUNTS[k % len(COUNTS)])
        elif kind == "pause":
            try:
                op.check_pause(self.state())
            except ValueError:
                return
            s = self.state()
            self.paused, self.desired = True, 0
            self.job.to(JobState.PAUSED)
            self.apply(op.pause(s))
        elif kind == "resume":
            self.resume()
        elif kind == "progress":  # a healthy round: launches land, agents register, trainers start
            self.healthy_round(commit=bool(k % 2))
        self.reconcile()

    def healthy_round(self, *, commit: bool) -> None:
        for n in list(self.nodes.values()):
            if n.state is NodeState.REQUESTED:
                self.to(n, NodeState.LAUNCHING if self.capacity else NodeState.FAILED)
            elif n.state is NodeState.LAUNCHING:
                n.last_heartbeat = n.ready_at = self.now
                self.to(n, NodeState.READY)
            elif n.state is NodeState.RUNNING and n.trainer in (TrainerState.NOT_STARTED, TrainerState.WARMING):
                self.trainer_to(n, TrainerState.RUNNING)
            elif commit and leaving(n):
                self.trainer_to(n, TrainerState.EXITED)
        if commit and self.rejoin is not None:
            self.rejoin = dataclasses.replace(self.rejoin, answered=True)
        if self.training():
            self.steps += 1

    def training(self) -> bool:
        """The job trains: it runs, and every node in it has its trainer running, not hung."""
        admitted = [n for n in self.nodes.values() if n.state in ADMITTED]
        return (self.job.state is JobState.RUNNING and not self.hung and bool(admitted)
                and all(n.trainer is TrainerState.RUNNING for n in admitted))

    def scale(self, nodes: int) -> None:
        try:
            op.check_scale(self.state(), nodes, min_nodes=MIN_NODES, max_nodes=MAX_NODES, valid_counts=COUNTS,
                           gpus_per_node=1, global_batch_size=8, micro_batch_size=2)
        except ValueError:
            return
        old, self.target = self.target, nodes
        if not self.paused:
            self.desired = nodes
            self.apply(op.scale(self.state(), nodes, old=old))

    def resume(self) -> bool:
        try:
            op.check_resume(self.state())
        except ValueError:
            return False
        self.paused = False
        self.job.to(JobState.PENDING)
        self.first_ready_at, self.desired = None, self.target
        return True

    # -- the calm after --------------------------------------------------------------------
    def settle(self) -> None:
        """Capacity is back, nothing else goes wrong: every node does what a healthy one does."""
        self.capacity = True
        for _ in range(80):
            if self.paused:
                self.resume()
            before = self.steps
            self.healthy_round(commit=True)
            self.now += 30.0
            self.reconcile()
            admitted = [n for n in self.nodes.values() if n.state in ADMITTED]
            if (not self.paused and self.job.state is JobState.RUNNING and len(admitted) == self.target
                    and self.training() and self.steps > before):
                return
        raise Violation(f"the job did not reach its target {self.target} and train: "
                        f"{sorted((n.id, n.state.value, n.trainer.value) for n in self.nodes.values() if not n.state.is_terminal())}, "
                        f"job {self.job.state.value}, rejoin {self.rejoin}, hung {self.hung}")

    def quiet(self, horizon_s: float, pass_s: float = 30.0) -> list[a.JobStalled]:
        """Nothing happens in the world for ``horizon_s`` (no step, no boot, no report; the
        live agents keep heartbeating): the stalls reported meanwhile."""
        seen = len(self.stalls)
        end = self.now + horizon_s
        while self.now < end:
            self.now += pass_s
            self.reconcile()
        return self.stalls[seen:]


# weighted: mostly a pool going about its life, with notices, grows and shrinks in it
KINDS = (["progress"] * 8 + ["notice", "scale", "committed", "rejoin_answered"] * 3
         + ["launched", "registered", "trainer_started", "rebalance", "instance_gone", "silent", "capacity",
            "pause", "resume", "trainer_exited", "store_restart", "hang"])
EVENTS = st.one_of(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 5.0, 30.0, 130.0])),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(COUNTS), events=st.lists(EVENTS, max_size=80))
def test_random_reports_observations_and_commands_keep_every_invariant(target: int, events: list[tuple]) -> None:
    m = Model(target)
    m.play(events)
    m.settle()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(COUNTS), events=st.lists(EVENTS, max_size=80))
def test_the_invariants_hold_when_new_nodes_join_in_process(target: int, events: list[tuple]) -> None:
    m = Model(target, dataclasses.replace(RULES, grow_in_process=True))
    m.play(events)
    m.settle()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.sampled_from(COUNTS), events=st.lists(EVENTS, max_size=80))
def test_a_job_not_completed_is_never_left_silent(target: int, events: list[tuple]) -> None:
    """Issue 25: every reachable state with the job not completed has an action that makes
    progress or an operator-visible reason. Whatever came before, once nothing happens any
    more a job neither completed nor paused is reported stalled (job_stalled) within its
    first-step bound of the last change in who trains (a noticed node leaves by its
    deadline + grace, a silent one is lost after its heartbeat timeout: 2 x the bound is
    more than enough), and the report restarts the trainers of the nodes still in it;
    when the world is healthy again it trains again."""
    m = Model(target)
    m.play(events)
    stalls = m.quiet(2 * STALL.first_step_s)
    if not m.paused and not m.job.state.is_terminal():
        assert stalls, (f"silent: job {m.job.state.value}, nodes "
                        f"{sorted((n.id, n.state.value, n.trainer.value) for n in m.nodes.values())}")
    m.settle()


def test_every_trainer_exited_is_restarted_and_trains_again() -> None:
    """The hang of issue 25 in the model: four nodes train, the store restarts, every
    trainer exits 1. Before, nothing ever happened again (no action, no event); now the
    job is reported stalled and its four trainers restart in place."""
    m = Model(4)
    m.reconcile()
    for _ in range(4):
        m.step(("progress", 1))
    assert m.training()
    m.step(("store_restart", 0))
    stalls = m.quiet(60.0, pass_s=5.0)
    assert [(x.reason, x.restart) for x in stalls] == [("trainers_exited", ("n1", "n2", "n3", "n4"))]
    m.settle()


def test_an_in_process_grow_admits_at_once_with_no_rejoin_commit() -> None:
    """job.grow: in_process. Two nodes run; two register, one still importing: both are
    admitted at once (their workers queue; the running group takes them in at a step
    boundary), no rejoin commit is asked for, and only a world the batch splits over."""
    rules = dataclasses.replace(RULES, grow_in_process=True)
    m = Model(4, rules)
    states = [NodeState.RUNNING, NodeState.RUNNING, NodeState.READY, NodeState.READY, NodeState.READY]
    for i, state in enumerate(states, 1):
        m.nodes[f"n{i}"] = N(f"n{i}", i, m.now, state=state,
                             trainer=TrainerState.WARMING if i == 4 else TrainerState.RUNNING
                             if state is NodeState.RUNNING else TrainerState.NOT_STARTED,
                             last_heartbeat=m.now, ready_at=m.now)
    m.job.to(JobState.RUNNING)
    acts = Spotvisor().admit(m.state(), rules, now=m.now)
    assert acts == [a.Admit("n3", "join_running"), a.Admit("n4", "join_running")]  # 2 + 2 = 4; 5 is not valid
    # the restart grow: a rejoin commit first, and the importing node waits for its turn
    assert Spotvisor().admit(m.state(), RULES, now=m.now) == [a.RequestRejoin(("n3", "n5"), ("n1", "n2"), "grow")]


def test_a_grow_whose_world_changed_admits_only_a_valid_prefix() -> None:
    # found by the property above: valid {1, 2, 4}, two nodes run, two wait for the rejoin
    # commit (2 + 2 = 4), and one running node is lost without notice. The grow must not
    # admit both (1 + 2 = 3 is not a valid world size): one joins, one waits for the next.
    m = Model(4)
    for i, state in enumerate([NodeState.RUNNING, NodeState.RUNNING, NodeState.ADMITTING, NodeState.ADMITTING], 1):
        m.nodes[f"n{i}"] = N(f"n{i}", i, m.now, state=state, trainer=TrainerState.RUNNING,
                             last_heartbeat=m.now, ready_at=m.now)
    m.job.to(JobState.RUNNING)
    m.rejoin = a.RejoinView("r", frozenset({"n3", "n4"}), m.now, answered=True)
    m.to(m.nodes["n2"], NodeState.LOST)
    acts = Spotvisor().admit(m.state(), RULES, now=m.now)
    assert [x for x in acts if isinstance(x, a.Admit)] == [a.Admit("n3", "rejoin")]
    assert acts[0] == a.EndRejoin("r", "answered", back_to_ready=("n4",))


def test_a_node_awaiting_a_replacement_that_is_no_longer_coming_is_drained() -> None:
    # found by the property above: two running nodes were marked for replacement (rebalance
    # "replace"), then the operator scaled the pool in to the one node left. No replacement
    # is in flight and none will be launched, so "drain once the replacement is up" never
    # came: they stayed in the job for good (a world of 3 at target 1). Now they are drained.
    m = Model(1)
    for i, replacing in enumerate([True, False, True], 1):
        m.nodes[f"n{i}"] = N(f"n{i}", i, m.now, state=NodeState.RUNNING, trainer=TrainerState.RUNNING,
                             last_heartbeat=m.now, ready_at=m.now, replacing=replacing)
    m.job.to(JobState.RUNNING)
    acts = Spotvisor().admit(m.state(), RULES, now=m.now)
    assert acts == [a.Drain("n1", "rebalance_not_replaced"), a.Drain("n3", "rebalance_not_replaced")]
    m.nodes["n2"].replacing = False
    m.target = m.desired = 3  # a replacement is still wanted (and will be launched): keep them
    assert Spotvisor().admit(m.state(), RULES, now=m.now) == []
