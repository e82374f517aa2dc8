"""When a job that keeps failing is given up: ``job.max_restarts_on_errors``. Pure.

A **try** is one run of the job's trainer: it begins when the job starts, when the
daemon restarts the trainers in place (a stall, :mod:`daemon.control.stall`), and at
each ``started`` line an attempt of a status-reporting trainer writes (torchrun's own
restarts of its workers each make one: :mod:`trainer.contract`); it ends at the next
begin, when a trainer exits non-zero, or at a stall. A try **fails** when it ends with
no progress: no step past the one it began at. It does not count when it was
**disturbed**: a node of the job was noticed, lost, terminated, drained or admitted
while it ran (a preemption or a resize ends a try without any fault of the trainer's).
Progress resets the count. Once ``max_failures`` tries in a row have failed, the job
is ``failed`` (:func:`gives_up`).

How the tries reach the daemon: a status-reporting trainer (``trainer.run``, the HF
callback) names each torchrun restart of its workers in a ``started`` line, so its
torchrun keeps its large restart budget and every try is seen. A trainer that reports
nothing (``job.command``) keeps it too where spotvisor's launcher runs its torchrun (the
agent's own interpreter): each failure of its workers comes as ``workers_failed``
(below). Only on another interpreter (``job.python``: no launcher there) is it seen
when its torchrun exits alone; that torchrun is given ``--max-restarts`` of
``max_failures - 1`` (:mod:`daemon.controlnode.jobspec`), so one exit is
``max_failures`` tries (:class:`Ended` ``tries``). A small budget anywhere else would
be used up by preemptions: each notice's peer leaving fails the survivors' workers
mid-collective, and torchrun counts that against it. With no step to go by, a try that
lasted ``long_s`` (``daemon.stall.first_step_s``: the time a first step may take)
counts as progress.

A worker that fails before its trainer writes its first ``started`` line (an import
error, a bad NCCL set-up, an out-of-memory building the model) makes no attempt, and
torchrun, with its large restart budget, would restart it for hours unseen. So each
node's launcher reports every failure of its workers that torchrun restarts
(``workers_failed``, :class:`Crashed`): it ends the running try like an exit, and it
counts per node, so a crash loop is counted even with no try running: ``failed`` is
never less than the failures any one node reported in a row. Every node of the job
failing in one round is one failure, not one per node.

Example (``max_failures`` 3, a script that exits 1 at start, reporting nothing): the
job starts (``Began``, t=0); the launcher reports its workers failed at t=3, 6 and 9
(``Crashed``): ``failed`` is 3 at t=9, :func:`gives_up`. The same with a notice at t=4
(``Disturbed``): the count starts again, and each node's first failure after the
notice is the notice's doing. On another interpreter (torchrun given
``--max-restarts=2``): torchrun runs the script three times and exits 1 at t=9
(``Ended(tries=3)``): ``failed`` is 3.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Began", "Stepped", "Disturbed", "Ended", "Crashed", "Observation", "Tries", "observe", "gives_up"]


@dataclass(frozen=True, slots=True)
class Began:
    """A try began at ``at`` (unix s) from ``step`` (None: unknown). ``attempt``: the
    trainer's attempt id, for a ``started`` line; None for a start or restart of the
    trainers by the daemon, whose first ``started`` line then names the same try."""

    at: float
    step: int | None = None
    attempt: str | None = None


@dataclass(frozen=True, slots=True)
class Stepped:
    """The job's trainer reported ``step``."""

    step: int


@dataclass(frozen=True, slots=True)
class Disturbed:
    """A node of the job was noticed, lost, terminated, drained or admitted (``what``)."""

    what: str


@dataclass(frozen=True, slots=True)
class Ended:
    """The running try ended at ``at`` (unix s), ``why`` (``exit``, ``stalled``,
    ``restarted``); ``tries``: how many tries this end stands for (a torchrun exit after
    its own restarts); ``node`` and ``exit_code`` where an exit ended it."""

    at: float
    why: str
    tries: int = 1
    node: str | None = None
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class Crashed:
    """``node``'s torchrun saw its workers fail at ``at`` (unix s) and restarts them (its
    launcher's ``workers_failed`` report), or exited ``exit_code`` after such failures,
    with no try running to end."""

    at: float
    node: str
    exit_code: int | None = None


Observation = Began | Stepped | Disturbed | Ended | Crashed


@dataclass(frozen=True, slots=True)
class Tries:
    """The count, and the try running. ``failed``: tries in a row that failed;
    ``last``: the newest of them (what the ``job_failed`` event shows)."""

    failed: int = 0
    running: bool = False
    began_at: float | None = None
    start_step: int | None = None
    attempt: str | None = None
    progressed: bool = False
    disturbed: bool = False
    steps_seen: bool = False  # the trainer ever reported a step (else time stands in for progress)
    last: Ended | None = None
    # (node, workers' failures in a row, unix s of the last): each count at most ``failed``
    crashes: tuple[tuple[str, int, float], ...] = ()
    # the last try ended in progress or a preemption: each node's first failure after it
    # (the other nodes of that round) is explained by it and does not count
    grace: bool = False


def observe(t: Tries, obs: Observation, *, long_s: float) -> Tries:
    """``t`` after ``obs``. ``long_s``: seconds after which a try of a trainer that never
    reported a step counts as progress (see the module docstring)."""
    if isinstance(obs, Stepped):
        if t.running and (t.start_step is None or obs.step > t.start_step):
            return replace(t, failed=0, progressed=True, steps_seen=True, crashes=())
        return t if t.steps_seen else replace(t, steps_seen=True)
    if isinstance(obs, Disturbed):
        return replace(t, disturbed=True, crashes=()) if t.running else replace(t, crashes=(), grace=True)
    if isinstance(obs, Crashed):
        return _crashed(t, obs, long_s)
    if isinstance(obs, Ended):
        if not t.running:
            return t  # the second node's exit of the same try, or an exit after a stall
        long = not t.steps_seen and t.began_at is not None and obs.at - t.began_at >= long_s
        if t.progressed or t.disturbed or long:
            return replace(t, running=False, failed=0 if (t.progressed or long) else t.failed, crashes=(),
                           grace=True)
        return replace(t, running=False, failed=t.failed + max(1, obs.tries), last=obs)
    if t.running and obs.attempt is None:
        return t  # the daemon starting the trainers of the try that runs (one more node of the job's start)
    if t.running and t.attempt is None and not t.disturbed:
        # the first started line of a try the daemon began: the same try, now named
        step = obs.step if obs.step is not None else t.start_step
        return replace(t, attempt=obs.attempt, start_step=step)
    if t.running:
        t = observe(t, Ended(obs.at, "restarted"), long_s=long_s)
    return replace(t, running=True, began_at=obs.at, start_step=obs.step, attempt=obs.attempt,
                   progressed=False, disturbed=False, grace=False)


def _crashed(t: Tries, obs: Crashed, long_s: float) -> Tries:
    """A node's workers failed. A running try ends as on an exit. Unless that try had
    progressed, ran ``long_s`` or was disturbed, or (no try running) this is the node's
    first failure since one that had (:attr:`Tries.grace`), the node's count goes up
    (back to 1 after workers of a trainer reporting no step ran ``long_s``), and
    ``failed`` is at least that count."""
    last = Ended(obs.at, "workers_failed" if obs.exit_code is None else "exit", node=obs.node,
                 exit_code=obs.exit_code)
    counts = {n: (c, at) for n, c, at in t.crashes}
    if t.running:
        ended = observe(t, last, long_s=long_s)
        if ended.failed <= t.failed:  # the try progressed, ran long or was disturbed: explained
            return replace(ended, crashes=((obs.node, 0, obs.at),))
        t = ended
    elif t.grace and obs.node not in counts:
        counts[obs.node] = (0, obs.at)
        return replace(t, crashes=tuple(sorted((n, k, at) for n, (k, at) in counts.items())))
    c, since = counts.get(obs.node, (0, t.began_at))
    if not t.steps_seen and since is not None and obs.at - since >= long_s:
        c = 0
    counts[obs.node] = (c + 1, obs.at)
    return replace(t, failed=max(t.failed, c + 1), last=last,
                   crashes=tuple(sorted((n, k, at) for n, (k, at) in counts.items())))


def gives_up(t: Tries, max_failures: int) -> bool:
    """Whether the job is ``failed``: ``max_failures`` tries in a row failed."""
    return t.failed >= max_failures
