"""What a node agent says while the daemon is out of reach: a few lines, not one a call.

An agent talks to the daemon from three loops (heartbeats every 1-600 s, the command
long-poll and the report outbox, each retried up to 5 s apart). While the daemon is
away (a restart, an HA takeover, a lost control node: minutes) each loop used to log
every failed call, hundreds of lines a node, which buried what the operator needs:
when the daemon went away, why, and when it came back.

:class:`Outage` decides, from the outcome of each call and the clock passed in (no I/O),
which lines to say: the first failure (``daemon_unreachable``: the call and the error;
``daemon_certificate_untrusted``, an error, when the daemon's certificate does not
verify), a change of reason (refused → timed out → 503 "not leading"), a reminder every :data:`REMIND_EVERY_S` while it lasts
(``daemon_still_unreachable``: how long and how many failed calls), and the first
answer after it (``daemon_reachable``: how long it lasted). Its memory is a few fields
however long the outage lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["REMIND_EVERY_S", "Line", "Outage"]

REMIND_EVERY_S = 60.0  # seconds between reminders while the daemon stays out of reach


@dataclass(frozen=True)
class Line:
    """A log line to say: ``level`` ("warning", "error" or "info"), ``event``, fields."""

    level: str
    event: str
    fields: dict[str, Any]


@dataclass
class Outage:
    """The daemon's reachability as this agent's calls see it (see the module docstring).

    Attributes:
        since: monotonic time of the first failed call of the current outage (None: none).
        failures: failed calls in the current outage.
    """

    since: float | None = None
    failures: int = 0
    _reason: str = field(default="", repr=False)
    _said_at: float = field(default=0.0, repr=False)

    def failed(self, now: float, call: str, reason: str, error: str) -> Line | None:
        """A call to the daemon failed at ``now`` (monotonic seconds). ``call``: which
        (``heartbeat``, ``commands``, ``reports``, ``register``); ``reason``: the failure's
        kind (a short stable word: ``unreachable``, ``timeout``, ``http_503``,
        ``certificate_untrusted``); ``error``: its text (cut to 300 characters).
        The line to say, or None."""
        self.failures += 1
        error = error[:300]
        if self.since is None or reason != self._reason:
            first = self.since is None
            if first:
                self.since = now
            self._reason, self._said_at = reason, now
            level = "error" if reason == "certificate_untrusted" else "warning"
            note = ("the daemon's certificate does not verify against this agent's CA (--ca-file) or name; "
                    "nothing was sent to it") if reason == "certificate_untrusted" else None
            event = "daemon_certificate_untrusted" if reason == "certificate_untrusted" else "daemon_unreachable"
            return Line(level, event, {
                "call": call, "reason": reason, "error": error,
                **({} if first else {"down_s": round(now - self.since, 1), "failed_calls": self.failures}),
                **({"note": note} if note else {})})
        if now - self._said_at >= REMIND_EVERY_S:
            self._said_at = now
            return Line("warning", "daemon_still_unreachable", {
                "reason": reason, "down_s": round(now - self.since, 1), "failed_calls": self.failures,
                "error": error})
        return None

    def answered(self, now: float) -> Line | None:
        """A call to the daemon was answered at ``now``: the line that ends an outage, or None."""
        if self.since is None:
            return None
        line = Line("info", "daemon_reachable", {"down_s": round(now - self.since, 1),
                                                 "failed_calls": self.failures})
        self.since, self.failures, self._reason = None, 0, ""
        return line
