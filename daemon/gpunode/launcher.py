"""``python -m daemon.gpunode.launcher``: torchrun with its imports done before it is needed.

The node agent starts this process as soon as it has registered and knows that its job
is a ``torchrun`` command line, long before the daemon admits the node. It imports
``torch.distributed.run`` (torch and the elastic agent: 1.5-2.5 s on a 2-core machine),
says so on the pipe named by ``$SPOTVISOR_LAUNCHER_READY_FD`` (the agent then tells the
daemon the node is warm, and only then does the daemon ask the survivors for the
rejoin commit), and waits, blocked on its standard input, for one JSON line from the
agent::

    {"argv": [torchrun's arguments, after "-m torch.distributed.run"],
     "env": {the whole environment of the job}, "cwd": "/path" or null}

and then becomes ``torchrun`` with those arguments, in this process: the agent's
SIGTERM on leaving and its wait for the exit work on it as on a plain ``python -m
torch.distributed.run``, and the exit status and the traceback of a failed job are
torchrun's own. One difference: stopped by a signal (the agent's SIGTERM when the node
leaves the job), torchrun stops its workers and then this process dies by that
signal (exit status -15 to the agent) with one line, not torchrun's
``SignalException`` traceback, which reads like a crash in ``spotctl tail``.

Why: a replacement joins the job only after the survivors have committed for it (the
*rejoin* commit), and they hold, idle, until torchrun restarts them at the larger
world size, which starts when the replacement's torchrun reaches the rendezvous. A
torchrun started at that moment spent its import in the survivors' hold; this one has
already paid it, while the survivors still trained.

End of input before the line (the agent stopped, or was told to stop before it
started the job) exits 0 without starting anything. Standard input is ``/dev/null``
once the line is read: torchrun's workers inherit it.

Each failure of the workers that torchrun restarts is told to the agent: a
``workers_failed`` line appended to the job's status file (``$SPOTVISOR_STATUS_FILE``,
:mod:`trainer.contract`) with ``restarts_left``. torchrun says it through its metrics
API (``torch.distributed.elastic.metrics``, documented there: after each look at its
workers the agent puts ``workers.<role>.remaining_restarts`` and then
``workers.<role>.<state>``), to which this process attaches a handler. Without it, a
worker that fails before its trainer writes anything (an import error, a refused NCCL
set-up) is restarted by torchrun up to ``--max-restarts`` times (1000 for a
status-reporting trainer) with nobody told: an H200 trial of 2026-12-04 restarted one
56 times in 6.5 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from daemon.gpunode import zygote
from trainer.contract import STATUS_FILE_ENV

# the write end of a pipe from the agent: "ready\n" is written to it once the import is
# done, and it is closed (so the agent's read ends either way, at EOF if this dies first)
READY_FD_ENV = "SPOTVISOR_LAUNCHER_READY_FD"


def _spec(line: bytes) -> tuple[list[str], dict[str, str], str | None]:
    """The go line's ``(argv, env, cwd)``; ValueError naming the field when malformed."""
    spec = json.loads(line)
    if not isinstance(spec, dict):
        raise ValueError("the go line must be a JSON object")
    argv, env, cwd = spec.get("argv"), spec.get("env"), spec.get("cwd")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv: must be a list of strings (torchrun's arguments)")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env: must be an object of string values")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError("cwd: must be a string or null")
    return argv, env, cwd


def failure_sink(status_path: str | None) -> Any:
    """A ``torch.distributed.elastic.metrics.MetricHandler`` that appends a
    ``{"event": "workers_failed", "time", "restarts_left", "state"}`` line to
    ``status_path`` for each look that found the workers failed (or unhealthy) with
    restarts left, i.e. each failure torchrun restarts. None path: a handler that drops
    everything. An unwritable file is skipped, never raised into torchrun."""
    from torch.distributed.elastic.metrics.api import MetricData, MetricHandler

    class _Sink(MetricHandler):
        def __init__(self) -> None:
            self.restarts_left: int | None = None

        def emit(self, metric_data: MetricData) -> None:
            name, value = metric_data.name, metric_data.value
            if name.endswith(".remaining_restarts"):
                self.restarts_left = value
            elif name.endswith((".failed", ".unhealthy")) and status_path and (self.restarts_left or 0) > 0:
                line = {"event": "workers_failed", "time": time.time(), "restarts_left": self.restarts_left - 1,
                        "state": name.rsplit(".", 1)[1]}
                try:
                    fd = os.open(status_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    try:
                        os.write(fd, (json.dumps(line) + "\n").encode())
                    finally:
                        os.close(fd)
                except OSError:
                    pass

    return _Sink()


def main() -> int:
    import torch.distributed.run  # the import this process exists to do early
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from trainer.torchrun import register

    register()  # --rdzv-backend=spotvisor even where the entry point is shadowed (a stale egg-info on sys.path)

    ready_fd = os.environ.pop(READY_FD_ENV, None)
    module = os.environ.pop(zygote.MODULE_ENV, None)
    forked = None
    if zygote.enabled(os.environ):
        forked = zygote.fork_server(module, close_fds=(int(ready_fd),) if ready_fd and ready_fd.isdigit() else ())
        if isinstance(forked, zygote.Worker):  # this process is one of torchrun's workers now
            forked.run()
            return 0
    if ready_fd is not None and ready_fd.isdigit():  # tell the agent: imported, waiting
        try:
            os.write(int(ready_fd), b"ready\n")
            os.close(int(ready_fd))
        except OSError:
            pass
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0
    try:
        argv, env, cwd = _spec(line)
    except ValueError as exc:  # the agent wrote it: a bug, not a user's mistake
        print(f"spotvisor launcher: bad go line: {exc}", file=sys.stderr)
        return 2
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    if forked is not None and "PYTHON_EXEC" not in env:  # the job's own PYTHON_EXEC: no zygote for it
        os.environ.update(forked.worker_env())
    if cwd:
        os.chdir(cwd)
    sys.argv = [torch.distributed.run.__file__, *argv]
    metrics.configure(failure_sink(env.get(STATUS_FILE_ENV)), "torchelastic")
    try:
        torch.distributed.run.main(argv)
    except SignalException as exc:
        # torchrun has stopped its workers (its own log says so): end by the signal, as an
        # unhandled one would, instead of with torchrun's traceback. This is how a node
        # leaves the job (the agent's SIGTERM after the notice commit): not a crash.
        print(f"spotvisor launcher: torchrun stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        signal.signal(exc.sigval, signal.SIG_DFL)
        os.kill(os.getpid(), exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
