"""Issue 25, item 5: a node's token cannot make the daemon record events without end.

A real daemon (Supervisor + ApiServer, the ``spot_daemon`` fixture) in the test's loop;
the test is the node's agent (and the attacker holding its token).
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from daemon.control.bounds import INTAKE_RATES, MAX_AGENT_BODY_BYTES, ReportClass
from test_agent_port_limits import metrics, running_node, sample


# -- item 5: report floods -----------------------------------------------------------------------
async def test_a_report_flood_from_one_token_is_bounded_counted_and_spares_vital_reports(spot_daemon) -> None:
    """1,000 metadata alarms from one node's token (ten POSTs of 100): the node's routine
    bucket records at most its burst plus its rate over the time taken, every other
    report is counted per node and reason in /metrics, and a trainer's exit from the same
    node (vital: a bucket of its own) is still recorded. On main all 1,000 were stored."""
    h = spot_daemon
    node = await running_node(h)
    url = f"{h.api.agent_url}/v1/agent/events"  # type: ignore[attr-defined]
    t0 = time.time()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        for k in range(10):
            batch = [{"kind": "metadata_unreachable", "time": t0, "failures": 100 * k + i, "error": "timeout"}
                     for i in range(100)]
            async with s.post(url, json={"node_id": node.id, "events": batch}) as r:
                assert r.status == 200
        elapsed = time.time() - t0
        async with s.post(url, json={"node_id": node.id, "events": [{"kind": "trainer_exited", "exit_code": 3}]}) as r:
            assert r.status == 200
    stored = len(h.events("metadata_unreachable"))
    routine = INTAKE_RATES[ReportClass.ROUTINE]
    assert stored <= routine.burst + routine.per_s * elapsed + 1, (stored, elapsed)
    assert [e.data["exit_code"] for e in h.events("trainer_exited")] == [3]
    text = await metrics(h)
    assert sample(text, "spotvisor_agent_reports_limited_total", node=node.id, reason="rate") == 1000 - stored


async def test_repeats_in_a_post_collapse_and_a_post_over_the_cap_is_cut(spot_daemon) -> None:
    h = spot_daemon
    node = await running_node(h)
    notice = {"kind": "rebalance_recommendation", "time": 1.0, "seen_at": time.time(),
              "notice": {"id": "rb-1", "provider": "aws"}}
    alarms = [{"kind": "metadata_recovered", "time": 2.0, "failures": i} for i in range(150)]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        async with s.post(f"{h.api.agent_url}/v1/agent/events",  # type: ignore[attr-defined]
                          json={"node_id": node.id, "events": [notice] * 5 + alarms}) as r:
            assert r.status == 200
    assert len(h.events("rebalance_recommendation")) == 1
    text = await metrics(h)
    assert sample(text, "spotvisor_agent_reports_limited_total", node=node.id, reason="duplicate") == 4
    assert sample(text, "spotvisor_agent_reports_limited_total", node=node.id, reason="too_many") == 55


def test_the_agent_sends_its_backlog_in_requests_the_daemon_takes() -> None:
    """An agent's backlog after an outage goes out in batches within the daemon's caps
    (count and bytes), in order; a report that could never fit is dropped, not resent for ever."""
    from daemon.gpunode.daemon_link import _next_batch

    def sized(r: dict[str, Any]) -> tuple[dict[str, Any], int]:
        return r, len(json.dumps(r)) + 2

    pending = [sized({"kind": "trainer_status", "i": i}) for i in range(250)]
    sizes = []
    while pending:
        batch, pending = _next_batch(pending)
        sizes.append(len(batch))
    assert sizes == [100, 100, 50]
    big = [sized({"kind": "x", "i": i, "pad": "y" * (MAX_AGENT_BODY_BYTES // 3)}) for i in range(4)]
    huge = sized({"kind": "huge", "pad": "z" * MAX_AGENT_BODY_BYTES})
    batch, rest = _next_batch([huge, *big])
    assert [r["i"] for r in batch] == [0, 1] and len(rest) == 2
