"""What an agent reports, parsed and bounded once, at the edge (pure: no I/O).

An agent's token vouches for that node, not for the job: whatever a node sends is
checked here before the daemon computes with it or stores it. Every number must be
of its type (``True`` is not an integer), finite, and inside the bounds the job
allows (a step in ``[0, job.target_steps]``, a world size in ``[1, the most GPUs the
pool can hold]``, bytes and seconds non-negative). A report that fails is dropped
whole by the caller with one log line and one count
(:attr:`daemon.controlnode.supervisor.Supervisor.reports_dropped`), never stored: a value
like ``Infinity`` or ``-1`` in the event log would otherwise break the feed's
rendering or a Prometheus counter on every restart.

:func:`parse_report` turns one report into a typed message; :func:`parse_step`
bounds a heartbeat's step. Both raise :class:`ReportError` with a one-line reason
naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Limits", "ReportError", "StatusLine", "NoticeReport", "MetadataAlarm", "TrainerExited", "WorkersFailed",
    "CodeReady", "SetupFailed", "SETUP_STAGES", "parse_report", "parse_step", "parse_progress", "StepProgress",
    "STATUS_EVENTS", "MAX_TOKENS", "MAX_LOSS", "parse_reports_pending", "MAX_REPORTS_PENDING", "fresh",
    "parse_agent", "MAX_SEQ",
]

#: The one set of trainer status lines (``trainer.contract.StatusKind`` values, written by
#: trainer/runtime.py) an agent forwards to the daemon and the daemon accepts. ``step`` rides
#: the next heartbeat instead (the newest step, its loss and the tokens summed, once a
#: heartbeat however fast the steps come); ``holding`` is for the run's summary.
STATUS_EVENTS = frozenset({"started", "checkpoint_committed", "completed"})
MAX_ID_CHARS = 256
MAX_IDS = 1024
MAX_TEXT_CHARS = 512
MAX_BYTES = 2**60  # 1 EiB: a checkpoint larger than this is a lie
MAX_SECONDS = 7 * 86400.0  # a commit, a save or an upload that took a week is a lie too
# unix times from an agent (a trainer line's time, a notice's deadline): finite, from
# 1970 to the year 5138; no tighter, as a node's clock is its own
MAX_UNIX_S = 1e11
MAX_TOKENS = 2**62  # tokens trained since an agent started: ~4.6e18, far past any run
MAX_REPORTS_PENDING = 2**31  # reports an agent says it still owes; more is a lie
MAX_SEQ = 2**53  # a report's number (``seq``) from its agent process
MAX_LOSS = 1e30  # |loss|; a NaN or infinite loss is dropped (the feed and the gauges take finite numbers)


class ReportError(ValueError):
    """A report that cannot be used; ``str()`` is one line naming the field."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds a report must keep."""

    max_step: int  # job.target_steps
    max_world_size: int  # pool.max_nodes x the largest offer's GPUs


@dataclass(frozen=True, slots=True)
class StatusLine:
    """A trainer's ``started``, ``checkpoint_committed`` or ``completed`` line."""

    event: str
    attempt: str
    rank: int | None
    world_size: int | None
    step: int
    time: float | None = None
    resumed_from: int | None = None
    resized: str | None = None
    notice_ids: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    reason: str | None = None
    seconds: float | None = None
    bytes: int | None = None
    save_s: float | None = None
    upload_s: float | None = None


@dataclass(frozen=True, slots=True)
class NoticeReport:
    """An interruption notice or a rebalance recommendation the agent saw."""

    kind: str
    notice_id: str | None
    action: str | None
    provider: str | None
    notice_deadline: str | float | None  # as the notice carries it (ISO text or unix s)
    deadline: float | None  # unix s
    seen_at: float | None  # unix s


@dataclass(frozen=True, slots=True)
class MetadataAlarm:
    kind: str  # metadata_unreachable | metadata_recovered
    failures: int | None
    error: str | None
    url: str | None


@dataclass(frozen=True, slots=True)
class TrainerExited:
    exit_code: int | None


@dataclass(frozen=True, slots=True)
class WorkersFailed:
    """The node's torchrun saw its workers fail and restarts them: ``restarts_left`` of its
    own after this one, ``last_line`` the newest exception in its log (cut)."""

    restarts_left: int | None
    last_line: str


# where a node's preparation failed (daemon/gpunode/code.py)
SETUP_STAGES = frozenset({"fetch", "verify", "unpack", "setup", "timeout"})
_SHA256_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class CodeReady:
    """The node prepared: ``sha256`` of the workdir it unpacked ("" none), ``setup_s``
    its setup took, ``trainer`` its torchrun's state now (``warming`` once prewarming)."""

    sha256: str
    setup_s: float | None
    trainer: str | None


@dataclass(frozen=True, slots=True)
class SetupFailed:
    """The node's preparation failed at ``stage`` (:data:`SETUP_STAGES`); ``exit_code``
    of the setup command, the last line of its output (or the error), the workdir's ``sha256``."""

    stage: str
    exit_code: int | None
    last_line: str
    sha256: str


Report = StatusLine | NoticeReport | MetadataAlarm | TrainerExited | WorkersFailed | CodeReady | SetupFailed


def _sha(d: dict[str, Any]) -> str:
    v = d.get("sha256") or ""
    if not isinstance(v, str) or (v and (len(v) != 64 or not set(v) <= _SHA256_CHARS)):
        raise ReportError("sha256 is not a hex sha256")
    return v


def _int(d: dict[str, Any], key: str, lo: int, hi: int, *, required: bool = False) -> int | None:
    v = d.get(key)
    if v is None:
        if required:
            raise ReportError(f"{key} is missing")
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReportError(f"{key} is not an integer")
    if not lo <= v <= hi:
        raise ReportError(f"{key} {v} is outside [{lo}, {hi}]")
    return v


def _num(d: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ReportError(f"{key} is not a number")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ReportError(f"{key} {v!r} is outside [{lo:g}, {hi:g}]")
    return float(v)


def _text(d: dict[str, Any], key: str, limit: int = MAX_TEXT_CHARS, *, cut: bool = False) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ReportError(f"{key} is not a string")
    if len(v) > limit:
        if not cut:
            raise ReportError(f"{key} is longer than {limit} characters")
        v = v[:limit] + "…"
    return v


def _ids(d: dict[str, Any], key: str) -> tuple[str, ...]:
    v = d.get(key)
    if v is None:
        return ()
    if not (isinstance(v, list) and all(isinstance(i, str) and len(i) <= MAX_ID_CHARS for i in v)):
        raise ReportError(f"{key} is not a list of strings")
    if len(v) > MAX_IDS:
        raise ReportError(f"{key} has more than {MAX_IDS} entries")
    return tuple(v)


def parse_step(value: Any, limits: Limits) -> int | None:
    """A heartbeat's ``step``: None, or an integer in ``[0, limits.max_step]``.

    Raises:
        ReportError: anything else.
    """
    return _int({"step": value}, "step", 0, limits.max_step)


def parse_reports_pending(value: Any) -> int:
    """A heartbeat's ``reports_pending``: the reports its agent has queued that no daemon
    has answered yet, an integer in ``[0, MAX_REPORTS_PENDING]``; absent (an agent older
    than the field) is 0.

    Raises:
        ReportError: anything else.
    """
    return _int({"reports_pending": value}, "reports_pending", 0, MAX_REPORTS_PENDING) or 0


def parse_agent(value: Any) -> str | None:
    """A report batch's ``agent``: the id of the agent process that numbered its reports
    (1 to 64 lowercase hex digits), or None (an agent older than the numbering).

    Raises:
        ReportError: anything else.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 64 or value.strip("0123456789abcdef"):
        raise ReportError("agent is not an agent id (1-64 lowercase hex digits)")
    return value


def _seq(report: Any) -> int | None:
    v = report.get("seq") if isinstance(report, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_SEQ else None


def fresh(reports: list[Any], agent: str | None, applied_from: str, applied: int) -> tuple[list[Any], int]:
    """The reports of a batch not applied yet, and the highest number applied after it.

    An agent numbers its reports (``seq``: 1, 2, ... for the life of its process, named
    by ``agent``); ``applied`` is the highest number applied from process
    ``applied_from``. A report numbered at most that, from that process, was applied
    already (its batch is sent again because its answer was lost with a daemon): left
    out. A new process starts from 0; a batch without ``agent``, or a report without a
    number, is applied as it comes (at least once, as before the numbering).
    """
    if agent is None:
        return list(reports), applied
    upto = applied if agent == applied_from else 0
    out = [r for r in reports if (n := _seq(r)) is None or n > upto]
    return out, max([upto, *(n for r in out if (n := _seq(r)) is not None)])


@dataclass(frozen=True, slots=True)
class StepProgress:
    """A heartbeat's ``progress``: the trainer's newest ``step`` line as its agent read it.
    ``tokens``: tokens trained since the agent started (the sum of the step lines'
    ``tokens``; None: the trainer reports none); ``loss``: the newest step's loss."""

    step: int
    tokens: int | None
    loss: float | None


def parse_progress(value: Any, limits: Limits) -> StepProgress | None:
    """A heartbeat's ``progress`` object: None when absent; ``step`` in ``[0,
    limits.max_step]``, ``tokens`` in ``[0, MAX_TOKENS]``, ``loss`` finite and within
    ``±MAX_LOSS``.

    Raises:
        ReportError: anything else (one line naming the field).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ReportError("progress is not an object")
    step = _int(value, "step", 0, limits.max_step, required=True)
    assert step is not None
    loss = value.get("loss")
    if isinstance(loss, int) and not isinstance(loss, bool) and abs(loss) > MAX_LOSS:
        raise ReportError(f"loss is outside [{-MAX_LOSS:g}, {MAX_LOSS:g}]")  # (an int too large for a float)
    return StepProgress(step=step, tokens=_int(value, "tokens", 0, MAX_TOKENS),
                        loss=_num(value, "loss", -MAX_LOSS, MAX_LOSS))


def _status_line(line: Any, limits: Limits) -> StatusLine:
    if not isinstance(line, dict):
        raise ReportError("line is not an object")
    event = line.get("event")
    if not isinstance(event, str) or event not in STATUS_EVENTS:
        raise ReportError(f"line.event {str(event)[:40]!r} is not one of {', '.join(sorted(STATUS_EVENTS))}")
    attempt = line.get("attempt")
    if isinstance(attempt, bool) or not isinstance(attempt, (str, int)) or not str(attempt) \
            or len(str(attempt)) > MAX_ID_CHARS:
        raise ReportError("attempt is not an id")
    step = _int(line, "step", 0, limits.max_step, required=True)
    assert step is not None
    world = _int(line, "world_size", 1, limits.max_world_size)
    if event == "started" and world is None:
        raise ReportError("world_size is missing")
    resumed_from = _int(line, "resumed_from", 0, step)
    return StatusLine(
        event=event, attempt=str(attempt), step=step, world_size=world,
        rank=_int(line, "rank", 0, limits.max_world_size - 1),
        time=_num(line, "time", 0.0, MAX_UNIX_S),
        resumed_from=resumed_from, resized=_text(line, "resized", 32),
        notice_ids=_ids(line, "notice_ids"), kinds=_ids(line, "kinds"), reason=_text(line, "reason", 32),
        seconds=_num(line, "seconds", 0.0, MAX_SECONDS), bytes=_int(line, "bytes", 0, MAX_BYTES),
        save_s=_num(line, "save_s", 0.0, MAX_SECONDS), upload_s=_num(line, "upload_s", 0.0, MAX_SECONDS),
    )


def _notice(kind: str, r: dict[str, Any]) -> NoticeReport:
    notice = r.get("notice") or {}
    if not isinstance(notice, dict):
        raise ReportError("notice is not an object")
    times = (0.0, MAX_UNIX_S)
    raw_deadline = notice.get("deadline")
    if isinstance(raw_deadline, (int, float)) and not isinstance(raw_deadline, bool):
        raw_deadline = _num(notice, "deadline", *times)
    elif raw_deadline is not None:
        raw_deadline = _text(notice, "deadline", 64)
    try:
        deadline, seen_at = _num(r, "deadline", *times), _num(r, "seen_at", *times)
    except ReportError as exc:
        if "not a number" in str(exc):
            raise ReportError(str(exc).replace("not a number", "not unix seconds")) from None
        raise
    return NoticeReport(kind=kind, notice_id=_text(notice, "id", MAX_ID_CHARS), action=_text(notice, "action", 64),
                        provider=_text(notice, "provider", 32), notice_deadline=raw_deadline,
                        deadline=deadline, seen_at=seen_at)


def parse_report(r: Any, limits: Limits) -> Report | None:
    """One agent report as a typed message; None for a kind this daemon does not know
    (a newer agent's: the caller logs it and goes on).

    Raises:
        ReportError: the report is not usable (one line naming the field).
    """
    if not isinstance(r, dict):
        raise ReportError("not a JSON object")
    kind = r.get("kind")
    if kind in ("interruption_notice", "rebalance_recommendation"):
        return _notice(kind, r)
    if kind == "trainer_status":
        return _status_line(r.get("line"), limits)
    if kind in ("metadata_unreachable", "metadata_recovered"):
        return MetadataAlarm(kind=kind, failures=_int(r, "failures", 0, 2**31),
                             error=_text(r, "error", cut=True), url=_text(r, "url", cut=True))
    if kind == "trainer_exited":
        return TrainerExited(exit_code=_int(r, "exit_code", -255, 255))
    if kind == "workers_failed":
        return WorkersFailed(restarts_left=_int(r, "restarts_left", 0, 2**31),
                             last_line=_text(r, "last_line", cut=True) or "")
    if kind == "code_ready":
        return CodeReady(sha256=_sha(r), setup_s=_num(r, "setup_s", 0.0, MAX_SECONDS),
                         trainer=_text(r, "trainer", 32))
    if kind == "setup_failed":
        stage = r.get("stage")
        if stage not in SETUP_STAGES:
            raise ReportError(f"stage {str(stage)[:40]!r} is not one of {', '.join(sorted(SETUP_STAGES))}")
        return SetupFailed(stage=stage, exit_code=_int(r, "exit_code", -255, 255),
                           last_line=_text(r, "last_line", cut=True) or "", sha256=_sha(r))
    return None
