"""A job that stops making progress is recovered and reported, never left silent. Pure.

The daemon hears of the job's progress from its trainer: each heartbeat's step and
each attempt's ``started`` line (:class:`~daemon.control.state.JobView`).
:func:`observe` folds one reconcile pass's view into a :class:`Progress` value;
:func:`check` judges it, the clock passed in, and returns a :class:`Stall` for one of
three signs:

``trainers_exited``
    Every node admitted to the job has its trainer exited (a joiner still waiting to be
    admitted, one that never reported an attempt, aside, once some node that trained
    exited: there is no group left to admit it), not all of them with 0 (a
    trainer exits 0 only at the job's end, whose completion may still be being
    verified), for ``exit_grace_s``: nothing of the job runs any more. torchrun
    restarts its own workers, but nothing restarts torchrun: the workers failed past
    torchrun's restarts on every node, or a new rendezvous round (after a worker
    failed) found the store down for longer than ``rendezvous.join_timeout_s``
    (issue 25: with c10d's own backend a store restart alone ended every torchrun;
    ``--rdzv-backend=spotvisor``, :mod:`trainer.rendezvous`, rides it out).
``no_step``
    The job runs and no new step came for the bound (:meth:`Progress.bound_s`):

    - until the first step after the job started, after a new attempt started (a
      restart, a resize), after the set of nodes whose trainer runs changed, or
      after the last recovery: ``first_step_s`` (rendezvous, import, loading the
      checkpoint: generous, a large model loads for minutes);
    - once steps come: ``max(floor_s, step_factor x the median of the last``
      :data:`STEP_WINDOW` ``intervals between steps)``. With the defaults (300 s,
      20): 0.5 s steps → 300 s; 30 s steps → 600 s.
``rendezvous_closed``
    The user's own script (``job.command``: it reports no step, so ``no_step`` cannot
    see it): a node's torchrun exited non-zero while others still run, for the exit
    grace. torchrun exits so only past its own restarts, and its launcher then shuts
    the rendezvous down for good (torch 2.13, ``launcher.api.launch_agent``: any end but
    a signal), so no trainer of the job can re-form: the others exit too (then it is
    ``trainers_exited``) or hang where they wait for the gone node (a worker in
    ``init_process_group`` waits torch's 30 minutes for a store nobody serves). Seen in
    CI: the job's first round failed on one node, the others sat in their set-up, and
    nothing bounded it.
``not_started``
    The job has been pending (waiting for its nodes) for ``first_step_s``: reported
    only, the planner and admission are what can start it.

Not a stall, but never silent either: a job that trains on without one of its nodes.
:func:`left_behind` finds, in a job whose joiners join in-process (``job.grow:
in_process``), the nodes whose torchrun exited non-zero while the others went on
training (a step came after the exit, or they started an attempt without it): their
instances are up, their agents heartbeat, and they count as capacity, but they hold
no rank. Each leaves (:class:`Leave`), and the planner replaces it; the replacement
joins the running group in-process.

A paused job (the operator's doing), an ended one (completed, failed, cancelled) and one in the middle of a
whole-job migration (which has its own deadlines and events) never stall.

:func:`recover` turns a stall into actions: one
:class:`~daemon.control.actions.JobStalled` (the ``job_stalled`` event, with the
reason, and the nodes whose trainers restart in place: their agents stop what still
runs and start torchrun again under a new rendezvous id, and the job resumes from
its newest verified commit, ``job_resumed``). A stall with nothing to restart (no node
in the job) is reported only. Each recovery starts a new wait (:meth:`Progress.recovered`),
so a stall that lasts is reported again after each bound, never in a flood: the
exit grace doubles after each recovery that brought no step (10, 20, 40 s ... up to
``first_step_s``), as a restart into a store still down fails again at once.

Example (``configs/local.yaml``): three nodes train; their torchruns run c10d's own
backend (a node on its own interpreter, ``job.python``) and the store is killed at step
45 and restarted empty 3 s later. Within 5 s every torchrun exits 1; 10 s later
:func:`check` says ``trainers_exited``; :func:`recover` returns ``[JobStalled(
"trainers_exited", ..., restart=("n1", "n2", "n3"))]``; the three trainers start
again and resume from step 40, the newest commit. With spotvisor's backend (the
default) the same kill costs nothing: no trainer exits, steps keep coming, no stall.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from daemon.control.actions import Action, EndRejoin, JobStalled, Leave, NodeView, PoolState
from daemon.control.admission import largest_valid
from daemon.control.lifecycle import ADMITTED, MEMBERS, JobState, NodeState, TrainerState

__all__ = ["STEP_WINDOW", "StallRules", "Progress", "Stall", "observe", "check", "recover", "left_behind"]

#: the step time is the median of this many recent intervals between steps
STEP_WINDOW = 20


@dataclass(frozen=True, slots=True)
class StallRules:
    """When silence is a stall (``daemon.stall`` in the config). Seconds.

    ``first_step_s``: from a (re)start to the first step (rendezvous, import, load);
    ``floor_s`` and ``step_factor``: once steps come, the bound is ``max(floor_s,
    step_factor x median step interval)``; ``exit_grace_s``: how long every trainer of
    the job may have exited before that is a stall (doubled after each recovery that
    brought no step, at most ``first_step_s``).

    Raises:
        ValueError: a time that is not positive, or a factor below 1.
    """

    first_step_s: float = 900.0
    floor_s: float = 300.0
    step_factor: float = 20.0
    exit_grace_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("first_step_s", "floor_s", "exit_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not self.step_factor >= 1:
            raise ValueError(f"step_factor must be >= 1, got {self.step_factor!r}")


@dataclass(frozen=True, slots=True)
class Progress:
    """What the daemon has seen of the job's progress; times are unix seconds. One value,
    replaced by :func:`observe` at each reconcile pass.

    ``since``: when the current wait for a step began (the job's start, a new attempt,
    a change of who trains, a recovery); ``last_step_at``: the newest step seen since
    then (None: none yet); ``intervals``: seconds per step, newest last, at most
    :data:`STEP_WINDOW`; ``exited_since``: every trainer of the job has exited since
    then; ``partly_exited_since``: some trainer of the job, not all, has exited since
    then; ``recoveries``: recoveries since the last step.
    """

    since: float
    attempt: str = ""
    step: int | None = None
    training: frozenset[str] = frozenset()  # nodes of the job whose trainer runs
    last_step_at: float | None = None
    intervals: tuple[float, ...] = ()
    exited_since: float | None = None
    partly_exited_since: float | None = None
    recoveries: int = 0

    def step_s(self) -> float | None:
        """The median of the recent intervals between steps (seconds); None before two steps."""
        if not self.intervals:
            return None
        xs = sorted(self.intervals)
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

    def bound_s(self, rules: StallRules) -> float:
        """How long without a step is a stall now (seconds): ``first_step_s`` until the
        first step of this wait, then ``max(floor_s, step_factor x step_s())``."""
        if self.last_step_at is None:
            return rules.first_step_s
        step_s = self.step_s()
        return rules.floor_s if step_s is None else max(rules.floor_s, rules.step_factor * step_s)

    def idle_s(self, now: float) -> float:
        """Seconds since the newest step of this wait, or since the wait began."""
        return now - (self.since if self.last_step_at is None else self.last_step_at)

    def recovered(self, now: float) -> Progress:
        """A recovery (or a report) at ``now``: a new wait for the first step begins."""
        return replace(self, since=now, last_step_at=None, exited_since=None, partly_exited_since=None,
                       recoveries=self.recoveries + 1)


@dataclass(frozen=True, slots=True)
class Stall:
    """Why the job is stalled: ``reason`` (``trainers_exited``, ``rendezvous_closed``,
    ``no_step``, ``not_started``), seconds with no step (``idle_s``) against the ``bound_s`` that
    applied, and one line for a person (``message``)."""

    reason: str
    idle_s: float
    bound_s: float
    message: str


def _in_job(s: PoolState) -> list[NodeView]:
    return s.in_domain().in_state(*ADMITTED)


def _joining(n: NodeView) -> bool:
    """A node whose trainer runs but never reported an attempt: a joiner waiting for the
    running group to admit it. Once every node that trained has exited there is no group
    to admit it (a store out of reach past every bound took the group down while a
    replacement waited): it does not keep the job from counting as exited."""
    return n.trainer is TrainerState.RUNNING and not n.attempt


def _orphaned(s: PoolState, in_job: list[NodeView]) -> bool:
    """Every node left in the job is a joiner, and the nodes that reported the job's running
    attempt have all left it (lost, or drained: an in-process joiner whose trainer exited
    non-zero leaves, :func:`daemon.control.reactions.on_trainer_exit`): no group is left to
    admit the joiners. Only on that evidence: a node whose attempt is not known (a daemon
    that restarted, a job starting) is never taken for an orphan."""
    if not (s.attempt and in_job and all(_joining(n) for n in in_job)):
        return False
    inside = {n.id for n in in_job}
    return any(n.attempt == s.attempt and n.id not in inside for n in s.nodes)


def observe(p: Progress, s: PoolState, *, step: int | None, now: float) -> Progress:
    """``p`` after one look at the pool ``s`` and the job's newest step (``step``) at ``now``.

    A new attempt, a change in which nodes' trainers run, or a step lower than the
    last (a resume from a commit) begins a new wait; a higher step is progress (its
    interval, per step, joins the estimate when the previous look also saw a step)."""
    in_job = _in_job(s)
    training = frozenset(n.id for n in s.nodes if n.state in MEMBERS and n.trainer is TrainerState.RUNNING)
    trained = [n for n in in_job if not _joining(n)]
    exited = bool(in_job) and (all(n.trainer is TrainerState.EXITED for n in in_job)
                               or (any(n.attempt for n in trained)
                                   and all(n.trainer is TrainerState.EXITED for n in trained))
                               or _orphaned(s, in_job))
    exited_since = (now if p.exited_since is None else p.exited_since) if exited else None
    partly = not exited and any(n.trainer is TrainerState.EXITED for n in in_job)
    partly_since = (now if p.partly_exited_since is None else p.partly_exited_since) if partly else None
    if s.attempt != p.attempt or training != p.training or (step is not None and p.step is not None and step < p.step):
        return replace(p, since=now, attempt=s.attempt, step=step, training=training, last_step_at=None,
                       exited_since=exited_since, partly_exited_since=partly_since)
    if step is not None and (p.step is None or step > p.step):
        intervals = p.intervals
        if p.last_step_at is not None and p.step is not None:
            intervals = (*intervals, (now - p.last_step_at) / (step - p.step))[-STEP_WINDOW:]
        return replace(p, step=step, last_step_at=now, intervals=intervals, exited_since=exited_since,
                       partly_exited_since=partly_since, recoveries=0)
    if (exited_since, partly_since) == (p.exited_since, p.partly_exited_since):
        return p
    return replace(p, exited_since=exited_since, partly_exited_since=partly_since)


def check(p: Progress, s: PoolState, *, now: float, rules: StallRules, exit_codes: Mapping[str, int],
          migrating: bool = False, steps_expected: bool = True) -> Stall | None:
    """Whether the job is stalled at ``now`` (module docstring); None: it is not.

    ``exit_codes``: node id → its trainer's last exit status, where known (a node
    missing counts as a failure). ``migrating``: a whole-job migration is in flight.
    ``steps_expected``: False for a trainer that has never reported a step (the user's
    own script, ``job.command``): its silence is no ``no_step`` stall (its exits still
    are, one node's included: ``rendezvous_closed``)."""
    if s.job.is_terminal() or s.job is JobState.PAUSED or s.paused or migrating:
        return None
    idle = p.idle_s(now)
    if s.job is JobState.PENDING:
        if idle < rules.first_step_s:
            return None
        ready = len(s.in_domain().in_state(NodeState.READY))
        preparing = len(s.in_domain().in_state(NodeState.PREPARING))
        return Stall("not_started", idle, rules.first_step_s,
                     f"pending for {idle:.0f} s with {ready} of {s.target_nodes} nodes ready"
                     + (f" ({preparing} preparing: job.workdir, job.setup)" if preparing else ""))
    in_job = _in_job(s)
    if p.exited_since is not None and not all(exit_codes.get(n.id) == 0 for n in in_job):
        grace = min(rules.first_step_s, rules.exit_grace_s * 2 ** p.recoveries)
        if now - p.exited_since >= grace:
            failed = sorted({exit_codes.get(n.id) for n in in_job if exit_codes.get(n.id) != 0},
                            key=lambda c: (c is None, c))
            codes = ", ".join("unknown" if c is None else str(c) for c in failed)
            if _orphaned(s, in_job):
                return Stall("trainers_exited", idle, grace,
                             f"every trainer that trained exited and left the job {now - p.exited_since:.0f} s ago; "
                             f"{len(in_job)} joiner(s) wait for a group that is gone")
            return Stall("trainers_exited", idle, grace,
                         f"every trainer of the job exited (status {codes}) {now - p.exited_since:.0f} s ago")
    if not steps_expected and p.partly_exited_since is not None:
        failed = {n.id: exit_codes.get(n.id) for n in in_job
                  if n.trainer is TrainerState.EXITED and exit_codes.get(n.id) != 0}
        grace = min(rules.first_step_s, rules.exit_grace_s * 2 ** p.recoveries)
        if failed and now - p.partly_exited_since >= grace:
            gone = ", ".join(f"{node} (status {'unknown' if code is None else code})"
                             for node, code in sorted(failed.items()))
            running = sum(n.trainer is TrainerState.RUNNING for n in in_job)
            return Stall("rendezvous_closed", idle, grace,
                         f"the torchrun of {gone} exited {now - p.partly_exited_since:.0f} s ago, which closes "
                         f"the rendezvous; {running} trainer(s) still run and cannot re-form")
    bound = p.bound_s(rules)
    if idle >= bound and steps_expected:
        what = "no first step" if p.last_step_at is None else f"no step after step {p.step}"
        return Stall("no_step", idle, bound, f"{what} for {idle:.0f} s (bound {bound:.0f} s)")
    return None


def recover(s: PoolState, stall: Stall, valid_world_sizes: frozenset[int]) -> list[Action]:
    """The actions for ``stall``: report it, and restart in place the trainers of the
    largest valid prefix (oldest first) of the nodes in the job; nodes past it leave
    (their world size could not share the global batch), a grow in flight ends (its
    request is withdrawn: the restarted job resumes from its newest commit, not from
    the rejoin's). Nothing to restart (no node in the job, or a pending job): reported
    only."""
    running = _in_job(s)
    chosen = largest_valid(running, 0, valid_world_sizes) if stall.reason != "not_started" else []
    ids = tuple(n.id for n in chosen)
    out: list[Action] = []
    rj = s.rejoin
    if ids and rj is not None:
        admitting = tuple(n.id for n in s.in_state(NodeState.ADMITTING))
        out.append(EndRejoin(rj.id, "job_stalled", withdraw_from=ids, back_to_ready=admitting))
    out.append(JobStalled(stall.reason, stall.message, stall.idle_s, stall.bound_s, restart=ids))
    if ids:
        out += [Leave(n.id, "job stalled: its world size cannot share the global batch")
                for n in running[len(chosen):]]
    return out


def left_behind(p: Progress, s: PoolState, *, now: float, rules: StallRules, exit_codes: Mapping[str, int],
                migrating: bool = False) -> list[Action]:
    """The nodes a job with in-process joiners (``job.grow: in_process``) trains on
    without: each one whose torchrun exited non-zero (or with a status the daemon never
    heard) leaves, and the planner replaces it.

    Evidence: the job is running, not paused and not migrating; some of its trainers
    have exited for ``rules.exit_grace_s`` and another one runs; and the others went on
    without them, seen either way:

    - a step came after the exit (``p.last_step_at`` after ``p.partly_exited_since``);
    - a node of the job whose trainer runs started an attempt the exited node's workers
      never reported (an in-process shrink, or a first round formed without it). Its
      claim to rank 0 may wait for this node's word, which never comes, so no step is
      recorded: in an HA trial a move's target started at world size 1 after the other
      node's torchrun agent died, and only the stall rules ended the wait.

    Short of that it is for :func:`check` (the job may be failing as a whole, its
    torchruns ending one after another). The node's instance is up and its agent
    answers, so it counts as capacity and the pool would never replace it; its torchrun
    ended past its own restarts (or its agent died: a store blip in a rendezvous round),
    and nothing starts it again. Its rendezvous is closed, which a torchrun joiner would
    need, so this is only for in-process joiners (the caller passes nothing else here).

    Example: n1 n2 n3 train attempt a1 at world size 3; n3's torchrun agent dies (exit 1)
    and its workers with it; n1 and n2 shrink in-process to attempt a2. 10 s
    (``exit_grace_s``) after n3's exit was seen: ``[Leave("n3", "its torchrun exited 1
    and the job goes on without it")]``.

    Returns:
        One :class:`Leave` per such node, oldest first; ``[]`` when the evidence is short.
    """
    if s.job is not JobState.RUNNING or s.paused or migrating or p.partly_exited_since is None:
        return []
    if now - p.partly_exited_since < rules.exit_grace_s:
        return []
    in_job = _in_job(s)
    running = [n for n in in_job if n.trainer is TrainerState.RUNNING]
    if not running:  # a step is no evidence that anyone goes on now
        return []
    stepped = p.last_step_at is not None and p.last_step_at > p.partly_exited_since
    started = {n.attempt for n in running if n.attempt}
    out: list[Action] = []
    for n in in_job:
        code = exit_codes.get(n.id)
        if n.trainer is TrainerState.EXITED and code != 0 and (stepped or started - {n.attempt}):
            how = "with a status never heard" if code is None else str(code)
            out.append(Leave(n.id, f"its torchrun exited {how} and the job goes on without it"))
    return out
