"""``/metrics`` against bad values already in the event log (issue 13, defect 4).

An older daemon stored a node's commit report unchecked: ``bytes: -1`` made
``Counter.inc`` raise on every scrape (HTTP 500), and again after a restart, since the
counters are rebuilt from the log. Now such values are ignored (one log line each,
counted in ``spotvisor_event_values_ignored_total``) and every other metric is right.
"""

from __future__ import annotations

import math

import pytest
import structlog

from daemon.controlnode import metrics
from daemon.controlnode.metrics import DaemonMetrics
from test_metrics import samples, scrape_socket

BAD_COMMITS = [
    {"reason": "notice", "bytes": -1, "seconds": -2.0},  # the probe
    {"reason": "notice", "bytes": math.inf, "seconds": math.nan},
    {"reason": "notice", "bytes": "1000", "seconds": True},
    {"reason": "notice", "bytes": 10**400, "seconds": [1]},  # too large for a float
]
BAD_RESUMES = [{"lost_steps": True}, {"lost_steps": -5}, {"lost_steps": "7"}, {"lost_steps": 10**400},
               {"lost_steps": 2.5}]


async def test_bad_values_in_the_store_never_break_a_scrape(spot_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    h = spot_daemon
    store = h.sup.store
    # what older daemons stored, around good events
    store.append_event("checkpoint_committed", "test-1", {"reason": "periodic", "seconds": 1.5, "bytes": 1000})
    for data in BAD_COMMITS:
        store.append_event("checkpoint_committed", "test-1", data)
    for data in BAD_RESUMES:
        store.append_event("job_resumed", None, data)
    store.append_event("checkpoint_committed", "test-1", {"reason": ["x"] * 3, "seconds": 3.0, "bytes": 3000})
    store.append_event("job_resumed", None, {"lost_steps": 2})

    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(metrics, "log", structlog.get_logger("spotvisor.metrics"))  # uncached: captured
        _, text = await scrape_socket(h.socket_path)  # asserts HTTP 200
        again = await scrape_socket(h.socket_path)  # and the next scrape too
    restarted = DaemonMetrics(h.sup).text()  # a restarted daemon rebuilds the counters from the whole log

    for m in (samples(text), samples(again[1]), samples(restarted)):
        assert m[("spotvisor_checkpoints_committed_total", (("reason", "periodic"),))] == 1
        assert m[("spotvisor_checkpoints_committed_total", (("reason", "notice"),))] == 4  # the commits count
        assert m[("spotvisor_checkpoints_committed_total", (("reason", "unknown"),))] == 1  # a reason not a string
        assert m[("spotvisor_checkpoint_commit_seconds_count", ())] == 2
        assert m[("spotvisor_checkpoint_commit_seconds_sum", ())] == 4.5
        assert m[("spotvisor_checkpoint_bytes_total", ())] == 4000
        assert m[("spotvisor_checkpoint_last_bytes", ())] == 3000
        assert m[("spotvisor_lost_steps_total", ())] == 2
        assert m[("spotvisor_events_total", (("kind", "checkpoint_committed"),))] == 6
        ignored = {k[1]: v for k, v in m.items() if k[0] == "spotvisor_event_values_ignored_total"}
        assert ignored == {(("field", "bytes"), ("kind", "checkpoint_committed")): 4,
                           (("field", "seconds"), ("kind", "checkpoint_committed")): 4,
                           (("field", "lost_steps"), ("kind", "job_resumed")): 5}
    lines = [e for e in logs if e["event"] == "metrics_event_value_ignored"]
    assert len(lines) == 13  # one per value, once: the second scrape reads only new events
    assert [(e["kind"], e["field"], e["value"]) for e in lines[:2]] == [
        ("checkpoint_committed", "seconds", "-2.0"), ("checkpoint_committed", "bytes", "-1")]


async def test_non_numeric_job_state_from_old_node_rows_leaves_the_series_out(spot_daemon) -> None:
    """The job's step and world size come from what nodes reported; a ``"pwned"`` (or a
    number too large for a float) left there by an older daemon does not fail a scrape."""
    h = spot_daemon
    h.sup.job.world_size = "pwned"
    h.sup.job.step = 10**400
    _, text = await scrape_socket(h.socket_path)
    m = samples(text)
    assert not [k for k in m if k[0] in ("spotvisor_world_size", "spotvisor_job_step", "spotvisor_goodput_ratio")]
    assert m[("spotvisor_job_target_steps", ())] == h.config.job.target_steps


async def test_gpu_figures_out_of_bounds_are_dropped_at_intake_and_counted(spot_daemon) -> None:
    """Issue 25, item 10: a heartbeat's GPU figures reached /metrics unbounded
    (``sm_utilization_percent 1e+308``, ``memory_used_bytes -1e+30``). Utilisation must be
    a percent in [0, 100] and memory an integer in [0, 1 TiB]: a figure outside is dropped
    alone (that GPU's series is absent), logged and counted; the good figures stay."""
    from test_metrics import agent_post

    h = spot_daemon
    await h.until(lambda: "test-1" in h.sup.nodes and h.sup.nodes["test-1"].instance_id, what="a node")
    node = h.sup.nodes["test-1"]
    gpu = [
        {"index": 0, "sm_util_pct": 1e308, "mem_used_bytes": -10**30, "mem_total_bytes": 80 * 2**30},
        {"index": 1, "sm_util_pct": 55.5, "mem_used_bytes": 10 * 2**30, "mem_total_bytes": 2**41},
        {"index": 2, "sm_util_pct": -3.0, "mem_used_bytes": True, "mem_total_bytes": 80 * 2**30},
    ]
    await agent_post(h, node, "/v1/agent/register", {})
    await agent_post(h, node, "/v1/agent/heartbeat", {"step": None, "trainer": {"state": "not_started"}, "gpu": gpu})
    _, text = await scrape_socket(h.socket_path)
    m = samples(text)

    def gpu_series(name: str) -> dict[str, float]:
        return {dict(k[1])["gpu"]: v for k, v in m.items() if k[0] == name and dict(k[1]).get("node") == "test-1"}

    assert gpu_series("spotvisor_gpu_sm_utilization_percent") == {"1": 55.5}
    assert gpu_series("spotvisor_gpu_memory_used_bytes") == {"1": 10 * 2**30}
    assert gpu_series("spotvisor_gpu_memory_total_bytes") == {"0": 80 * 2**30, "2": 80 * 2**30}
    assert m[("spotvisor_agent_reports_dropped_total", (("kind", "gpu"),))] == 5
    # a payload of another shape is dropped whole, and counted once
    await agent_post(h, node, "/v1/agent/heartbeat", {"trainer": {"state": "not_started"},
                                                      "gpu": [{"index": 10**30, "sm_util_pct": 50}]})
    m = samples((await scrape_socket(h.socket_path))[1])
    assert m[("spotvisor_agent_reports_dropped_total", (("kind", "gpu"),))] == 6
    assert gpu_series("spotvisor_gpu_sm_utilization_percent") == {}  # the node's sample is absent now
    assert h.sup.agents.gpu_watch.latest("test-1") is None
