"""A trainer stand-in: what a node agent runs as its trainer in the agent, spotctl and
chaos tests (tests/test_agent.py, tests/test_ctl.py, tests/chaos/test_daemon_kill.py).

It speaks the trainer's side of the agent's file contract (``trainer/contract.py``):
status lines appended to ``$SPOTVISOR_STATUS_FILE``, notices read from
``$SPOTVISOR_NOTICE_FILE`` at each step boundary (every 20 ms). Only the standard
library, so a test runs it by path (``python tests/trainers/standin.py [flags]``, or as
the one worker of a ``torchrun``) and it starts in a fraction of a second.

Three ways it runs:

* **idle** (default): reports ``started`` at ``--step``, prints ``--print-lines`` lines
  to stdout, and answers each new notice with ``checkpoint_committed`` (at the next
  step) + ``holding`` naming it; it never ends on its own, a SIGTERM ends it by the
  signal. Example: ``--step 3``, notice ``r1`` -> ``checkpoint_committed`` step 4
  ``notice_ids ["r1"]``, then ``holding``.
* **training** (``STANDIN_LEDGER`` set): trains one step every ``STANDIN_STEP_S``
  seconds from the newest step in the ledger (a JSON list of committed steps: the
  "object store", written before the status line) to ``STANDIN_TARGET``, commits
  there (``final``) and exits 0. A notice is answered with a commit of the current
  step; an interruption then holds (``holding``) until the agent's SIGTERM.
* **until finished** (``STANDIN_FINISH`` set): steps every 20 ms from 0 (a ``step`` line
  each), commits every 10 steps (``periodic``), ignores notices; once the file
  ``STANDIN_FINISH`` exists it commits ``STANDIN_TARGET`` (``final``) and completes (exit
  0), as ``trainer.run`` does at its target.

Environment (all optional but the ledger's):
    STANDIN_GATE: a path; commit a notice only once this file exists (the flush is still
        uploading until then).
    STANDIN_FAIL_ONCE: a path; idle: the first run (the file absent) creates it and exits 1
        once started, as when its rendezvous store went away under it. The attempt id is
        then ``standin-<pid>`` (each run its own), else ``standin-1``.
    STANDIN_RANK: the rank in the status lines (default 0).
    STANDIN_MORE: a path; idle: once this file exists, print its text too (once).
    STANDIN_LEDGER, STANDIN_TARGET, STANDIN_STEP_S: training: the ledger file, the last
        step, the seconds a step takes.
    STANDIN_FINISH, STANDIN_TARGET: until finished: the file that ends the run, the step
        it completes at.
    STANDIN_HOLD_AT: training: a first run (nothing committed, no notice yet) waits at this
        step for its notice, so the job cannot end before the test's notice reaches it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BOUNDARY_S = 0.02  # seconds between two step boundaries while idle or gated


class StandIn:
    """The status writer and notice reader of one stand-in process."""

    def __init__(self, *, step: int, attempt: str) -> None:
        self.status = os.environ["SPOTVISOR_STATUS_FILE"]
        self.notices = os.environ["SPOTVISOR_NOTICE_FILE"]
        self.gate = os.environ.get("STANDIN_GATE")
        self.rank = int(os.environ.get("STANDIN_RANK", "0"))
        self.step, self.attempt = step, attempt
        self.handled: set[str] = set()

    def emit(self, event: str, **fields: object) -> None:
        """Append one status line at the current step."""
        rec = {"event": event, "time": time.time(), "attempt": self.attempt, "rank": self.rank,
               "world_size": 1, "step": self.step, "pid": os.getpid(), **fields}
        with open(self.status, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def new_notices(self) -> list[dict]:
        """The notice-file entries not answered yet (a missing or half-written file: none)."""
        try:
            with open(self.notices) as f:
                pending = json.load(f)
        except (OSError, ValueError):
            pending = []
        return [n for n in pending if n["id"] not in self.handled]

    def gate_open(self) -> bool:
        return not self.gate or os.path.exists(self.gate)


def idle(args: argparse.Namespace) -> None:
    fail_once, more = os.environ.get("STANDIN_FAIL_ONCE"), os.environ.get("STANDIN_MORE")
    job = StandIn(step=args.step, attempt="standin-%d" % os.getpid() if fail_once else "standin-1")
    job.emit("started", resumed_from=None)
    if fail_once and not os.path.exists(fail_once):  # its rendezvous store went away under it
        open(fail_once, "w").close()
        sys.exit(1)
    for i in range(1, args.print_lines + 1):
        print(f"trainer line {i}", flush=True)
    printed_more = False
    while True:  # a trainer's step boundaries; default SIGTERM handling ends it
        if more and not printed_more and os.path.exists(more):
            with open(more) as f:
                print(f.read(), end="", flush=True)
            printed_more = True
        new = job.new_notices()
        if new and job.gate_open():
            job.step += 1
            ids, kinds = [n["id"] for n in new], [n["kind"] for n in new]
            job.emit("checkpoint_committed", notice_ids=ids, kinds=kinds, reason="notice",
                     seconds=args.commit_s, bytes=args.commit_bytes)
            job.emit("holding", notice_ids=ids, kinds=kinds, timeout_s=90)
            job.handled.update(ids)
        time.sleep(BOUNDARY_S)


def train(args: argparse.Namespace) -> None:
    ledger = os.environ["STANDIN_LEDGER"]
    hold_at = int(os.environ.get("STANDIN_HOLD_AT", "-1"))
    target, step_s = int(os.environ["STANDIN_TARGET"]), float(os.environ["STANDIN_STEP_S"])

    def committed() -> list[int]:
        try:
            with open(ledger) as f:
                return json.load(f)
        except (OSError, ValueError):
            return []

    def commit(reason: str, ids: tuple[str, ...] = (), kinds: tuple[str, ...] = ()) -> None:
        done = committed()
        if job.step not in done:  # the ledger is the object store: written before the status line
            tmp = "%s.tmp-%d" % (ledger, os.getpid())
            with open(tmp, "w") as f:
                json.dump(done + [job.step], f)
            os.replace(tmp, ledger)
        job.emit("checkpoint_committed", reason=reason, notice_ids=list(ids), kinds=list(kinds),
                 seconds=args.commit_s, bytes=args.commit_bytes)

    step = max(committed(), default=0)
    job = StandIn(step=step, attempt="standin-%d" % os.getpid())
    job.emit("started", resumed_from=step or None)
    while True:  # one step boundary per iteration
        new = job.new_notices()
        if new:
            if not job.gate_open():  # the flush is still uploading
                time.sleep(BOUNDARY_S)
                continue
            ids, kinds = [n["id"] for n in new], [n["kind"] for n in new]
            commit("notice", tuple(ids), tuple(kinds))
            job.handled.update(ids)
            if "interruption" in kinds:
                job.emit("holding", notice_ids=ids, kinds=kinds, timeout_s=90)
                while True:  # held until the agent's SIGTERM
                    time.sleep(1)
        if job.step == hold_at and not job.handled and not committed():
            time.sleep(BOUNDARY_S)  # the job cannot finish before the test's notice reaches it
            continue
        if job.step >= target:
            commit("final")
            job.emit("completed")
            sys.exit(0)
        time.sleep(step_s)
        job.step += 1


def until_finished(args: argparse.Namespace) -> None:
    finish = os.environ["STANDIN_FINISH"]
    job = StandIn(step=0, attempt="standin-1")
    job.emit("started", resumed_from=None)
    while not os.path.exists(finish):
        time.sleep(BOUNDARY_S)
        job.step += 1
        job.emit("step")
        if job.step % 10 == 0:
            job.emit("checkpoint_committed", reason="periodic", notice_ids=[], kinds=[], seconds=args.commit_s,
                     bytes=args.commit_bytes)
    job.step = int(os.environ["STANDIN_TARGET"])  # a trainer completes at the job's target step
    job.emit("checkpoint_committed", reason="final", notice_ids=[], kinds=[], seconds=args.commit_s,
             bytes=args.commit_bytes)
    job.emit("completed")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", type=int, default=7, help="idle: the step it reports (a commit is at the next)")
    p.add_argument("--print-lines", type=int, default=0, help="idle: print 'trainer line 1' .. N once started")
    p.add_argument("--commit-s", type=float, default=0.01, help="the seconds each commit reports")
    p.add_argument("--commit-bytes", type=int, default=10, help="the bytes each commit reports")
    args = p.parse_args(argv)
    if os.environ.get("STANDIN_FINISH"):
        until_finished(args)
    elif os.environ.get("STANDIN_LEDGER"):
        train(args)
    else:
        idle(args)


if __name__ == "__main__":
    main()
