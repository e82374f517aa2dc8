"""The figures of ``bench/compare.py``, from one run's trainer logs and daemon events.

Inputs, as :mod:`daemon.analysis.summary` reads them: the per-rank step logs
(``<node>/logs/steps-<attempt>-rank<R>.jsonl``), the trainer status lines
(``<node>/status.jsonl``) and the daemon's events (the bench's ``chaos_injected``
events carry each preemption's ``published_at``). Everything here but
:func:`load_run` is pure, and computed the same way for every system, so the
systems are comparable. Definitions: bench/README.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from daemon.control.policies import DEFAULT_POLICY
from daemon.model import Event, EventKind
from daemon.analysis.summary import attempt_starts, read_jsonl

__all__ = [
    "load_run",
    "step_durations",
    "lineage",
    "useful_step_time",
    "full_world_step_times",
    "apply_goodput",
    "add_relative_goodput",
    "NO_PREEMPTION",
    "preemption_profile",
    "run_metrics",
    "format_table",
    "format_profile",
    "acceptance",
]

def load_run(nodes_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records of every rank, status lines) of every node under ``nodes_dir``."""
    steps: list[dict] = []
    status: list[dict] = []
    for node_dir in sorted(p for p in nodes_dir.iterdir() if p.is_dir()) if nodes_dir.exists() else []:
        for f in sorted((node_dir / "logs").glob("steps-*.jsonl")):
            steps += read_jsonl(f)
        status += read_jsonl(node_dir / "status.jsonl")
    return steps, status


def step_durations(steps: Sequence[dict], status: Sequence[dict]) -> dict[tuple[str, int], float]:
    """(attempt, step) → seconds that step took on rank 0.

    A step runs from the step boundary it began at to its record in rank 0's step log.
    The boundary is the latest of: the previous step's record, the attempt's
    ``started`` line (the checkpoint is loaded), a ``checkpoint_committed`` line of
    the attempt (a commit at that boundary). Commits, holds and restarts are so never
    counted as step time; a step after a hold that timed out takes the attempt's median.
    """
    marks: dict[str, list[float]] = {}
    holds: dict[str, list[float]] = {}
    for s in status:
        a = str(s.get("attempt"))
        if s.get("event") in ("started", "checkpoint_committed"):
            marks.setdefault(a, []).append(s["time"])
        elif s.get("event") == "holding":
            holds.setdefault(a, []).append(s["time"])
    by_attempt: dict[str, list[dict]] = {}
    for r in steps:
        if r.get("rank") == 0:
            by_attempt.setdefault(str(r.get("attempt")), []).append(r)
    out: dict[tuple[str, int], float] = {}
    for a, recs in by_attempt.items():
        recs.sort(key=lambda r: r["time"])
        unknown: list[tuple[str, int]] = []
        prev: float | None = None
        for r in recs:
            t = r["time"]
            starts = [m for m in marks.get(a, []) if m <= t] + ([prev] if prev is not None else [])
            begin = max(starts) if starts else None
            if begin is None or any(begin < h < t for h in holds.get(a, [])):
                unknown.append((a, int(r["step"])))
            else:
                out[(a, int(r["step"]))] = t - begin
            prev = t
        known = [out[k] for k in out if k[0] == a]
        for key in unknown:
            out[key] = statistics.median(known) if known else 0.0
    return out


def lineage(steps: Iterable[dict], status: Iterable[dict]) -> dict[int, str]:
    """Step number → the attempt whose execution of it counts (the last one), as daemon/analysis/summary.py."""
    steps = list(steps)
    order = attempt_starts(steps, status)
    last: dict[int, str] = {}
    for r in sorted(steps, key=lambda r: (order.get(str(r.get("attempt")), 0.0), int(r["step"]))):
        last[int(r["step"])] = str(r.get("attempt"))
    return last


def useful_step_time(steps: Sequence[dict], status: Sequence[dict]) -> float:
    """Seconds of the steps that shaped the final model: Σ over the lineage of their duration."""
    durations = step_durations(steps, status)
    return sum(durations.get((a, s), 0.0) for s, a in lineage(steps, status).items())


def full_world_step_times(steps: Sequence[dict], status: Sequence[dict]) -> list[float]:
    """Rank 0's step durations (:func:`step_durations`) at the largest world size of the run."""
    worlds = {(str(r.get("attempt")), int(r["step"])): r.get("world_size") for r in steps if r.get("rank") == 0}
    top = max((w for w in worlds.values() if w is not None), default=None)
    return sorted(v for k, v in step_durations(steps, status).items() if worlds.get(k) == top)


def apply_goodput(result: dict[str, Any], reference_step_s: float) -> None:
    """``goodput`` = useful steps × the reference step time ÷ wall (in place)."""
    result["reference_step_s"] = round(reference_step_s, 4)
    result["useful_step_s"] = round(result["useful_steps"] * reference_step_s, 1)
    result["goodput"] = round(result["useful_steps"] * reference_step_s / max(result["wall_s"], 1e-9), 3)


def preemption_profile(fired: Event, steps: Sequence[dict], status: Sequence[dict],
                       events: Sequence[Event], *, completed_at: float | None = None) -> dict[str, Any]:
    """Where the time went after one injected preemption, in seconds after its notice
    (``published_at``); None for what did not happen.

    ``notice_seen_s``: the agent saw it; ``commit_s``: the commit that answers it;
    ``node_gone_s``: the node ended (terminated / lost); ``replacement_ready_s``: the
    next node registered; ``restarts``: each attempt started after the notice up to
    the resuming one, as [s, world size]; ``resume_s``: the first step trained by an
    attempt started after the notice (``notice_to_resume_s``); ``full_again_s``: the
    first step trained at the world size of before the notice again (after the
    replacement joined); ``grow_hold_s``: from the rejoin commit that let the
    replacement in to ``full_again_s``, the time every rank waited for the grow's
    restart (spotvisor only); after an in-process grow (``job.grow: in_process``), from
    rank 0's last step before it to the grown attempt's ``started`` line: the boundary's
    check, the new group, the state sent to the joiners, the re-wrap. ``taken``: the node
    ended before the job completed (``completed_at``); a baseline's job may complete
    within the lead, and then the preemption never hit it.
    """
    t0 = float(fired.data.get("published_at") or fired.time)
    node = fired.node
    after = [e for e in events if e.time >= t0 - 1.0]

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 2)

    notice = next((e for e in after if e.kind == EventKind.INTERRUPTION_NOTICE.value and e.node == node), None)
    nid = notice.data.get("notice_id") if notice is not None else None
    seen_at = (notice.data.get("notice_seen_at") or notice.time) if notice is not None else None
    commit = None
    if nid is not None:
        commit = min((s["time"] for s in status if s.get("event") == "checkpoint_committed"
                      and nid in (s.get("notice_ids") or [])), default=None)
    gone = next((e.time for e in after if e.node == node and e.time >= t0
                 and e.kind in (EventKind.NODE_TERMINATED.value, EventKind.NODE_LOST.value)), None)
    ready = next((e.time for e in after if e.kind == EventKind.NODE_READY.value and e.time >= t0), None)
    starts = attempt_starts(steps, status)
    worlds = {str(s.get("attempt")): s.get("world_size") for s in status if s.get("event") == "started"}
    resumed_from = {str(s.get("attempt")): s.get("step") for s in status if s.get("event") == "started"}
    later = sorted((t, a) for a, t in starts.items() if t > t0)
    first_step: tuple[float, str] | None = None
    for r in steps:
        a = str(r.get("attempt"))
        if r.get("rank") == 0 and starts.get(a, 0.0) > t0 and (first_step is None or r["time"] < first_step[0]):
            first_step = (r["time"], a)
    restarts = [[rel(t), worlds.get(a)] for t, a in later if first_step is None or t <= starts[first_step[1]]]
    before = max(((t, a) for a, t in starts.items() if t <= t0), default=None)
    full = worlds.get(before[1]) if before is not None else None
    full_again = min((r["time"] for r in steps if r.get("rank") == 0 and starts.get(str(r.get("attempt")), 0.0) > t0
                      and full is not None and (worlds.get(str(r.get("attempt"))) or 0) >= full), default=None)
    rejoin = None  # the commit that let the replacement in (spotvisor's grow): the survivors hold from it
    if full_again is not None:
        rejoin = max((s["time"] for s in status if s.get("event") == "checkpoint_committed" and t0 < s["time"] < full_again
                      and any(str(i).startswith("rejoin-") for i in s.get("notice_ids") or [])), default=None)
    grown = None  # an in-process grow: the started line of the attempt the replacement joined
    if full_again is not None and rejoin is None:
        grown = min((s for s in status if s.get("event") == "started" and s.get("joined") and s.get("rank") == 0
                     and t0 < s["time"] <= full_again), key=lambda s: s["time"], default=None)
    last_before = None if grown is None else max(
        (r["time"] for r in steps if r.get("rank") == 0 and r["time"] < grown["time"]), default=None)
    if rejoin is not None and full_again is not None:
        grow_hold = round(full_again - rejoin, 2)
    elif grown is not None and last_before is not None:
        grow_hold = round(grown["time"] - last_before, 2)
    else:
        grow_hold = None
    return {
        "index": fired.data.get("index"),
        "node": node,
        "trace": fired.data.get("trace"),
        "action": fired.data.get("action"),
        "lead_s": fired.data.get("lead_s"),
        "published": fired.data.get("published"),
        "step_at_notice": fired.data.get("step"),
        "late_s": fired.data.get("late_s"),
        "notice_seen_s": rel(seen_at),
        "commit_s": rel(commit),
        "node_gone_s": rel(gone),
        "replacement_ready_s": rel(ready),
        "restarts": restarts,
        "resumed_from_step": resumed_from.get(first_step[1]) if first_step else None,
        "resume_s": rel(first_step[0]) if first_step else None,
        "full_again_s": rel(full_again),
        "grow_hold_s": grow_hold,
        "taken": gone is not None and (completed_at is None or gone < completed_at),
    }


def run_metrics(steps: Sequence[dict], status: Sequence[dict], events: Sequence[Event],
                summary: dict[str, Any], *, reference_step_s: float | None = None) -> dict[str, Any]:
    """The figures of one run (see bench/README.md for each definition).

    ``reference_step_s``: the step time goodput counts each useful step at; default
    ``step_s``, the median of this run's steps at full world size (its own pace, so a
    machine slower during one run than another does not tilt the comparison).
    """
    launches = [e.time for e in events if e.kind == EventKind.NODE_LAUNCH_REQUESTED.value]
    done = [s["time"] for s in status if s.get("event") == "completed"]
    start = min(launches) if launches else min((s["time"] for s in status), default=0.0)
    end = min(done) if done else max([e.time for e in events] + [s["time"] for s in status], default=start)
    wall = max(end - start, 1e-9)
    full = full_world_step_times(steps, status)
    if reference_step_s is None:
        reference_step_s = statistics.median(full) if full else 0.0
    fired = [e for e in events if e.kind == EventKind.CHAOS_INJECTED.value and not e.data.get("skipped")]
    profile = [preemption_profile(e, steps, status, events, completed_at=min(done) if done else None)
               for e in fired]
    result = {
        "completed": bool(done),
        "wall_s": round(wall, 1),
        "useful_steps": summary["steps_completed"],
        "lost_steps": summary["lost_steps_total"],
        "lost_steps_on_notice": summary["lost_steps_on_notice"],
        "goodput": 0.0,
        "step_s": round(statistics.median(full), 4) if full else None,
        "measured_useful_step_s": round(useful_step_time(steps, status), 1),
        "preemptions": sum(1 for p in profile if p["taken"]),  # fired, and the node taken while the job ran
        "notice_to_commit_s": [p["commit_s"] for p in profile if p["commit_s"] is not None],
        "notice_to_resume_s": [p["resume_s"] for p in profile if p["resume_s"] is not None],
        "restarts": summary["restarts"],  # worker-group restarts by torchrun
        "resizes_in_process": summary.get("resizes_in_process", 0),  # survivors going on without one
        "profile": profile,
    }
    apply_goodput(result, reference_step_s)
    return result


NO_PREEMPTION = "no_preemption"


def add_relative_goodput(results: dict[str, dict[str, Any]], reference: str = NO_PREEMPTION) -> None:
    """``goodput_vs_no_preemption`` in each result (in place): its goodput ÷ that of the same
    job run without a trace (``reference``), when that ran."""
    ref = results.get(reference)
    for r in results.values():
        r["goodput_vs_no_preemption"] = (round(r["goodput"] / ref["goodput"], 3)
                                         if ref is not None and ref["goodput"] else None)


def _med_max(values: Sequence[float]) -> str:
    return "-" if not values else f"{statistics.median(values):.1f} / {max(values):.1f}"


def _restarts(r: dict[str, Any]) -> str:
    """Torchrun restarts, then ``+N`` in-process resizes when there were any."""
    n = r.get("resizes_in_process") or 0
    return f"{r['restarts']}+{n}" if n else str(r["restarts"])


def format_table(results: dict[str, dict[str, Any]]) -> str:
    head = (f"{'system':<22} {'wall_s':>7} {'useful':>6} {'lost':>5} {'step_s':>6} {'goodput':>7} {'vs none':>7} "
            f"{'notice->commit s':>17} {'notice->resume s':>17} {'restarts':>8} {'preempted':>9}")
    lines = [head, f"{'':<22} {'':>7} {'steps':>6} {'steps':>5} {'':>6} {'':>7} {'':>7} {'median / max':>17} "
                   f"{'median / max':>17}"]
    for name, r in results.items():
        step_s = "-" if r.get("step_s") is None else f"{r['step_s']:.3f}"
        rel = r.get("goodput_vs_no_preemption")
        lines.append(f"{name:<22} {r['wall_s']:>7.1f} {r['useful_steps']:>6} {r['lost_steps']:>5} {step_s:>6} "
                     f"{r['goodput']:>7.3f} {'-' if rel is None else f'{rel:.3f}':>7} "
                     f"{_med_max(r['notice_to_commit_s']):>17} "
                     f"{_med_max(r['notice_to_resume_s']):>17} {_restarts(r):>8} {r['preemptions']:>9}"
                     + ("" if r["completed"] else "   (did not complete)"))
    return "\n".join(lines)


def format_profile(results: dict[str, dict[str, Any]]) -> str:
    """Per preemption: seconds after the notice of each thing that happened."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"{'system':<22} {'#':>2} {'trace':<14} {'step':>5} {'seen':>5} {'commit':>6} {'gone':>5} "
             f"{'repl.ready':>10} {'from':>5}  restarts (s:world)  first step  full again  grow hold"]
    for name, r in results.items():
        for p in r["profile"]:
            rs = (" ".join(f"{f(t)}:{w}" for t, w in p["restarts"]) or "-") if p["taken"] else "job completed first"
            lines.append(f"{name:<22} {p['index']:>2} {p['trace'] or '-':<14} {p['step_at_notice'] or 0:>5} "
                         f"{f(p['notice_seen_s']):>5} {f(p['commit_s']):>6} {f(p['node_gone_s']):>5} "
                         f"{f(p['replacement_ready_s']):>10} {p['resumed_from_step'] if p['resumed_from_step'] is not None else '-':>5}"
                         f"  {rs:<18}  {f(p['resume_s']):>10}  {f(p.get('full_again_s')):>10}"
                         f"  {f(p.get('grow_hold_s')):>9}")
    return "\n".join(lines)


def acceptance(results: dict[str, dict[str, Any]], *, trace_len: int | None = None) -> list[str]:
    """Issue 7's goals, each met or missed by how much (only for the systems that ran);
    first, a warning for each system that met fewer preemptions than the trace has
    (its job completed before the next one could fire: its figures are not comparable)."""
    out = [f"WARNING: {name} met {r['preemptions']} of the trace's {trace_len} preemptions (its job completed "
           "before a node was taken): lengthen --target-steps" for name, r in results.items()
           if trace_len is not None and r["preemptions"] < trace_len and name != NO_PREEMPTION]
    sv = results.get(DEFAULT_POLICY)
    if sv is None:
        return out
    out += [f"spotvisor lost steps on notice: {sv['lost_steps_on_notice']} (goal 0): "
           + ("met" if sv["lost_steps_on_notice"] == 0 else "MISSED")]
    rel = sv.get("goodput_vs_no_preemption")
    if rel is not None:
        out.append(f"goodput: spotvisor {rel:.3f} of no_preemption's (goal >= 0.9): "
                   + ("met" if rel >= 0.9 else "MISSED"))
    for name in (n for n in results if n not in (DEFAULT_POLICY, NO_PREEMPTION)):
        b = results[name]
        ratio = sv["goodput"] / b["goodput"] if b["goodput"] else float("inf")
        out.append(f"goodput: spotvisor {sv['goodput']:.3f} vs {name} {b['goodput']:.3f} "
                   f"({(ratio - 1) * 100:+.1f} %): " + ("met" if ratio > 1 else "MISSED"))
    a = results.get("restart_on_preemption")
    if a is not None and sv["notice_to_resume_s"] and a["notice_to_resume_s"]:
        mine, theirs = statistics.median(sv["notice_to_resume_s"]), statistics.median(a["notice_to_resume_s"])
        speedup = theirs / mine if mine else float("inf")
        out.append(f"notice->resume median: spotvisor {mine:.1f} s vs restart_on_preemption {theirs:.1f} s = "
                   f"{speedup:.1f}x (goal >= 5x): " + ("met" if speedup >= 5 else f"MISSED by {5 / speedup:.1f}x"))
    return out
