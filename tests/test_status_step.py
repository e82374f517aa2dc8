"""``spotctl status``'s STEP (daemon/controlnode/views.py): never behind the newest commit."""

from __future__ import annotations

from daemon.config import load_config
from daemon.control.state import JobView
from daemon.controlnode.views import status

CONFIG = load_config("configs/local.yaml")


def _step(step: int | None, committed: int | None) -> int | None:
    job = JobView(step=step, last_commit_step=committed)
    return status(CONFIG, job, [], target_nodes=1, desired_nodes=1, paused=False, now=0.0)["job"]["step"]


def test_a_commit_reported_before_its_steps_heartbeat_is_the_step_shown() -> None:
    # the commit of step 600 came in its report; the heartbeat carrying step 600 comes after
    # (a fresh-clone user trial saw "STEP 582/1500" beside "LAST COMMIT step 600")
    assert _step(582, 600) == 600
    assert _step(612, 600) == 612  # heartbeats ahead of the commit: theirs
    assert _step(None, 600) == 600 and _step(7, None) == 7 and _step(None, None) is None
