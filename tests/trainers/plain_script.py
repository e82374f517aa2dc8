"""A user's own script (``job.command``) as tests/test_plain_notice.py runs it under the
agent's trainer process: ``python plain_script.py MODE READY [OUT]``, only the standard
library.

Modes:
    saver: installs its SIGTERM handler, writes ``ready`` to the FIFO ``READY``, then waits;
        the handler writes what it read from ``$SPOTVISOR_NOTICE`` (``json.load`` only) to
        ``OUT`` as ``{"signal", "notice", "at"}`` and exits 0.
    stubborn: ignores SIGTERM, as does a child it starts; writes the child's pid to the
        FIFO ``READY``, then waits.
"""

import json
import os
import signal
import subprocess
import sys
import time


def saver(ready: str, out: str) -> None:
    def on_term(signum: int, frame: object) -> None:
        with open(os.environ["SPOTVISOR_NOTICE"]) as f:
            notice = json.load(f)
        with open(out, "w") as f:
            json.dump({"signal": signum, "notice": notice, "at": time.time()}, f)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    with open(ready, "w") as f:
        f.write("ready\n")
    while True:
        signal.pause()


def stubborn(ready: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('up', flush=True); signal.pause()"], stdout=subprocess.PIPE)
    child.stdout.readline()
    with open(ready, "w") as f:
        f.write(f"{child.pid}\n")
    while True:
        signal.pause()


if __name__ == "__main__":
    {"saver": saver, "stubborn": stubborn}[sys.argv[1]](*sys.argv[2:])
