"""``python tests/zygote_host.py [module]``: a launcher stand-in for tests/test_zygote.py.

Forks a zygote (:func:`daemon.gpunode.zygote.fork_server`, preloading ``module``'s
modules), prints the environment its workers' clients need as one JSON line (or
``null`` when it did not start), then waits for the end of its standard input: its exit
closes the zygote's control pipe, as a launcher's exit does. Run apart from pytest,
whose process has threads (a fork must be from a single-threaded process).
"""

import json
import subprocess
import sys
from pathlib import Path

from daemon.gpunode.zygote import Worker, fork_server


def start_host(env: dict[str, str], cwd: Path | str | None = None,
               module: str | None = None) -> tuple[subprocess.Popen, dict | None]:
    """This script as a process of its own under ``env``: its handle (close its standard
    input to end it and its zygote) and what it printed, ``{"env": ..., "pid": ...}``, or
    None when the zygote did not start."""
    proc = subprocess.Popen([sys.executable, __file__, *([module] if module else [])], env=env, cwd=cwd,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline() or "null")


if __name__ == "__main__":
    forked = fork_server(sys.argv[1] if len(sys.argv) > 1 else None)
    if isinstance(forked, Worker):
        forked.run()
        sys.exit(0)
    print(json.dumps(forked and {"env": forked.worker_env(), "pid": forked.pid}), flush=True)
    sys.stdin.read()
