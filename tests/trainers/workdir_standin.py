"""A trainer stand-in shipped as the job's code (``job.workdir``) in tests/test_code_delivery.py:
the test copies it into the workdir as ``standin_job.py`` (run as ``-m standin_job``).

It records where it runs and whether the setup's marker was there before it started
(``$SPOTVISOR_LOG_DIR/../ran.json``: ``cwd``, ``version``, ``marker``), reports
``started`` at step 0, and trains nothing: it runs until the agent stops it. A test ships
a new version by editing ``VERSION``.
"""

import json
import os
import signal
import time

VERSION = "v1"


def main() -> None:
    with open(os.path.join(os.environ["SPOTVISOR_LOG_DIR"], "..", "ran.json"), "w") as f:
        json.dump({"cwd": os.getcwd(), "version": VERSION, "marker": os.path.exists("setup-marker")}, f)
    with open(os.environ["SPOTVISOR_STATUS_FILE"], "a") as f:
        f.write(json.dumps({"event": "started", "time": time.time(), "attempt": "a1", "rank": 0,
                            "world_size": 1, "step": 0}) + "\n")
    signal.pause()  # trains nothing: runs until the agent stops it


if __name__ == "__main__":
    main()
