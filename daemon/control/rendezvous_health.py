"""Whether the job's rendezvous store answers, as the control node sees it. Pure.

Every node's torchrun meets the others through the rendezvous store of the job's
placement domain (``rendezvous.host:port``, or the domain's own): with nothing
listening there, the nodes run, their agents heartbeat, and no trainer ever starts, a
wait torchrun bounds only at its join timeout and the stall watch at ``first_step_s``
(minutes, and then only "no step"). The control node probes the endpoint
(:mod:`daemon.controlnode.rendezvous_watch`: a TCP connect, as
``spotvisord demo`` waits for its own store) and :func:`observe` folds each probe
into a :class:`StoreHealth`:

- ``alarm_after`` failed probes in a row raise one ``rendezvous_unreachable`` (a store
  restarted by its unit in a few seconds, as the chaos schedule's ``kill_store`` does,
  raises none);
- the first probe that answers after an alarm says ``rendezvous_recovered``;
- a probe of another endpoint (the job moved to another domain, or a daemon restart
  with another config) starts afresh: an alarm is about one endpoint.

So one outage is at most two events, however long it lasts, and ``spotctl status``
shows the alarm while it holds (:func:`alarm`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["StoreHealth", "observe", "alarm", "fix", "ALARM_AFTER", "PROBE_INTERVAL_S", "PROBE_TIMEOUT_S"]

#: failed probes in a row before the alarm, the seconds between probes and each probe's bound:
#: at least 10 s of silence (a unit's ``Restart=`` brings a store back in 1-3 s) and at most ~20 s
ALARM_AFTER, PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 3, 5.0, 3.0

Verdict = Literal["rendezvous_unreachable", "rendezvous_recovered"]


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """What the probes of one endpoint said. ``domain``: the placement domain whose store it
    is; ``endpoint``: ``host:port``; ``failures``: failed probes in a row; ``since``: unix s
    of the first of them (None while it answers); ``error``: the newest failure's, one
    line; ``alarmed``: ``rendezvous_unreachable`` was said for this streak."""

    domain: str
    endpoint: str
    failures: int = 0
    since: float | None = None
    error: str = ""
    alarmed: bool = False


def observe(health: StoreHealth | None, *, domain: str, endpoint: str, error: str | None, now: float,
            alarm_after: int = ALARM_AFTER) -> tuple[StoreHealth, Verdict | None]:
    """Fold one probe of ``endpoint`` (``error``: None when it answered, else why not) into
    ``health`` (None: no probe yet). Returns the new value and the event to record, if any.

    Raises:
        ValueError: ``alarm_after`` below 1.
    """
    if alarm_after < 1:
        raise ValueError(f"alarm_after must be at least 1, not {alarm_after}")
    if health is None or (health.domain, health.endpoint) != (domain, endpoint):
        health = StoreHealth(domain, endpoint)
    if error is None:
        verdict: Verdict | None = "rendezvous_recovered" if health.alarmed else None
        return StoreHealth(domain, endpoint), verdict
    failures = health.failures + 1
    health = replace(health, failures=failures, since=now if health.since is None else health.since,
                     error=" ".join(error.split())[:300])
    if failures >= alarm_after and not health.alarmed:
        return replace(health, alarmed=True), "rendezvous_unreachable"
    return health, None


def fix(endpoint: str, *, local: bool) -> str:
    """What to do about a store that does not answer at ``endpoint`` (``host:port``), one line:
    start it (the ``local`` provider's machine is this one), or its unit and the network path."""
    host, _, port = endpoint.rpartition(":")
    start = f"spotvisord rendezvous --host {host} --port {port}"
    if local:
        return f"start it on this machine: {start}"
    return (f"start it on {host} (systemctl start spotvisor-rendezvous, or {start}), and let the control node "
            f"and the job's nodes reach port {port} there")


def alarm(health: StoreHealth | None, *, local: bool) -> dict[str, Any]:
    """``spotctl status``'s ``rendezvous`` field: while an alarm holds, the domain, the
    endpoint, since when (unix s), the newest error and the fix; else ``{}``."""
    if health is None or not health.alarmed:
        return {}
    return {"domain": health.domain, "endpoint": health.endpoint, "since": health.since, "failures": health.failures,
            "error": health.error, "fix": fix(health.endpoint, local=local)}
