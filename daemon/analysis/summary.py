"""The run summary: what the trainer really did, from its own logs.

Inputs, all written by the trainer or the daemon while the job ran, never the
chaos schedule:

- per-rank step logs (``<node workdir>/logs/steps-<attempt>-rank<R>.jsonl``): for
  every optimizer step, the global sample positions that rank trained on;
- the trainer status lines (``<node workdir>/status.jsonl``): ``started``,
  ``checkpoint_committed``, ``holding``, ``completed``;
- the daemon's events (interruption notices as the agents saw them, nodes lost).

**Lineage.** Each worker-group incarnation (an *attempt*) resumes from a
committed checkpoint, so the steps that shaped the final model are, for each
step number, its last execution. Executions that a later attempt redid are
*lost steps*; they count as lost *on notice* when their attempt ended by a
notice-driven commit and hold. ``samples_seen_twice``/``samples_skipped`` are
counted over the lineage: every global position in ``[0, steps × global batch)``
must appear exactly once. A step logged by only some ranks of its world (a rank killed
after the step's last collective, before its log line) was trained on whole: the
missing share counts as ``samples_unlogged``, not skipped (:func:`_taken`).

**Restarts and in-process resizes.** An attempt whose ``started`` line says
``resized: "in_process"`` is the survivors of a notice going on in the same worker
processes (``trainer.resize.Resizer.shrink``): it counts in ``resizes_in_process``, not in
``restarts`` (worker-group restarts by torchrun).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

from daemon.model import Event, EventKind

__all__ = ["summarize", "read_jsonl", "attempt_starts"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue  # a line cut by a SIGKILL
                if isinstance(obj, dict):
                    out.append(obj)
    except FileNotFoundError:
        pass
    return out


def summarize(nodes_dir: Path, events: Iterable[Event], *, target_steps: int, global_batch_size: int,
              wall_s: float | None = None) -> dict[str, Any]:
    """Build the demo summary (keys: see README "make demo"). A trainer that wrote nothing
    (a ``job.command`` script) leaves its figures null, not zero, with ``trainer_reports``
    saying so; ``preemptions_with_notice`` is then the notices the daemon delivered."""
    events = list(events)
    steps: list[dict[str, Any]] = []
    status: list[dict[str, Any]] = []
    for node_dir in sorted(p for p in nodes_dir.iterdir() if p.is_dir()) if nodes_dir.exists() else []:
        for f in sorted((node_dir / "logs").glob("steps-*.jsonl")):
            steps += read_jsonl(f)
        status += read_jsonl(node_dir / "status.jsonl")

    # attempts in the order they started
    started = attempt_starts(steps, status)
    order = sorted(started, key=started.get)  # type: ignore[arg-type]
    rank_of = {a: i for i, a in enumerate(order)}

    # executions: (attempt, step) → positions (all ranks) and rank-0 loss
    execs: dict[tuple[str, int], dict[str, Any]] = {}
    for r in steps:
        key = (str(r.get("attempt")), int(r["step"]))
        e = execs.setdefault(key, {"positions": [], "loss": None, "world_size": r.get("world_size"), "ranks": set()})
        e["positions"] += list(r.get("positions") or [])
        e["ranks"].add(r.get("rank"))
        if r.get("rank") == 0:
            e["loss"] = r.get("loss")
    last_exec: dict[int, str] = {}
    for (attempt, step) in sorted(execs, key=lambda k: (rank_of.get(k[0], -1), k[1])):
        last_exec[step] = attempt
    lineage_steps = sorted(last_exec)

    # the global batch the trainer trained on: the config's, unless every step all its ranks
    # logged says otherwise (an HF script's own Trainer arguments make its batch, whatever
    # job.global_batch_size says: the config's would count its steps' samples as skipped)
    whole = {len(e["positions"]) for e in execs.values() if len(e["ranks"]) >= (e.get("world_size") or 0)}
    if len(whole) == 1 and global_batch_size not in whole and 0 not in whole:
        global_batch_size = whole.pop()

    lost_by_attempt: Counter[str] = Counter(a for (a, s) in execs if last_exec.get(s) != a)
    ended_on_notice = _attempts_ended_on_notice(status, execs)
    lost_total = sum(lost_by_attempt.values())
    lost_on_notice = sum(n for a, n in lost_by_attempt.items() if a in ended_on_notice)

    seen: Counter[int] = Counter()
    unlogged = 0
    for step in lineage_steps:
        e = execs[(last_exec[step], step)]
        e["positions"], inferred = _taken(step, e, global_batch_size)
        unlogged += inferred
        seen.update(e["positions"])
    done = len(lineage_steps)
    expected = range((lineage_steps[-1] if lineage_steps else 0) * global_batch_size)
    twice = sum(c - 1 for c in seen.values() if c > 1)
    skipped = sum(1 for p in expected if p not in seen)

    world_sizes: list[int] = []
    for a in order:
        ws = next((s.get("world_size") for s in status if str(s.get("attempt")) == a and s.get("event") == "started"),
                  None)
        if ws is not None and (not world_sizes or world_sizes[-1] != ws):
            world_sizes.append(ws)

    commits = {int(s["step"]) for s in status if s.get("event") == "checkpoint_committed"}
    notices = [e for e in events if e.kind == EventKind.INTERRUPTION_NOTICE.value]
    commit_lines = sorted((s for s in status if s.get("event") == "checkpoint_committed"), key=lambda s: s["time"])
    start_lines = sorted((s for s in status if s.get("event") == "started"), key=lambda s: s["time"])
    to_commit, to_resume, answered = [], [], 0
    for n in notices:
        nid = n.data.get("notice_id")
        seen_at = n.data.get("notice_seen_at") or n.data.get("seen_at") or n.time
        commit = next((c for c in commit_lines if nid in (c.get("notice_ids") or [])), None)
        if commit is None:
            continue
        answered += 1
        to_commit.append(round(commit["time"] - seen_at, 2))
        resume = next((s for s in start_lines if s["time"] > commit["time"]), None)
        if resume is not None:
            to_resume.append(round(resume["time"] - seen_at, 2))

    in_process = {str(s.get("attempt")) for s in start_lines if s.get("resized") == "in_process"}
    first = execs.get((last_exec[lineage_steps[0]], lineage_steps[0])) if lineage_steps else None
    last = execs.get((last_exec[lineage_steps[-1]], lineage_steps[-1])) if lineage_steps else None
    summary = {
        "target_steps": target_steps,
        "steps_completed": done,
        "preemptions_with_notice": answered,
        "nodes_lost_without_notice": sum(1 for e in events if e.kind == EventKind.NODE_LOST.value),
        "lost_steps_on_notice": lost_on_notice,
        "lost_steps_total": lost_total,
        "world_sizes": world_sizes,
        "checkpoints_committed": len(commits),
        "notice_to_commit_s": to_commit,
        "notice_to_resume_s": to_resume,
        "loss_first": round(first["loss"], 4) if first else None,  # a float32's digits, not a float64's
        "loss_last": round(last["loss"], 4) if last else None,
        # samples per optimizer step over the trained lineage: one value, the global batch, across resizes and moves
        "global_batch_sizes": sorted({len(execs[(last_exec[st], st)]["positions"]) for st in lineage_steps}),
        "samples_seen_twice": twice,
        "samples_skipped": skipped,
        "samples_unlogged": unlogged,
        "restarts": max(0, len(order) - 1 - len(in_process)),
        "resizes_in_process": len(in_process),
        "resumes_before_their_commit": resumes_before_their_commit(events),
        **migrations(events),
    }
    if not steps and all(s.get("event") in LAUNCHER_LINES for s in status):
        # nothing written by the trainer (a job.command script reports no step, no commit; its
        # node's launcher may have written torchrun's restarts): what the trainer did is
        # unknown, not zero; the notices are the daemon's own events
        summary.update(dict.fromkeys(_FROM_THE_TRAINER))
        summary["preemptions_with_notice"] = len(notices)
        summary["trainer_reports"] = "none (job.command: the script reports no steps); its figures are null"
    if wall_s is not None:
        summary["wall_s"] = round(wall_s, 1)
    return summary


#: the status lines a node's launcher writes beside the trainer's (daemon/gpunode/launcher.py
#: ``failure_sink``: each failure torchrun restarts): not the trainer's own report
LAUNCHER_LINES = frozenset({"workers_failed"})

#: the summary's figures read from the trainer's own step logs and status lines
_FROM_THE_TRAINER = ("target_steps", "steps_completed", "lost_steps_on_notice", "lost_steps_total", "world_sizes",
                     "checkpoints_committed", "notice_to_commit_s", "notice_to_resume_s", "loss_first", "loss_last",
                     "global_batch_sizes", "samples_seen_twice", "samples_skipped", "samples_unlogged", "restarts",
                     "resizes_in_process")


_TIMELINE = ("boot_s", "commit_s", "copy_s", "first_step_s", "decision_to_first_step_s", "paused_s")


def migrations(events: Iterable[Event]) -> dict[str, Any]:
    """``migrations`` (completed whole-job moves), ``migrations_failed``, and each move's
    timeline in seconds: ``boot_s`` (decision → the target's nodes up; the job trains on
    meanwhile), ``commit_s`` (the drain → the job's commit is in and its workers gone),
    ``copy_s`` (the verified checkpoint copy), ``first_step_s`` (the switch → the first
    step trained in the target), ``decision_to_first_step_s``, and ``paused_s`` (no
    training anywhere: the drain → the first step), with the bytes copied."""
    events = list(events)
    copies = {e.data.get("migration"): e.data for e in events if e.kind == EventKind.CHECKPOINT_REPLICATED.value}
    moves = []
    for e in events:
        if e.kind != EventKind.MIGRATION_COMPLETED.value:
            continue
        d, c = e.data, copies.get(e.data.get("migration"), {})
        moves.append({"from": d.get("source"), "to": d.get("target"), "reason": d.get("reason"),
                      "commit_step": d.get("commit_step"), "bytes": c.get("bytes"),
                      "shards_copied": c.get("shards_copied"), **{k: d.get(k) for k in _TIMELINE}})
    return {"migrations": len(moves),
            "migrations_failed": sum(1 for e in events if e.kind == EventKind.MIGRATION_FAILED.value),
            "migration_timeline": moves}


def resumes_before_their_commit(events: Iterable[Event]) -> int:
    """How many ``job_resumed`` events the log holds before the ``checkpoint_committed``
    of the step they resumed from (0 in a causal log: the daemon records a resume only
    after its commit, whichever node reports which)."""
    committed: set[int] = set()
    acausal = 0
    for e in sorted(events, key=lambda e: e.seq):
        if e.kind == EventKind.CHECKPOINT_COMMITTED.value:
            committed.add(e.data.get("step"))
        elif e.kind == EventKind.JOB_RESUMED.value:
            origin = e.data.get("resumed_from")
            acausal += origin is not None and origin not in committed
    return acausal


def attempt_starts(steps: Iterable[dict[str, Any]], status: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Attempt id → when it started (unix s): its earliest ``started`` status line, else
    its first step-log record."""
    starts: dict[str, float] = {}
    for s in status:
        if s.get("event") == "started":
            a = str(s.get("attempt"))
            starts[a] = min(starts.get(a, s["time"]), s["time"])
    for r in steps:
        starts.setdefault(str(r.get("attempt")), r.get("time", 0.0))
    return starts


def _attempts_ended_on_notice(status: list[dict[str, Any]], execs: dict[tuple[str, int], Any]) -> set[str]:
    """Attempts whose last act was a notice-driven commit followed by a hold."""
    by_attempt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in status:
        by_attempt[str(s.get("attempt"))].append(s)
    out = set()
    for a, lines in by_attempt.items():
        lines.sort(key=lambda s: s["time"])
        holds = [s for s in lines if s.get("event") == "holding"]
        if not holds:
            continue
        hold_step = int(holds[-1].get("step", -1))
        last_step = max((s for (att, s) in execs if att == a), default=-1)
        if last_step <= hold_step:
            out.add(a)
    return out


def _taken(step: int, e: dict[str, Any], global_batch_size: int) -> tuple[list[int], int]:
    """The positions the execution ``e`` of ``step`` trained on, and how many of them no
    log line shows.

    A rank killed after its step's last collective and before its log line leaves the
    step logged by the other ranks only. Every collective of a step the survivors logged
    had every rank in it (the reference step runs them all before ``optimizer.step()``),
    so the missing ranks' share of the step's global batch, ``[(step - 1) × G, step × G)``,
    was trained on as well: counted as seen (``samples_unlogged``), not skipped. A step
    that every rank of its world logged is taken as logged, gaps and all."""
    positions = list(e["positions"])
    lo, hi = (step - 1) * global_batch_size, step * global_batch_size
    if len(e["ranks"]) < (e.get("world_size") or 0) and all(lo <= p < hi for p in positions):
        missing = [p for p in range(lo, hi) if p not in set(positions)]
        return positions + missing, len(missing)
    return positions, 0
