"""spotctl's rendering: the daemon's JSON answers as the tables and lines a person reads.

Pure functions of the answer (and ``now``); a value no clock can show renders as
``<time VALUE>`` rather than failing (:func:`_clock`). :mod:`daemon.interfaces.ctl` prints them.
"""

from __future__ import annotations

import math
import time
from typing import Any

from daemon.model import Event

__all__ = ["render_status", "render_nodes", "render_cost", "render_event"]


def _clock(t: Any, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """Unix seconds ``t`` as local time in ``fmt``; a value no clock shows (inf, nan, 1e308,
    not a number: a stored value spotctl did not write) as ``<time VALUE>``, never an error."""
    try:
        return time.strftime(fmt, time.localtime(t))
    except (OverflowError, ValueError, OSError, TypeError):
        return f"<time {t!r}>"


def _duration(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _gpu(n: dict[str, Any]) -> str:
    g = n.get("gpu")
    return "n/a" if not g or g.get("sm_util_pct") is None else f"{g['sm_util_pct']:.0f}%"


def render_nodes(status: dict[str, Any]) -> str:
    """The nodes table. ``SM%``: mean GPU utilization of the node now (n/a: no GPU sample);
    ``CODE``: the ``job.workdir`` version it runs (its sha256's first 12 digits; a job with one only)."""
    code = any(n.get("code_version") for n in status["nodes"])
    rows = [["NODE", "DOMAIN", "PROVIDER", "ZONE", "TYPE", "GPUS", "STATE", "UPTIME", "USD/H", "STEP", "SM%"]
            + (["CODE"] if code else [])]
    for n in status["nodes"]:
        rows.append([
            n["id"], n.get("domain") or "-", n["provider"], n.get("zone") or "-", n["instance_type"], str(n["gpus"]),
            n["state"],
            _duration(n.get("uptime_s")), f"{n.get('price_usd_h') or 0:.3f}",
            "-" if n.get("step") is None else str(n["step"]), _gpu(n),
        ] + ([(n.get("code_version") or "-")[:12]] if code else []))
    return _table(rows)


def render_status(status: dict[str, Any], now: float | None = None) -> str:
    """The job table (like ``sky jobs queue``), the pool line and the live nodes, as ``spotctl status`` prints them.

    SUBMITTED: the first launch request; TOT. DURATION: since then; JOB DURATION: since
    the trainer first started, minus time paused; #RECOVERIES: job members lost (with or
    without notice) that the job carried on without; RESTARTS: worker-group restarts by
    torchrun, then ``(+N in-process)``: resizes in the running workers (a shrink, a grow,
    a loss's rebuild), which restart nothing.
    """
    now = time.time() if now is None else now
    job, pool = status["job"], status["pool"]
    commit = "none"
    if job.get("last_commit_step") is not None:
        ago = "" if job.get("last_commit_time") is None else f" ({_duration(now - job['last_commit_time'])} ago)"
        commit = f"step {job['last_commit_step']}{ago}"
    submitted = job.get("submitted_at")
    step = "-" if job.get("step") is None else str(job["step"])
    head = _table([
        ["JOB", "STATE", "STEP", "WORLD", "SUBMITTED", "TOT. DURATION", "JOB DURATION", "#RECOVERIES", "RESTARTS",
         "LAST COMMIT"],
        [str(job["id"]), job["state"].upper(), f"{step}/{job['target_steps']}", str(job.get("world_size") or "-"),
         "-" if submitted is None else f"{_duration(now - submitted)} ago", _duration(job.get("total_s")),
         _duration(job.get("running_s")), str(job.get("recoveries", 0)),
         str(job.get("restarts", 0)) + (f" (+{job['resizes_in_process']} in-process)" if job.get("resizes_in_process")
                                        else ""),
         commit],
    ])
    live = [n for n in status["nodes"] if n["state"] not in ("terminated", "lost", "failed")]
    line = (f"pool {pool['name']}  {len(live)} live / target {pool['target_nodes']} nodes "
            f"({pool.get('min_nodes', '?')}..{pool.get('max_nodes', '?')})")
    if pool.get("paused"):
        line += ("  paused: releasing " + ", ".join(n["id"] for n in live) if live
                 else "  paused: no capacity held (spotctl resume relaunches)")
    if job["state"] in ("failed", "cancelled"):
        line += (f"  {job['state']}: releasing " + ", ".join(n["id"] for n in live) if live
                 else f"  {job['state']}: no capacity held (spotctl resume starts it again)")
    line += _placement(status.get("placement") or {})
    line += _checks(status.get("checks") or {}, now)
    code = status.get("code") or {}
    if code.get("version"):
        line += f"  code {code['version'][:12]}"
    if code.get("halted"):  # job.setup failed on node after node: nothing is bought until a restart
        line += "\nNOT BUYING: " + code["halted"]
    line += _rendezvous(status.get("rendezvous") or {}, now)
    if job["state"] in ("failed", "cancelled"):  # why (daemon/controlnode/job_life.py)
        line += f"\n{job['state'].upper()}: {job.get('why') or 'no reason recorded'}"
    progress = _progress(job.get("progress") or {}, now)
    return head + "\n" + progress + line + "\n" + render_nodes({"nodes": live or status["nodes"]})


def _progress(p: dict[str, Any], now: float) -> str:
    """The progress line under the job table (``""`` while nothing is known): steps/s and
    tokens/s over the window, the newest loss, the expected finish at that rate, the slack
    before ``job.deadline``, goodput."""
    parts = []
    if _num(p.get("steps_per_s")):
        parts.append(f"{p['steps_per_s']:.3g} steps/s")
    if _num(p.get("tokens_per_s")):
        parts.append(f"{p['tokens_per_s']:,.0f} tokens/s")
    if _num(p.get("loss")):
        parts.append(f"loss {p['loss']:.4g}")
    if _num(p.get("expected_finish")):
        left = p["expected_finish"] - now
        parts.append(f"expected finish {_clock(p['expected_finish'], '%Y-%m-%d %H:%M')}"
                     + (f" (in {_duration(left)})" if left > 0 else ""))
    if _num(p.get("deadline_slack_s")):
        slack = p["deadline_slack_s"]
        parts.append(f"deadline slack {_duration(abs(slack))}" + ("" if slack >= 0 else " LATE"))
    if _num(p.get("goodput")):
        parts.append(f"goodput {p['goodput']:.3f}")
    return "progress  " + "  ".join(parts) + "\n" if parts else ""


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _checks(c: dict[str, Any], now: float) -> str:
    """The cloud check's lines under the pool line: why offers are not bought, and when it is tried again."""
    if c.get("state") == "pending":
        return "\n  not buying yet: the cloud check is running"
    if c.get("state") != "failing":
        return ""
    retry = "" if c.get("retry_at") is None else f", tried again in {_duration(max(0.0, c['retry_at'] - now))}"
    offers = ", ".join(f"offers.{i}" for i in c.get("blocked_offers") or []) or "none"
    out = f"\n  not buying {offers}: the cloud check failed (spotvisord check CONFIG){retry}"
    return out + "".join(f"\n    {line}" for line in c.get("failed") or [])


def _rendezvous(r: dict[str, Any], now: float) -> str:
    """The line saying the job's rendezvous store does not answer (``""`` while it does):
    no node can start training until it does (:mod:`daemon.control.rendezvous_health`)."""
    if not r.get("endpoint"):
        return ""
    since = f" for {_duration(max(0.0, now - r['since']))}" if _num(r.get("since")) else ""
    return (f"\nRENDEZVOUS STORE NOT ANSWERING at {r['endpoint']} (domain {r.get('domain', '?')}){since}: "
            f"{r.get('error') or 'no answer'}; no node can start training until it does; {r.get('fix') or ''}")


def _placement(p: dict[str, Any]) -> str:
    """``  domain D`` (+ ``, N migrations``) and the move in flight, for the pool line."""
    if not p.get("domain"):
        return ""
    out = f"  domain {p['domain']}"
    if p.get("migrations") or p.get("migrations_failed"):
        out += f" ({p.get('migrations', 0)} migrations, {p.get('migrations_failed', 0)} failed)"
    m = p.get("migration")
    if m:
        out += f"  migrating {m['from']} -> {m['to']} ({m['phase']}, {m['reason']})"
    d = p.get("deadline")
    if d:
        out += f"  deadline in {d['hours_to_deadline']:g} h, {d['hours_of_work_left']:g} h of work left"
        if d.get("expected_finish") is not None:
            at = _clock(d["expected_finish"], "%Y-%m-%d %H:%M")
            slack = d.get("slack_h") or 0.0
            out += f", expected to finish {at} ({slack:g} h {'to spare' if slack >= 0 else 'LATE'})"
        out += f", buying {'+'.join(d['markets'] or ['any'])}"
        if d.get("policy"):  # the spending policy (job.deadline_policy, auto resolved)
            out += f" ({d['policy']})"
    h = p.get("placement")
    if h and h.get("action") in ("wait", "move"):
        left, wait = h.get("left_s"), h.get("wait_s")
        out += f"  {h['action']}: {h.get('reason', '')}"
        if _num(left) and _num(wait):
            out += f" ({left / 3600:.1f} h left, {wait / 3600:.1f} h to finish waiting)"
    past = p.get("market_past")
    if _num(past) and past > 0:
        out += f"  with the past of {past:g} other pool{'s' if past != 1 else ''} (daemon.market_dir)"
    return out


def _usd(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def render_cost(cost: dict[str, Any]) -> str:
    """One row per node (hours x USD/h = USD, spot and on demand), totals and how they are derived."""
    rows = [["NODE", "OFFER", "STATE", "HOURS", "SPOT USD/H", "SPOT USD", "ON-DEMAND USD/H", "ON-DEMAND USD"]]
    for n in cost["nodes"]:
        od_h = n["on_demand_price_usd_h"]
        rows.append([n["id"], n["offer"], n["state"], f"{n['hours']:.3f}", f"{n['price_usd_h']:.3f}",
                     _usd(n["spot_usd"]), "n/a" if od_h is None else f"{od_h:.3f}", _usd(n["on_demand_usd"])])
    rows.append(["total", "", "", f"{cost['hours']:.3f}", "", _usd(cost["spot_usd"]), "", _usd(cost["on_demand_usd"])])
    out = [_table(rows), "",
           f"spot USD so far {_usd(cost['spot_usd'])} (now {cost['spot_usd_h_now']:.3f} USD/h)"]
    if cost["savings_usd"] is None:
        out.append("on-demand equivalent: n/a (set offers[].on_demand_price_usd_h in the config)")
    else:
        out.append(f"on-demand equivalent USD {_usd(cost['on_demand_usd'])}, savings USD {_usd(cost['savings_usd'])}"
                   f" ({cost['savings_pct'] if cost['savings_pct'] is not None else 'n/a'} %)")
    if cost["unpriced_nodes"]:
        out.append(f"no on-demand price for: {', '.join(cost['unpriced_nodes'])} (left out of the savings)")
    if cost.get("egress_usd"):
        out.append(f"migration egress USD {_usd(cost['egress_usd'])} (checkpoint copies between domains)")
    if cost.get("on_demand_nodes_usd"):
        out.append(f"on-demand nodes USD {_usd(cost['on_demand_nodes_usd'])} (the fallback; with job.deadline, "
                   "what keeping the deadline cost)")
    out.append(f"how: {cost['how']}")
    return "\n".join(out)


def render_event(ev: dict[str, Any]) -> str:
    from daemon.interfaces.cli import format_event

    e = Event(ev["seq"], ev["time"], ev["kind"], ev.get("node"), ev.get("data") or {})
    line = format_event(e, 0.0)
    return _clock(e.time) + line[line.index("]") + 1:]
