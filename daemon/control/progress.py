"""How fast the job trains and when it will finish: rates over a window, ETA, slack. Pure.

The node that leads the running attempt sends its trainer's newest step with each
heartbeat (:func:`daemon.control.reports.parse_progress`): the step, the loss of that
step, and the tokens its agent has seen trained since it started (the sum of the step
lines' ``tokens``). The daemon keeps these as :class:`Sample` s, one per heartbeat, in a
:class:`ProgressWindow` (bounded: at most ``max_samples``, none older than ``window_s``),
and computes from it, with the clock passed in:

- :func:`rates`: steps per second and tokens per second over the window: (newest −
  oldest) ÷ the seconds between them. A heartbeat that brings no new step is still a
  sample, so a stall shows as a falling rate; the rate is None with fewer than two
  samples in the window or none newer than ``window_s``.
- :func:`expected_finish`: now + steps left ÷ steps per second (unix s), None without a rate.
- :func:`deadline_slack`: deadline − expected finish (seconds; negative: late).
- :func:`goodput`: steps kept ÷ steps executed (:mod:`daemon.controlnode.metrics` says how
  the lost steps are counted).

The window starts over (:meth:`ProgressWindow.add`) when the samples stop being one
series: another node leads the job, the step goes back (a restart resumed from an
older commit: the steps after it are redone, not progress), or the token count goes
back (another agent process). So the rates are of progress kept, not of work redone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Sample", "Rates", "ProgressWindow", "rates", "expected_finish", "deadline_slack", "goodput", "WINDOW_S",
           "MAX_SAMPLES"]

WINDOW_S = 300.0  # the rates' window (seconds): Prometheus' rate() over 5 m, as dashboards use
MAX_SAMPLES = 512  # samples kept at most (one per heartbeat: >= 1 s apart at most nodes' rates)


@dataclass(frozen=True, slots=True)
class Sample:
    """One heartbeat's progress. ``t``: the daemon's clock when it arrived (unix s);
    ``step``: the trainer's newest step; ``tokens``: tokens trained since the agent
    started (cumulative, None when the trainer reports none); ``loss``: that step's loss."""

    t: float
    step: int
    tokens: int | None = None
    loss: float | None = None


@dataclass(frozen=True, slots=True)
class Rates:
    """Steps per second and tokens per second over the window (None: not known)."""

    steps_per_s: float | None
    tokens_per_s: float | None


def rates(samples: "list[Sample] | deque[Sample]", now: float, window_s: float = WINDOW_S) -> Rates:
    """The rates over the samples no older than ``window_s`` before ``now`` (see module).

    Args:
        samples: oldest first, one series (:class:`ProgressWindow` keeps them so).
        now: unix s.
        window_s: seconds, > 0.

    Raises:
        ValueError: ``window_s`` is not > 0.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
    recent = [s for s in samples if now - window_s <= s.t <= now]
    if len(recent) < 2:
        return Rates(None, None)
    first, last = recent[0], recent[-1]
    span = last.t - first.t
    if span <= 0:
        return Rates(None, None)
    steps = max(0, last.step - first.step) / span
    tokens = None
    if first.tokens is not None and last.tokens is not None:
        tokens = max(0, last.tokens - first.tokens) / span
    return Rates(steps, tokens)


def expected_finish(step: int | None, target_steps: int, steps_per_s: float | None, now: float) -> float | None:
    """When the job reaches ``target_steps`` at ``steps_per_s`` from ``now`` (unix s);
    ``now`` once it has; None when the step or a positive rate is not known."""
    if step is None:
        return None
    if step >= target_steps:
        return now
    if steps_per_s is None or not steps_per_s > 0:
        return None
    return now + (target_steps - step) / steps_per_s


def deadline_slack(deadline: float | None, finish: float | None) -> float | None:
    """Seconds between the expected finish and the deadline (negative: late); None when either is unknown."""
    if deadline is None or finish is None:
        return None
    return deadline - finish


def goodput(step: int | None, lost_steps: int) -> float | None:
    """Steps completed ÷ steps executed: ``step / (step + lost_steps)``; None before the first step."""
    if step is None or step + lost_steps <= 0:
        return None
    return step / (step + lost_steps)


class ProgressWindow:
    """The job's progress samples, one series from one node (module docstring). Bounded:
    at most ``max_samples``, and :meth:`add` drops those older than ``window_s``."""

    __slots__ = ("window_s", "samples", "source")

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self.source: str | None = None

    def add(self, source: str, sample: Sample) -> None:
        """A heartbeat's sample from node ``source``; the window starts over when it does
        not continue the series (another source, the step or the tokens went back, the
        clock went back)."""
        last = self.samples[-1] if self.samples else None
        if last is not None and (source != self.source or sample.step < last.step or sample.t < last.t
                                 or (sample.tokens is not None and last.tokens is not None
                                     and sample.tokens < last.tokens)
                                 or (sample.tokens is None) != (last.tokens is None)):
            self.samples.clear()
        self.source = source
        self.samples.append(sample)
        while self.samples and self.samples[0].t < sample.t - self.window_s:
            self.samples.popleft()

    def clear(self) -> None:
        self.samples.clear()
        self.source = None

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def rates(self, now: float) -> Rates:
        return rates(self.samples, now, self.window_s)
