"""A node's ``workers_failed`` reports through the daemon's agent port (the launcher's
line, daemon/gpunode/launcher.py; the rule, daemon/control/tries.py): recorded with the
job's secrets masked, and the third failure in a row ends the job ``failed`` with the
error in its why. The real path, torchrun to job_failed, is
tests/e2e/test_job_life_e2e.py."""

from __future__ import annotations

import aiohttp

from daemon.model import JobState
from test_api import running_node

SECRET = "hf_s3cr3t_token_value_0123456789"


async def _post(h, node, *reports: dict) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        async with s.post(f"{h.api.agent_url}/v1/agent/events", json={"node_id": node.id, "events": list(reports)}) as r:
            assert r.status == 200


async def test_three_failures_in_a_row_fail_the_job_with_the_error_masked(spot_daemon) -> None:
    h = spot_daemon
    h.sup.agents.node_logs.mask([SECRET])  # as the supervisor does with the job's secrets at start
    node = await running_node(h)
    line = f"huggingface_hub.errors.HfHubHTTPError: 401 Unauthorized for token {SECRET}"
    for left in (999, 998):
        await _post(h, node, {"kind": "workers_failed", "restarts_left": left, "last_line": line})
    await h.until(lambda: len(h.events("workers_failed")) == 2, what="two failures recorded")
    assert h.sup.job.state is not JobState.FAILED  # two in a row: not yet
    await _post(h, node, {"kind": "workers_failed", "restarts_left": 997, "last_line": line})
    await h.until(lambda: h.events("job_failed"), what="the job failed at the third")
    (failed,) = h.events("job_failed")
    assert failed.data["failed_tries"] == 3
    assert failed.data["why"].endswith("the last workers_failed on test-1: huggingface_hub.errors.HfHubHTTPError: "
                                       "401 Unauthorized for token ***"), failed.data["why"]
    # each event says the job's count, which ends it at 3, not torchrun's budget of 1000 restarts
    assert [(e.data["failed_tries"], e.data["max_restarts_on_errors"], e.data["torchrun_restarts_left"])
            for e in h.events("workers_failed")] == [(1, 3, 999), (2, 3, 998), (3, 3, 997)]
    assert "restarts_left" not in h.events("workers_failed")[0].data
    assert all(SECRET not in e.data["last_line"] for e in h.events("workers_failed"))


async def test_a_failure_of_a_node_joining_in_process_says_no_count_and_adds_none(spot_daemon) -> None:
    """What a workers_failed event says of the job's count is what the count becomes; a
    node joining in-process has its own exit path: its failure is not one of the job's
    tries, and its event says no count."""
    h = spot_daemon
    node = await running_node(h)
    await _post(h, node, {"kind": "workers_failed", "restarts_left": 999, "last_line": "x"})
    await h.until(lambda: len(h.events("workers_failed")) == 1, what="the first failure")
    assert (h.events("workers_failed")[0].data["failed_tries"], h.sup.life.tries.failed) == (1, 1)
    node.joins_running = True  # a node joining in-process: its own exit path, not one of the job's tries
    await _post(h, node, {"kind": "workers_failed", "restarts_left": 998, "last_line": "x"})
    await h.until(lambda: len(h.events("workers_failed")) == 2, what="the joiner's failure")
    assert "failed_tries" not in h.events("workers_failed")[1].data and h.sup.life.tries.failed == 1


async def test_a_failure_report_that_breaks_its_bounds_is_dropped_not_stored(spot_daemon) -> None:
    h = spot_daemon
    node = await running_node(h)
    await _post(h, node, {"kind": "workers_failed", "restarts_left": -1, "last_line": "x"},
                {"kind": "workers_failed", "restarts_left": 5, "last_line": "y" * 10_000})
    await h.until(lambda: h.events("workers_failed"), what="the bounded one recorded")
    (ev,) = h.events("workers_failed")
    assert ev.data["torchrun_restarts_left"] == 5 and len(ev.data["last_line"]) <= 513  # cut, never grown without bound
    assert h.sup.reports_dropped["workers_failed"] == 1
