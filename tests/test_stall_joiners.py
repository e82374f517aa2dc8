"""daemon/control/stall.py: a joiner waiting for a group that is gone does not hide a stall.

Issue 29's long store outage: a node was lost while the store was down; the survivors'
round and torchrun's new round gave up on the store and every trainer that trained
exited; the replacement's trainer, started to join the running group, still waits for
an admission nobody is left to give. That is every trainer of the job exited: a stall.
"""

from __future__ import annotations

from daemon.control import actions as a
from daemon.control.lifecycle import JobState, NodeState, TrainerState
from daemon.control.stall import Progress, StallRules, check, observe

T0 = 100_000.0
RULES = StallRules(first_step_s=900.0, floor_s=300.0, step_factor=20.0, exit_grace_s=10.0)
R, X = TrainerState.RUNNING, TrainerState.EXITED


def _pool(*nodes: tuple[TrainerState, str]) -> a.PoolState:
    """Nodes n1, n2, ... running, each ``(trainer, attempt it last reported)``."""
    views = tuple(a.NodeView(id=f"n{i}", state=NodeState.RUNNING, gpus=1, created_at=0.0, trainer=t, attempt=att,
                             ordinal=i) for i, (t, att) in enumerate(nodes, 1))
    return a.PoolState(nodes=views, job=JobState.RUNNING, attempt="a1", target_nodes=len(nodes))


def _stalled_after(s: a.PoolState, dt: float) -> str | None:
    p = observe(Progress(since=T0), s, step=40, now=T0)
    p = observe(p, s, step=40, now=T0 + dt)
    stall = check(p, s, now=T0 + dt, rules=RULES, exit_codes={"n1": 1, "n2": 1})
    return None if stall is None else stall.reason


def test_a_joiner_waiting_for_a_group_that_exited_does_not_hide_the_stall() -> None:
    s = _pool((X, "a1"), (X, "a1"), (R, ""))  # two trainers that trained exited; the replacement waits to join
    assert _stalled_after(s, 5.0) is None  # the grace
    assert _stalled_after(s, 11.0) == "trainers_exited"


def test_a_joiner_beside_a_group_still_training_is_no_stall() -> None:
    assert _stalled_after(_pool((R, "a1"), (X, "a1"), (R, "")), 60.0) is None


def test_nodes_still_starting_beside_one_that_exited_are_no_stall() -> None:
    # at the job's start nobody reported an attempt yet: a torchrun that exited early is not the job's end
    assert _stalled_after(_pool((X, ""), (R, ""), (R, "")), 60.0) is None


def test_joiners_alone_in_the_job_after_the_group_left_it_are_a_stall() -> None:
    # the FSDP demo's kill, before the survivors could rebuild in-process: the killed node
    # was lost, the survivors (in-process joiners once) exited 1 and were drained, and the
    # replacements admitted meanwhile wait for an admission nobody is left to give
    gone = tuple(a.NodeView(id=f"g{i}", state=st, gpus=1, created_at=0.0, trainer=X, attempt="a1", ordinal=10 + i)
                 for i, st in enumerate((NodeState.LOST, NodeState.TERMINATED, NodeState.TERMINATED)))
    joiners = _pool((R, ""), (R, ""))
    s = a.PoolState(nodes=gone + joiners.nodes, job=JobState.RUNNING, attempt="a1", target_nodes=3)
    assert _stalled_after(_pool((R, ""), (R, "")), 60.0) is None  # no evidence the group is gone: no stall
    assert _stalled_after(s, 5.0) is None  # the grace
    assert _stalled_after(s, 11.0) == "trainers_exited"
    p = observe(observe(Progress(since=T0), s, step=40, now=T0), s, step=40, now=T0 + 11.0)
    stall = check(p, s, now=T0 + 11.0, rules=RULES, exit_codes={})
    assert stall is not None and "2 joiner(s) wait for a group that is gone" in stall.message


def test_nodes_starting_a_job_that_never_reported_an_attempt_are_no_orphans() -> None:
    views = tuple(a.NodeView(id=f"n{i}", state=NodeState.RUNNING, gpus=1, created_at=0.0, trainer=R, ordinal=i)
                  for i in (1, 2))
    s = a.PoolState(nodes=views, job=JobState.RUNNING, attempt="", target_nodes=2)
    assert _stalled_after(s, 60.0) is None
