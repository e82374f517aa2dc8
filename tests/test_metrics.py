"""Metrics, timeline and cost (daemon/controlnode/metrics.py): ``/metrics`` scraped from a real
daemon (control socket, and the optional TCP port) and parsed with prometheus-client's
own parser; the cost and timeline arithmetic against hand-computed numbers."""

from __future__ import annotations

import shutil
import tempfile

import aiohttp
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from daemon.config import OfferSpec
from daemon.gpunode.gpu import GpuSample
from daemon.controlnode.metrics import DaemonMetrics, cost_report, goodput, job_timeline
from daemon.model import Event, Node, NodeState
from test_ctl import running_node


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def scrape_socket(socket_path: str) -> tuple[str, str]:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as s:
        async with s.get("http://spotvisord/metrics") as r:
            assert r.status == 200
            return r.headers["Content-Type"], await r.text()


async def agent_post(h, node: Node, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        async with s.post(f"{h.api.agent_url}{path}", json={"node_id": node.id, **body}) as r:
            assert r.status == 200
            return await r.json()


def status_line(event: str, attempt: str, step: int, **kw) -> dict:
    return {"kind": "trainer_status", "line": {"event": event, "attempt": attempt, "rank": 0, "step": step, "world_size": 1,
                                               "time": 1.0, **kw}}


async def test_metrics_from_the_agents_reports(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    node = h.sup.nodes["test-1"]
    await agent_post(h, node, "/v1/agent/events", {"events": [status_line("started", "a1", 0)]})
    await agent_post(h, node, "/v1/agent/heartbeat", {"step": 14, "trainer": {"state": "running"}})
    await agent_post(h, node, "/v1/agent/events", {"events": [
        status_line("checkpoint_committed", "a1", 10, reason="periodic", seconds=1.5, bytes=1000),
        status_line("checkpoint_committed", "a1", 12, reason="notice", seconds=3.0, bytes=3000),
        status_line("started", "a2", 12),  # resumed at 12 after reaching 14: 2 steps lost
    ]})
    ctype, text = await scrape_socket(h.socket_path)
    assert ctype.startswith("text/plain")
    m = samples(text)
    assert m[("spotvisor_nodes", (("provider", "local"), ("state", "running")))] == 1
    assert m[("spotvisor_nodes", (("provider", "local"), ("state", "draining")))] == 0
    assert m[("spotvisor_checkpoints_committed_total", (("reason", "periodic"),))] == 1
    assert m[("spotvisor_checkpoints_committed_total", (("reason", "notice"),))] == 1
    assert m[("spotvisor_checkpoint_commit_seconds_count", ())] == 2
    assert m[("spotvisor_checkpoint_commit_seconds_sum", ())] == 4.5
    assert m[("spotvisor_checkpoint_commit_seconds_bucket", (("le", "2.0"),))] == 1
    assert m[("spotvisor_checkpoint_bytes_total", ())] == 4000
    assert m[("spotvisor_checkpoint_last_bytes", ())] == 3000
    assert m[("spotvisor_lost_steps_total", ())] == 2
    assert [e.data["lost_steps"] for e in h.events("job_resumed")] == [0, 2]
    assert m[("spotvisor_world_size", ())] == 1
    assert m[("spotvisor_job_step", ())] == 12
    assert m[("spotvisor_goodput_ratio", ())] == pytest.approx(12 / 14)
    assert m[("spotvisor_spot_usd_per_hour", ())] == 0.5
    assert m[("spotvisor_job_state", (("state", "running"),))] == 1
    assert m[("spotvisor_pool_target_nodes", ())] == 1 and m[("spotvisor_paused", ())] == 0
    assert not [k for k in m if k[0].startswith("spotvisor_gpu_sm")]  # no GPU sample: no series, not 0

    # a notice and a GPU sample: counted and shown on the next scrape
    await agent_post(h, node, "/v1/agent/heartbeat", {"gpu": [GpuSample(0, 42.0, 5, 10).to_dict()]})
    await agent_post(h, node, "/v1/agent/events", {"events": [{"kind": "interruption_notice", "seen_at": 1.0,
                                                        "notice": {"id": "n-1", "provider": "aws"}}]})
    m = samples((await scrape_socket(h.socket_path))[1])
    assert m[("spotvisor_interruption_notices_total", (("provider", "local"),))] == 1
    assert m[("spotvisor_events_total", (("kind", "interruption_notice"),))] == 1
    assert m[("spotvisor_gpu_sm_utilization_percent", (("gpu", "0"), ("node", "test-1")))] == 42.0
    assert m[("spotvisor_gpu_memory_total_bytes", (("gpu", "0"), ("node", "test-1")))] == 10
    assert m[("spotvisor_job_recoveries_total", ())] == 1

    # a whole-job migration: its outcome, its duration, the bytes it copied and their egress
    h.sup.record("checkpoint_replicated", None, migration="m1", bytes_copied=2_000_000, egress_usd=0.18)
    h.sup.record("migration_completed", None, migration="m1", decision_to_first_step_s=42.5)
    h.sup.record("migration_failed", None, migration="m2", reason="boot_timeout")
    m = samples((await scrape_socket(h.socket_path))[1])
    assert m[("spotvisor_migrations_total", (("outcome", "completed"),))] == 1
    assert m[("spotvisor_migrations_total", (("outcome", "failed"),))] == 1
    assert m[("spotvisor_migration_last_seconds", ())] == 42.5
    assert m[("spotvisor_checkpoint_replicated_bytes_total", ())] == 2_000_000
    assert m[("spotvisor_migration_egress_usd_total", ())] == pytest.approx(0.18)
    assert m[("spotvisor_placement_domain", (("domain", "local-local"),))] == 1


async def test_metrics_port_and_per_daemon_registries(spot_daemon) -> None:
    from daemon.interfaces.api import ApiServer

    h = spot_daemon
    DaemonMetrics(h.sup).text()  # a second registry for the same daemon: no clash with the API's
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("spotvisor")]  # never the global one

    h.sup.config = h.config.model_copy(
        update={"daemon": h.config.daemon.model_copy(update={"metrics_port": 0})})
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    api = ApiServer(h.sup, agent_host="127.0.0.1", agent_port=0, socket_path=f"{sockdir}/d2.sock")
    try:
        await api.start()
        assert api.metrics_url is not None and api.metrics_url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as s:
            async with s.get(api.metrics_url) as r:
                assert r.status == 200
                m = samples(await r.text())
            async with s.get(api.metrics_url.replace("/metrics", "/v1/status")) as r:
                assert r.status == 404  # the metrics port serves metrics only
        assert m[("spotvisor_job_target_steps", ())] == h.config.job.target_steps
        assert ("spotvisor_nodes", (("provider", "local"), ("state", "launching"))) in m
    finally:
        await api.aclose()
        shutil.rmtree(sockdir, ignore_errors=True)
    assert h.api.metrics_url is None  # off unless configured


def node(i: int, *, price: float, offer: OfferSpec, created: float, ended: float | None,
         state: NodeState = NodeState.TERMINATED, instance: bool = True) -> Node:
    return Node(id=f"p-{i}", ordinal=i, provider=offer.provider, region=offer.region, zone=offer.zone,
                instance_type=offer.instance_type, market=offer.market, gpus=1, price_usd_h=price, token="t", state=state,
                instance_id=f"i-{i}" if instance else None, created_at=created, ended_at=ended)


def test_cost_by_hand() -> None:
    offers = [
        OfferSpec(provider="aws", region="us-east-1", zone="us-east-1a", instance_type="g5.xlarge",
                  on_demand_price_usd_h=3.0),
        OfferSpec(provider="aws", region="us-east-1", zone="us-east-1b", instance_type="g5.xlarge"),  # no price
        OfferSpec(provider="aws", region="us-east-1", instance_type="g5.xlarge", market="on_demand"),
    ]
    t, h = 10_000.0, 3600.0
    nodes = [
        node(1, price=0.9, offer=offers[0], created=t, ended=t + 2 * h),  # 2 h: spot 1.80, on demand 6.00
        node(2, price=0.9, offer=offers[0], created=t + h, ended=None, state=NodeState.RUNNING),  # live: 2 h so far
        node(3, price=1.2, offer=offers[1], created=t, ended=t + h / 2),  # 0.5 h: spot 0.60, unpriced
        node(4, price=0.9, offer=offers[0], created=t, ended=t + 5, state=NodeState.FAILED, instance=False),  # nothing
        node(5, price=4.0, offer=offers[2], created=t, ended=t + h),  # on-demand fallback: 4.00 both ways
    ]
    c = cost_report(nodes, offers, now=t + 3 * h)
    assert [r["id"] for r in c["nodes"]] == ["p-1", "p-2", "p-3", "p-5"]
    assert [r["hours"] for r in c["nodes"]] == [2.0, 2.0, 0.5, 1.0]
    assert c["hours"] == 5.5
    assert c["spot_usd"] == pytest.approx(1.8 + 1.8 + 0.6 + 4.0)  # 8.20
    assert c["on_demand_usd"] == pytest.approx(6.0 + 6.0 + 4.0)  # 16.00
    assert c["spot_usd_priced"] == pytest.approx(7.6)
    assert c["savings_usd"] == pytest.approx(16.0 - 7.6)  # 8.40
    assert c["savings_pct"] == 52.5
    assert c["unpriced_nodes"] == ["p-3"]
    assert c["on_demand_nodes_usd"] == pytest.approx(4.0)  # p-5, the on-demand fallback
    assert c["spot_usd_h_now"] == 0.9  # p-2 only is billed now
    assert c["nodes"][1]["billed_to"] == t + 3 * h
    assert cost_report([], offers, now=t)["savings_usd"] is None
    # nodes name their offer by key: reordering the config's offers remaps nothing
    assert cost_report(nodes, offers[::-1], now=t + 3 * h) == c


def ev(seq: int, t: float, kind: str, node: str | None = None) -> Event:
    return Event(seq, t, kind, node, {})


def test_timeline_by_hand() -> None:
    events = [
        ev(1, 100, "node_launch_requested", "n1"),
        ev(2, 130, "node_admitted", "n1"),
        ev(3, 140, "job_resumed", "n1"),
        ev(4, 200, "interruption_notice", "n1"),  # a member: 1 recovery
        ev(5, 210, "interruption_notice", "n1"),  # the same node again: still 1
        ev(6, 220, "node_lost", "n2"),  # never admitted: not a recovery
        ev(7, 300, "job_pausing"),
        ev(8, 400, "job_unpaused"),
        ev(9, 500, "job_pausing"),  # still paused at "now"
    ]
    tl = job_timeline(events, now=600)
    assert (tl.submitted_at, tl.started_at, tl.ended_at) == (100, 140, None)
    assert tl.total_s == 500 and tl.paused_s == 100 + 100 and tl.running_s == 600 - 140 - 200
    assert tl.recoveries == 1
    done = job_timeline([*events[:6], ev(7, 400, "job_completed")], now=10_000)
    assert done.total_s == 300 and done.running_s == 260 and done.ended_at == 400
    assert job_timeline([], now=5).to_dict() == {"submitted_at": None, "started_at": None, "ended_at": None,
                                                 "total_s": None, "running_s": None, "paused_s": 0.0,
                                                 "recoveries": 0}


def test_goodput() -> None:
    assert goodput(None, 0) is None and goodput(0, 0) is None
    assert goodput(90, 10) == 0.9 and goodput(100, 0) == 1.0
