"""The pure job tracker (daemon/control/job.py): causal order in every interleaving, and
the rank-0 rules by example.

The property: a job of several attempts (each resuming from the previous one's last
commit), its lines reported by several nodes (every node reports its own workers'
``started``; rank 0's node reports the commits; a noticed node reports its own copy of
the commit that answers its notice; a leader may be noticed and leave, the survivors going
on), delivered in any interleaving of the nodes' own ordered streams (an agent forwards
its lines in order; nothing orders two agents; an attempt's lines come only after every
start of the attempts before it: attempts are seconds apart, a start is reported at
once, while a commit's report may lag anywhere), with the manifest reads answering at
any point. Whatever the interleaving:

- no resume is recorded before the commit it resumes from;
- no reported commit of an attempt is recorded before that attempt's start;
- each commit is recorded exactly once, the completion once and after its commit;
- nothing is lost: once every line has arrived, nothing is held and every attempt's
  resume, every commit and the completion are recorded;
- with every report of one commit lost (its node died), a reconcile pass after the hold
  reads it from the store, and the order still holds (with two lost in a row, the store
  may answer the later read first: not covered);

and what one node's token sends grows the state only up to its caps.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, find, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from daemon.control import job as j  # noqa: E402
from daemon.control.lifecycle import JobState, NodeState  # noqa: E402
from daemon.control.reports import StatusLine  # noqa: E402

T0 = 1_000_000.0


def _line(event: str, attempt: str, step: int, *, rank: int | None = 0, world_size: int | None = 1,
          resumed_from: int | None = None, notice_ids: tuple[str, ...] = ()) -> StatusLine:
    return StatusLine(event=event, attempt=attempt, rank=rank, world_size=world_size, step=step, time=T0 + step,
                      resumed_from=resumed_from, notice_ids=notice_ids)


class Tracker:
    """The pure tracker with a clock, nodes in given states, and the job view applied
    from its :class:`~daemon.control.job.JobProgress` (as the actuator does)."""

    def __init__(self, nodes: dict[str, NodeState], *, verify: bool = False, target: int = 0) -> None:
        self.state = j.JobTrack(settings=j.Settings(verify_commits=verify, target_steps=target))
        self.nodes = dict(nodes)
        self.now = T0
        self.job_state = JobState.RUNNING
        self.actions: list[j.JobAction] = []
        self.seen: set[str] = set()  # the races this run reached

    def send(self, message: j.Message) -> list[j.JobAction]:
        world = j.World(self.now, dict(self.nodes), self.job_state)
        before, self.state, actions = self.state, *j.step(self.state, message, world)
        assert j.step(before, message, world) == (self.state, actions)  # the input untouched: the same answer
        for a in actions:
            if isinstance(a, j.JobProgress) and a.state is not None:
                self.job_state = a.state
        if any(h.line.event == "started" for h in self.state.held):
            self.seen.add("a resume held for its commit")
        if self.state.early:
            self.seen.add("a commit held for its attempt's start")
        if isinstance(message, j.CommitRead) and message.line is not None:
            self.seen.add("a resume held for a commit only the store has")
        if any(h.line.event == "started" and (h.line.attempt, h.line.resumed_from) == (e.line.attempt, e.line.step)
               for h in self.state.held for e in self.state.early):
            self.seen.add("a resume and its own attempt's re-answer of that commit held")
        self.actions += actions
        return actions

    def status(self, node: str, line: StatusLine) -> list[j.JobAction]:
        return self.send(j.Status(node, line))

    def of(self, kind: type) -> list:
        return [a for a in self.actions if isinstance(a, kind)]


# -- the property ------------------------------------------------------------------------


# in a leader's stream: ("leave", k), it is noticed while attempt k trains (every node's start of
# it has arrived) and leaves the job (draining) before the survivors start attempt k + 1; its
# commit that answers the notice comes after, at any time
Leave = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Scenario:
    nodes: tuple[str, ...]
    streams: dict[str, tuple[StatusLine | Leave, ...]]  # node → its lines (and a Leave), in its agent's order
    commits: dict[int, str]  # step → its attempt
    resumes: dict[str, int | None]  # attempt → the step it resumes from
    target: int  # the final commit's step: the completion's
    lost: frozenset[int]  # commits no node's report of arrives (only the store has them)
    reanswers: dict[int, str] = dataclasses.field(default_factory=dict)  # step → the attempt that re-answered it


@st.composite
def scenarios(draw) -> Scenario:
    """1-3 nodes, 1-4 attempts, each resuming from the last one's last commit, each led
    by any node still in the job; a leader may be noticed after its attempt's last
    commit (which answers its notice) and leave, and the survivors go on; one commit's
    every report may be lost. A resumed attempt may first commit at the very step it
    resumed from (its rank 0 answers a notice taken at the first boundary with the commit
    it holds: ``Committer`` re-answers it, a second report of that step)."""
    nodes = tuple(f"n{i}" for i in range(1, draw(st.integers(1, 3)) + 1))
    streams: dict[str, list[StatusLine | Leave]] = {n: [] for n in nodes}
    commits: dict[int, str] = {}
    resumes: dict[str, int | None] = {}
    alive, step, resumed_from = list(nodes), 0, None
    reanswers: dict[int, str] = {}
    n_attempts = draw(st.integers(1, 4))
    for k in range(n_attempts):
        attempt, leader = f"a{k}", draw(st.sampled_from(alive))
        resumes[attempt] = resumed_from
        for rank, node in enumerate([leader] + [n for n in alive if n != leader]):
            streams[node].append(_line("started", attempt, step, rank=rank, world_size=len(alive),
                                       resumed_from=resumed_from))
        if resumed_from is not None and draw(st.booleans()):
            reanswers[resumed_from] = attempt
            streams[leader].append(_line("checkpoint_committed", attempt, resumed_from, world_size=len(alive),
                                         notice_ids=(f"{leader}:re{resumed_from}",)))
        leaves = k < n_attempts - 1 and len(alive) > 1 and draw(st.booleans())
        n_commits = draw(st.integers(1, 3))
        for c in range(n_commits):
            step += draw(st.integers(1, 5))
            commits[step] = attempt
            noticed = leader if leaves and c == n_commits - 1 else draw(
                st.sampled_from((None,) + tuple(n for n in alive if n != leader)))
            ids = (f"{noticed}:{step}",) if noticed else ()
            line = _line("checkpoint_committed", attempt, step, world_size=len(alive), notice_ids=ids)
            if noticed == leader:
                streams[leader].append(("leave", k))
            streams[leader].append(line)
            if noticed and noticed != leader:
                streams[noticed].append(dataclasses.replace(line, rank=None))
        if leaves:
            alive.remove(leader)
        resumed_from = step
    streams[leader].append(_line("completed", f"a{n_attempts - 1}", step, world_size=len(alive)))
    origins = [r for r in resumes.values() if r is not None] + [step]
    lost = frozenset(draw(st.sets(st.sampled_from(origins), max_size=1)))
    kept = {n: tuple(x for x in lines if not (isinstance(x, StatusLine) and x.event == "checkpoint_committed"
                                              and x.step in lost and x.attempt == commits[x.step]))
            for n, lines in streams.items()}
    return Scenario(nodes, kept, commits, resumes, step, lost, reanswers)


def _store_line(s: Scenario, step: int) -> StatusLine:
    return _line("checkpoint_committed", s.commits[step], step, rank=None, world_size=len(s.nodes))


def _deliver(s: Scenario, verify: bool, choose) -> Tracker:
    """Every line, in the interleaving ``choose`` picks (the manifest reads a channel of
    their own, in order, like the one verifier task); then reconcile passes after the hold."""
    t = Tracker({n: NodeState.RUNNING for n in s.nodes}, verify=verify, target=s.target)
    channels = {n: deque(lines) for n, lines in s.streams.items()}
    verifier: deque[j.Verify] = deque()
    while any(channels.values()) or verifier:
        ready = [n for n in sorted(channels) if channels[n] and _may_come(channels[n][0], channels)]
        ready += ["verifier"] if verifier else []
        pick = ready[choose(len(ready))]
        if pick == "verifier":
            v = verifier.popleft()
            actions = t.send(j.Verified(v.node, v.line))
        elif not isinstance(item := channels[pick].popleft(), StatusLine):
            t.nodes[pick] = NodeState.DRAINING
            actions = t.send(j.CheckHolds())  # the reconcile pass a state change brings
        else:
            actions = t.status(pick, item)
        verifier.extend(a for a in actions if isinstance(a, j.Verify))
    if not s.lost:
        return t
    for _ in range(len(s.lost) + 2):  # a pass after each hold: a read, then what it released
        t.now += j.RESUME_HOLD_S + 1
        reads = [a for a in t.send(j.CheckHolds()) if isinstance(a, j.ReadCommit)]
        for r in [reads[i] for i in _order(choose, len(reads))]:  # the reads finish in any order
            t.send(j.CommitRead(r.step, _store_line(s, r.step)))
    return t


def _may_come(item: StatusLine | Leave, channels: dict[str, deque]) -> bool:
    """A leave once every start of its attempt came; a line of attempt k once every leave
    and every start of the attempts before k did (attempts are seconds apart at least; a
    start is reported at once, a commit's report may lag)."""
    pending = [x for c in channels.values() for x in c]
    if isinstance(item, StatusLine):
        k = int(item.attempt[1:])
        return not any(x[1] < k if isinstance(x, tuple) else x.event == "started" and int(x.attempt[1:]) < k
                       for x in pending)
    return not any(isinstance(x, StatusLine) and x.event == "started" and x.attempt == f"a{item[1]}" for x in pending)


def _order(choose, n: int) -> list[int]:
    left, out = list(range(n)), []
    while left:
        out.append(left.pop(choose(len(left))))
    return out


def _check_causal(s: Scenario, t: Tracker, verify: bool) -> None:
    """(Without ``daemon.verify_commits`` a completion is the trainer's word: it waits for
    no commit, and a commit whose reports were all lost is then never read.)"""
    commit_at: dict[int, int] = {}
    recorded: set[tuple[int, str]] = set()
    resume_at: dict[str, int] = {}
    completions = []
    for i, a in enumerate(t.actions):
        if isinstance(a, j.CommitRecorded):
            # once per step, and once more for a step a later attempt re-answered
            assert (a.line.step, a.line.attempt) not in recorded, f"commit {a.line.step} recorded twice"
            assert a.line.step not in commit_at or s.reanswers.get(a.line.step) == a.line.attempt, a
            recorded.add((a.line.step, a.line.attempt))
            commit_at.setdefault(a.line.step, i)
            if a.source is None and resume_at:  # (before the job's first start: no order to keep)
                assert a.line.attempt in resume_at, f"commit {a.line.step} before its attempt {a.line.attempt}"
        elif isinstance(a, j.ResumeRecorded):
            assert a.line.attempt not in resume_at, f"attempt {a.line.attempt} resumed twice"
            if a.line.resumed_from is not None:
                assert a.line.resumed_from in commit_at, f"{a.line.attempt} before commit {a.line.resumed_from}"
            resume_at[a.line.attempt] = i
        elif isinstance(a, j.CompletionRecorded):
            assert a.step in commit_at or not verify, "completion before its commit"
            completions.append(a)
        elif isinstance(a, j.Drop):
            raise AssertionError(f"an honest line dropped: {a}")
    # nothing lost: every line that arrived went on, and nothing waits
    assert set(resume_at) == set(s.resumes)
    assert set(commit_at) == set(s.commits) - (set() if verify else s.lost - set(s.resumes.values()))
    assert [c.step for c in completions] == [s.target]
    assert t.state.held == () and t.state.early == () and t.state.unled == () and not t.state.verifying
    assert t.state.record.attempt == f"a{len(s.resumes) - 1}" and t.job_state is JobState.COMPLETED


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans(), st.data())
def test_the_log_is_causal_in_every_interleaving(s: Scenario, verify: bool, data) -> None:
    """Any job (1-4 attempts, 1-3 nodes, commits reported by rank 0's node and a noticed
    node, some reports lost), any interleaving of the nodes' streams and the manifest
    reads: the recorded events keep causal order, each once, and nothing is lost."""
    t = _deliver(s, verify, lambda n: data.draw(st.integers(0, n - 1)) if n > 1 else 0)
    _check_causal(s, t, verify)


@pytest.mark.parametrize("race", ["a resume held for its commit", "a commit held for its attempt's start",
                                  "a resume held for a commit only the store has",
                                  "a resume and its own attempt's re-answer of that commit held"])
def test_the_generator_reaches_the_races(race: str) -> None:
    """The property is not vacuous: some generated job and interleaving reaches each race
    the rules exist for."""
    def reaches(case) -> bool:
        s, verify, rnd = case
        t = _deliver(s, verify, rnd.randrange)
        return race in t.seen

    find(st.tuples(scenarios(), st.booleans(), st.randoms(use_true_random=False)), reaches,
         settings=settings(max_examples=3000, database=None, deadline=None))


# -- bounds ------------------------------------------------------------------------------


hostile_lines = st.builds(
    StatusLine, event=st.sampled_from(["started", "checkpoint_committed", "completed"]),
    attempt=st.sampled_from(["a1", "x", "y", "z"]) | st.text("abc", min_size=1, max_size=4),
    rank=st.sampled_from([0, 0, 0, 1, 2, None]), world_size=st.integers(1, 4), step=st.integers(0, 10_000),
    resumed_from=st.none() | st.integers(0, 10_000),
    notice_ids=st.lists(st.sampled_from(["n3:1", "n3:2", "n1:1"]), max_size=2).map(tuple))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile_lines, min_size=1, max_size=300), st.booleans())
def test_one_token_cannot_grow_the_state_without_bound(lines, verify) -> None:
    """n3's token sends anything (no manifest read ever answers): what the tracker keeps
    for n3 stays within its caps, and it never changes who leads the running attempt."""
    t = Tracker({n: NodeState.RUNNING for n in ("n1", "n2", "n3")}, verify=verify, target=10_000)
    t.status("n1", _line("started", "a1", 0, world_size=3))
    t.status("n2", _line("started", "a1", 0, rank=1, world_size=3))
    assert t.state.running_leader() == "n1"
    for line in lines:
        t.status("n3", line)
        s = t.state
        assert len(s.starts.get("n3", ())) <= j.STARTS_KEPT
        assert sum(1 for u in s.unled if u.node == "n3") <= j.UNLED_KEPT
        assert sum(1 for h in s.held if h.node == "n3") <= j.HELD_KEPT
        assert sum(1 for e in s.early if e.node == "n3") <= j.EARLY_KEPT
        assert s.verifying.get("n3", 0) <= j.VERIFY_PENDING_MAX
    assert t.state.running_leader() == "n1" and t.state.record.attempt == "a1"


@pytest.mark.parametrize(("event", "rank", "verify", "kept", "cap"), [
    ("checkpoint_committed", 0, True, lambda s: s.verifying.get("n3", 0), j.VERIFY_PENDING_MAX),
    ("checkpoint_committed", 0, False, lambda s: len(s.early), j.EARLY_KEPT),
    ("completed", 0, False, lambda s: len(s.unled), j.UNLED_KEPT),
    ("started", 1, False, lambda s: len(s.starts["n3"]), j.STARTS_KEPT),
])
def test_a_flood_from_one_token_is_kept_up_to_its_cap(event, rank, verify, kept, cap) -> None:
    """100 lines of attempts nobody leads, from n3: what waits for them stops at the cap."""
    t = Tracker({n: NodeState.RUNNING for n in ("n1", "n2", "n3")}, verify=verify, target=0)
    t.status("n1", _line("started", "a1", 0, world_size=3))
    t.status("n2", _line("started", "a1", 0, rank=1, world_size=3))
    for i in range(100):
        t.status("n3", _line(event, f"x{i}", i + 1, rank=rank, world_size=3))
    assert kept(t.state) == cap


def test_the_leaders_repeated_completions_are_held_up_to_the_cap() -> None:
    t = Tracker({"n1": NodeState.RUNNING}, verify=True, target=50)
    t.status("n1", _line("started", "a1", 0))
    for _ in range(j.HELD_KEPT + 5):
        t.status("n1", _line("completed", "a1", 50))
    assert len(t.state.held) == j.HELD_KEPT
    assert [d.problem for d in t.of(j.Drop)] == [f"too many lines wait for their commit ({j.HELD_KEPT})"] * 5


# -- the rank-0 rules, by example -----------------------------------------------------------


def _three() -> Tracker:
    """n1 leads a1 (n2 vouched for it); n1 n2 n3 admitted."""
    t = Tracker({n: NodeState.RUNNING for n in ("n1", "n2", "n3")}, target=100)
    t.status("n1", _line("started", "a1", 0, world_size=3))
    assert t.state.running_leader() is None  # waits for another node's word
    t.status("n2", _line("started", "a1", 0, rank=1, world_size=3))
    assert t.state.running_leader() == "n1" and [r.line.attempt for r in t.of(j.ResumeRecorded)] == ["a1"]
    return t


def test_a_rank_0_claim_on_an_attempt_another_node_leads_is_dropped() -> None:
    t = _three()
    t.status("n3", _line("started", "a1", 0, world_size=3))
    assert t.of(j.Drop)[-1].problem == "started of attempt a1 from rank 0 (attempt held by n1)"
    assert t.state.running_leader() == "n1"


def test_an_uncorroborated_claim_changes_nothing() -> None:
    t = _three()
    t.status("n3", _line("started", "evil", 0, world_size=1))
    t.status("n3", _line("checkpoint_committed", "evil", 5, world_size=1))  # not its own notice, not led
    assert t.state.record.attempt == "a1" and not t.of(j.CommitRecorded)
    assert t.state.leader_of == {"a1": "n1"}


def test_two_rank_0_claims_on_one_attempt_are_both_refused() -> None:
    t = _three()
    t.status("n2", _line("started", "a2", 0, world_size=2))
    t.status("n3", _line("started", "a2", 0, world_size=2))
    assert t.of(j.Drop)[-1].problem.endswith("which another node claims too: neither is taken")
    assert "a2" not in t.state.leader_of


def test_rank_0_moves_only_with_the_running_leaders_word() -> None:
    t = _three()
    t.status("n2", _line("started", "a2", 0, world_size=3))
    t.status("n3", _line("started", "a2", 1, rank=1, world_size=3))  # not the running leader's word
    assert "a2" not in t.state.leader_of
    t.status("n1", _line("started", "a2", 0, rank=2, world_size=3))
    assert t.state.leader_of["a2"] == "n2" and t.state.record.attempt == "a2"


def test_a_commit_counts_from_the_leader_or_the_node_whose_notice_it_answers() -> None:
    t = _three()
    t.status("n3", _line("checkpoint_committed", "a1", 5, rank=None, world_size=3))
    assert t.of(j.Drop)[-1].problem == "checkpoint_committed of attempt a1 from rank None (attempt held by n1)"
    t.status("n3", _line("checkpoint_committed", "a1", 5, rank=None, world_size=3, notice_ids=("n3:x",)))
    t.status("n1", _line("checkpoint_committed", "a1", 5, world_size=3, notice_ids=("n3:x",)))  # the same commit
    assert [c.line.step for c in t.of(j.CommitRecorded)] == [5]
    assert t.state.record.last_commit_step == 5 and t.state.record.commit_steps == {5}


def test_a_taken_over_job_knows_its_newest_commit() -> None:
    """A restarted daemon, or a standby taking over, reads the commits from the store:
    the newest is the job's last commit (found by a seeded HA migration trial: with none,
    a move after a takeover copied nothing and started the job afresh in the target)."""
    t = Tracker({"n1": NodeState.RUNNING}, target=100)
    t.send(j.Restore(commits=(j.StoredCommit(20, False, time=T0 + 20, bytes=5_000),
                              j.StoredCommit(40, False, time=T0 + 40, bytes=6_000),
                              j.StoredCommit(1, False, ("n2:x",), time=T0 + 1)),
                     node_steps={"n1": 45}, running=True))
    r = t.state.record
    assert (r.last_commit_step, r.last_commit_time, r.last_commit_bytes, r.commit_steps) == \
        (40, T0 + 40, 6_000, {1, 20, 40})
    t.send(j.Restore())  # nothing stored: what the job knew stays
    assert t.state.record.last_commit_step == 40


def test_a_heartbeat_step_is_the_jobs_only_from_the_leader_and_only_forward() -> None:
    t = _three()
    t.send(j.Heartbeat("n2", 40))
    assert t.state.record.step == 0
    t.send(j.Heartbeat("n1", 7))
    t.send(j.Heartbeat("n1", 5))
    assert t.state.record.step == 7 and t.of(j.JobProgress)[-1].record.step == 7


def test_a_completion_counts_only_at_the_target_from_the_leader_after_its_commit() -> None:
    t = _three()
    t.status("n1", _line("completed", "a1", 99, world_size=3))
    assert t.of(j.Drop)[-1].problem == "completed at step 99, before job.target_steps 100"
    t.status("n2", _line("completed", "a1", 100, rank=1, world_size=3))
    assert t.of(j.Drop)[-1].event == "completed" and not t.of(j.CompletionRecorded)
    t.state = dataclasses.replace(t.state, settings=j.Settings(verify_commits=True, target_steps=100))
    t.status("n1", _line("completed", "a1", 100, world_size=3))
    assert not t.of(j.CompletionRecorded) and len(t.state.held) == 1  # its commit is not verified yet
    t.status("n1", _line("checkpoint_committed", "a1", 100, world_size=3))
    [verify] = t.of(j.Verify)
    t.send(j.Verified(verify.node, verify.line))
    assert [c.step for c in t.of(j.CompletionRecorded)] == [100] and t.job_state is JobState.COMPLETED


def test_the_survivor_of_a_shrink_resumes_after_the_leavers_commit() -> None:
    """The module's example: n1 leads a1, is noticed and leaves; n2 (the only admitted
    node) reports a2 resumed from 40 before n1's commit of 40 arrives."""
    t = Tracker({"n1": NodeState.RUNNING, "n2": NodeState.RUNNING}, target=100)
    t.status("n1", _line("started", "a1", 0, world_size=2))
    t.status("n2", _line("started", "a1", 0, rank=1, world_size=2))
    t.send(j.WatchFlush("n1:1", "n1", T0 + 60))
    t.nodes["n1"] = NodeState.DRAINING
    t.status("n2", _line("started", "a2", 40, world_size=1, resumed_from=40))
    assert t.state.leader_of["a2"] == "n2" and [h.line.attempt for h in t.state.held] == ["a2"]
    t.status("n1", _line("checkpoint_committed", "a1", 40, world_size=2, notice_ids=("n1:1",)))
    kinds = [type(a).__name__ for a in t.actions if not isinstance(a, j.JobProgress)]
    assert kinds[-3:] == ["CommitRecorded", "WorldSizeChanged", "ResumeRecorded"]
    assert t.state.record.attempt == "a2" and t.state.record.world_size == 1 and not t.state.flushes


def test_a_start_held_for_its_commit_holds_its_nodes_later_starts_behind_it() -> None:
    """n2 leads a2, resumed from 40, whose commit report is late: held. Meanwhile the job
    grows in-process (a3 at step 45, from rank 0 on n2, no commit needed): a3 waits behind
    a2, so the log never shows a3 and then a2's older resume (which reads as the job
    going back to a commit it had passed). When the store settles 40, both go on, in
    their order, and the job is on a3, its step and world."""
    t = Tracker({"n2": NodeState.RUNNING}, target=100)
    t.status("n2", _line("started", "a2", 40, world_size=1, resumed_from=40))
    assert [h.line.attempt for h in t.state.held] == ["a2"]
    t.nodes["n1"] = NodeState.RUNNING  # the grow's new node
    grow = dataclasses.replace(_line("started", "a3", 45, world_size=2), resized="in_process")
    t.status("n2", grow)
    t.status("n1", dataclasses.replace(grow, rank=1))
    assert [h.line.attempt for h in t.state.held] == ["a2", "a3"] and not t.of(j.ResumeRecorded)
    t.now += j.RESUME_HOLD_S + 1  # its leaver's report of 40 is lost: the pass reads the store
    [read] = [x for x in t.send(j.CheckHolds()) if isinstance(x, j.ReadCommit)]  # 40 only: a3 waits on nothing
    t.send(j.CommitRead(read.step, _line("checkpoint_committed", "a1", 40, world_size=2)))
    resumes = [(r.line.attempt, r.line.step) for r in t.of(j.ResumeRecorded)]
    assert resumes == [("a2", 40), ("a3", 45)] and not t.state.held
    assert (t.state.record.attempt, t.state.record.step, t.state.record.world_size) == ("a3", 45, 2)


@pytest.mark.parametrize("found", [True, False])
def test_a_start_behind_a_dropped_or_unconfirmed_one_goes_on(found: bool) -> None:
    """n2's a2 (resumed from 40) commits 45; a3 resumes from 45 behind it. The commit a2
    was held for is not committed (``found``: a2 dropped, and its commit of 45 recorded
    on its leader's word at the next pass), or the store stays out of reach (a2 recorded
    ``commit_unconfirmed``, 45 with it): a3 goes on after 45 either way."""
    t = Tracker({"n2": NodeState.RUNNING}, target=100)
    t.status("n2", _line("started", "a1", 0, world_size=1))
    t.status("n2", _line("started", "a2", 40, world_size=1, resumed_from=40))
    t.status("n2", _line("checkpoint_committed", "a2", 45, world_size=1))  # early: a2's start is held
    t.status("n2", _line("started", "a3", 45, world_size=1, resumed_from=45))
    for _ in range(t.state.settings.confirm_attempts + 1):
        t.now += j.RESUME_HOLD_S + 1
        reads = [x.step for x in t.send(j.CheckHolds()) if isinstance(x, j.ReadCommit)]
        assert reads in ([40], [])  # 45 is known, and goes with a2's start
        for r in reads:
            t.send(j.CommitRead(r, None) if found else j.CommitRead(r, error="store unreachable"))
    resumes = [(r.line.attempt, r.commit_unconfirmed) for r in t.of(j.ResumeRecorded)]
    assert resumes == ([("a1", False), ("a3", False)] if found else [("a1", False), ("a2", True), ("a3", False)])
    log = [type(a).__name__ for a in t.actions if isinstance(a, (j.ResumeRecorded, j.CommitRecorded))]
    assert log[-2:] == ["CommitRecorded", "ResumeRecorded"]  # 45, then a3
    assert t.state.held == () == t.state.early and t.state.record.attempt == "a3"


def test_a_start_waiting_for_a_commit_of_an_attempt_behind_it_is_settled_by_the_store() -> None:
    """A leader's lines that no honest trainer sends: a2 resumes from 50, a commit of a3,
    whose start comes after a2's. a3 waits behind a2, a2 for 50, 50 for a3's start: the
    pass reads 50 from the store instead of waiting for good."""
    t = Tracker({"n1": NodeState.RUNNING}, target=100)
    t.status("n1", _line("started", "a1", 0, world_size=1))
    t.status("n1", _line("started", "a2", 50, world_size=1, resumed_from=50))
    t.status("n1", _line("checkpoint_committed", "a3", 50, world_size=1))
    t.status("n1", _line("started", "a3", 40, world_size=1))
    assert [h.line.attempt for h in t.state.held] == ["a2", "a3"] and len(t.state.early) == 1
    t.now += j.RESUME_HOLD_S + 1
    reads = [x.step for x in t.send(j.CheckHolds()) if isinstance(x, j.ReadCommit)]
    assert reads == [50]
    t.send(j.CommitRead(50, None))  # not committed: a2 dropped, a3 goes on with its commit
    assert [r.line.attempt for r in t.of(j.ResumeRecorded)] == ["a1", "a3"]
    assert [c.line.step for c in t.of(j.CommitRecorded)] == [50] and t.state.held == () == t.state.early


def test_a_line_of_an_attempt_nobody_leads_waits_then_goes() -> None:
    t = Tracker({"n1": NodeState.RUNNING, "n2": NodeState.RUNNING}, target=10)
    t.status("n1", _line("completed", "a1", 10, world_size=2))
    assert len(t.state.unled) == 1
    t.now += j.RESUME_HOLD_S + 1
    t.send(j.CheckHolds())
    assert t.state.unled == () and t.of(j.Drop)[-1].problem == "completed of attempt a1, which no node leads"


def test_a_flush_that_never_commits_is_its_own_event() -> None:
    t = _three()
    t.send(j.WatchFlush("n3:1", "n3", T0 + 30))
    t.send(j.WatchFlush("n3:1", "n3", T0 + 90))  # the first deadline stands
    t.now = T0 + 31
    [timed_out] = t.send(j.CheckFlushes())
    assert timed_out == j.FlushTimedOut("n3", "n3:1", 6.0, None) and not t.state.flushes


def test_a_line_from_a_node_not_in_the_job_is_dropped() -> None:
    t = _three()
    t.nodes["n3"] = NodeState.READY
    t.status("n3", _line("checkpoint_committed", "a1", 5, rank=None, world_size=3, notice_ids=("n3:x",)))
    assert t.of(j.Drop)[-1].problem == "node is ready, not in the job" and not t.of(j.CommitRecorded)


def _two_notices_at_once(*, late_commit: bool) -> Tracker:
    """The chaos cell's run (tests/chaos/test_mass_notice.py), line by line: d2 leads a0
    (w3); d2 and d3 are noticed in one instant; d2 commits 44 and leaves; the survivors
    d1 d3 shrink to a1 (w2, rank 0 on the noticed d3, resumed from 44); d3 commits 45 for
    its own notice; d1 alone shrinks to a2 (w1, resumed from 45) while the replacements
    d4 d5 are admitted, then grows in-process to a3 (w2, with d4) and a4 (w3, with d5)
    and commits 75. ``late_commit``: d3's report of 45 arrives only after d4's start of a3."""
    t = Tracker({n: NodeState.RUNNING for n in ("d1", "d2", "d3")}, target=150)
    for rank, n in enumerate(("d2", "d1", "d3")):
        t.status(n, _line("started", "a0", 0, rank=rank, world_size=3))
    t.status("d2", _line("checkpoint_committed", "a0", 25, world_size=3))
    t.nodes["d2"] = t.nodes["d3"] = NodeState.DRAINING
    t.send(j.CheckHolds())
    t.status("d2", _line("checkpoint_committed", "a0", 44, world_size=3, notice_ids=("d2:x",)))
    t.nodes["d2"] = NodeState.TERMINATED
    t.nodes["d4"] = t.nodes["d5"] = NodeState.RUNNING
    t.send(j.CheckHolds())
    t.status("d3", _line("started", "a1", 44, world_size=2, resumed_from=44))
    t.status("d1", _line("started", "a1", 44, rank=1, world_size=2, resumed_from=44))
    commit_45 = _line("checkpoint_committed", "a1", 45, world_size=2, notice_ids=("d3:x",))
    if not late_commit:
        t.status("d3", commit_45)
    t.status("d1", _line("started", "a2", 45, world_size=1, resumed_from=45))
    grow = dataclasses.replace(_line("started", "a3", 53, world_size=2), resized="in_process")
    t.status("d1", grow)
    t.status("d4", dataclasses.replace(grow, rank=1))
    if late_commit:
        t.status("d3", commit_45)
    grow = dataclasses.replace(_line("started", "a4", 53, world_size=3), resized="in_process")
    for rank, n in enumerate(("d1", "d4", "d5")):
        t.status(n, dataclasses.replace(grow, rank=rank))
    t.status("d1", _line("checkpoint_committed", "a4", 75, world_size=3))
    return t


@pytest.mark.parametrize("late_commit", [False, True])
def test_two_notices_at_once_are_logged_in_the_order_they_happened(late_commit: bool) -> None:
    """Every attempt is recorded, in its order, each resume right after the commit it
    resumed from: a resume recorded after a newer commit reads as a commit lost."""
    t = _two_notices_at_once(late_commit=late_commit)
    log = [(type(a).__name__, a.line.attempt if isinstance(a, j.ResumeRecorded) else a.line.step)
           for a in t.actions if isinstance(a, (j.ResumeRecorded, j.CommitRecorded))]
    assert log == [("ResumeRecorded", "a0"), ("CommitRecorded", 25), ("CommitRecorded", 44),
                   ("ResumeRecorded", "a1"), ("CommitRecorded", 45), ("ResumeRecorded", "a2"),
                   ("ResumeRecorded", "a3"), ("ResumeRecorded", "a4"), ("CommitRecorded", 75)]
    assert t.state.leader_of["a1"] == "d3" and t.state.record.attempt == "a4" and t.state.record.world_size == 3
    assert not t.of(j.Drop) and t.state.held == () and t.state.early == ()
