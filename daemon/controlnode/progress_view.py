"""The job's progress as ``spotctl status`` and ``/metrics`` show it: one function, one source.

:func:`job_progress` reads the leading node's heartbeat samples
(:attr:`daemon.controlnode.agent_link.AgentLink.progress`) and the deadline
(:meth:`daemon.controlnode.placement.Placement.progress`) and computes, with the pure
functions of :mod:`daemon.control.progress`: steps/s and tokens/s over the last
:data:`~daemon.control.progress.WINDOW_S`, the newest loss, the expected finish at the
measured rate, the slack it leaves before ``job.deadline``, and goodput
(:func:`daemon.control.progress.goodput`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daemon.control.progress import deadline_slack, expected_finish, goodput

if TYPE_CHECKING:
    from daemon.controlnode.supervisor import Supervisor

__all__ = ["job_progress"]


def job_progress(sup: "Supervisor", now: float, lost_steps: int) -> dict[str, Any]:
    """The job's progress now (unix s ``now``; ``lost_steps``: the daemon's count so far).

    Returns a JSON-able dict, every value None when not known: ``steps_per_s``,
    ``tokens_per_s``, ``loss`` (the newest step's), ``tokens`` (trained since the leading
    node's agent started), ``window_s`` (the rates' window), ``expected_finish`` (unix s,
    at ``steps_per_s``), ``deadline`` (unix s, ``job.deadline``), ``deadline_slack_s``
    (deadline − expected finish; negative: late), ``goodput`` (steps kept ÷ steps run).
    """
    window = sup.agents.progress
    r = window.rates(now)
    last = window.latest()
    step = sup.job.step if isinstance(sup.job.step, int) else None
    finish = expected_finish(step, sup.config.job.target_steps, r.steps_per_s, now)
    placement = sup.migrator.placement.progress(now)
    deadline = None if placement is None else placement.deadline
    return {
        "steps_per_s": r.steps_per_s, "tokens_per_s": r.tokens_per_s,
        "loss": None if last is None else last.loss, "tokens": None if last is None else last.tokens,
        "window_s": window.window_s,
        "expected_finish": _round(finish, 1), "deadline": deadline,
        "deadline_slack_s": _round(deadline_slack(deadline, finish), 1),
        "goodput": goodput(step, lost_steps),
    }


def _round(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)
