"""spotctl (daemon/interfaces/ctl.py) against the control socket of a real daemon (daemon/interfaces/api.py).

The daemon (Supervisor + ApiServer, ``spot_daemon`` fixture) runs in the test's
event loop; spotctl runs as a real subprocess through ``asyncio`` so the loop keeps
serving while it talks to the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import aiohttp

from conftest import fail_durable, spotctl
from daemon.model import Node, NodeState

REPO = Path(__file__).resolve().parents[1]


async def running_node(h) -> Node:
    """Let the first node come up: it launches, its 'agent' registers, the job starts on it; returns it."""
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        async with s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": node.id}) as r:
            assert r.status == 200
    await h.until(lambda: node.state is NodeState.RUNNING, what="node running")
    return node


async def test_status_json(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    rc, out, err = await spotctl("--socket", h.socket_path, "status", "--json")
    assert rc == 0, err
    status = json.loads(out)
    assert status["job"]["id"] == "job1"
    assert status["job"]["state"] == "running"
    assert {"state", "step", "target_steps", "world_size", "last_commit_step", "restarts"} <= set(status["job"])
    assert status["pool"]["name"] == "test" and status["pool"]["target_nodes"] == 1
    (node,) = status["nodes"]
    assert {"id", "provider", "zone", "instance_type", "gpus", "state", "uptime_s", "price_usd_h"} <= set(node)
    assert node["id"] == "test-1"
    assert node["provider"] == "local" and node["instance_type"] == "local.cpu" and node["gpus"] == 1
    assert node["state"] == "running"
    assert isinstance(node["uptime_s"], (int, float)) and node["uptime_s"] >= 0
    assert node["price_usd_h"] == 0.5  # from the provider's spot_price

    # the same with the options after the subcommand, and the human table
    rc, out2, err = await spotctl("status", "--json", "--socket", h.socket_path)
    assert rc == 0, err
    assert json.loads(out2)["nodes"][0]["id"] == "test-1"
    rc, text, err = await spotctl("--socket", h.socket_path, "status")
    assert rc == 0, err
    head, row = text.splitlines()[:2]  # the job table, like `sky jobs queue`
    assert head.split()[:3] == ["JOB", "STATE", "STEP"] and row.split()[:2] == ["job1", "RUNNING"]
    assert "test-1" in text and "running" in text


async def test_events_since_and_kind(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    h.sup.record("checkpoint_requested", None, reason="test", request_id="a")
    h.sup.record("checkpoint_requested", None, reason="test", request_id="b")
    every = h.sup.store.events()
    rc, out, err = await spotctl("--socket", h.socket_path, "events", "--json")
    assert rc == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [e["seq"] for e in lines] == [e.seq for e in every]
    assert set(lines[0]) == {"seq", "time", "kind", "node", "data"}

    first_req = h.events("checkpoint_requested")[0].seq
    rc, out, err = await spotctl("--socket", h.socket_path, "events", "--json", "--since", str(first_req),
                                 "--kind", "checkpoint_requested")
    assert rc == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [(e["kind"], e["data"]["request_id"]) for e in lines] == [("checkpoint_requested", "b")]
    assert all(e["seq"] > first_req for e in lines)

    # --since alone: exactly the events after N, in order
    mid = every[len(every) // 2].seq
    rc, out, err = await spotctl("--socket", h.socket_path, "events", "--json", "--since", str(mid))
    assert rc == 0, err
    assert [json.loads(x)["seq"] for x in out.splitlines()] == [e.seq for e in every if e.seq > mid]

    # repeated --kind; the readable form is one line per event
    rc, out, err = await spotctl("--socket", h.socket_path, "events", "--kind", "node_ready", "--kind",
                                 "node_admitted")
    assert rc == 0, err
    rows = out.splitlines()
    assert len(rows) == 2
    assert "node_ready" in rows[0] and "node_admitted" in rows[1] and "test-1" in rows[0]


async def test_status_without_daemon() -> None:
    sock = f"{tempfile.gettempdir()}/sv-none-{id(object())}/d.sock"
    rc, out, err = await spotctl("--socket", sock, "status")
    assert rc == 1
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert sock in lines[0] and lines[0].startswith("spotctl: ")
    assert "Traceback" not in err


async def test_a_stopped_daemon_takes_its_socket_with_it(tmp_path: Path) -> None:
    """aiohttp leaves the socket file: an ended demo left ``.spotvisor/spotvisord.sock``,
    and spotctl found a socket and no daemon (a fresh-clone user trial). A socket bound
    at that path since (a successor's) is not the stopped daemon's to remove."""
    import os

    from conftest import RecordingProvider, spot_harness

    async with spot_harness(tmp_path, RecordingProvider()) as h:
        assert Path(h.socket_path).is_socket()
    assert not Path(h.socket_path).exists()
    async with spot_harness(tmp_path / "again", RecordingProvider()) as h:
        os.unlink(h.socket_path)  # a successor binds the path meanwhile
        import socket
        with socket.socket(socket.AF_UNIX) as successor:
            successor.bind(h.socket_path)
            await h.api.aclose()
            assert Path(h.socket_path).is_socket()  # left for its owner


async def test_events_follow_streams_new_events(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    before = h.sup.record("checkpoint_requested", None, reason="test", request_id="before")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.interfaces.ctl", "--socket", h.socket_path, "events", "-f", "--json",
        "--since", str(before.seq - 1), "--kind", "checkpoint_requested", cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
        assert first["seq"] == before.seq  # the stream is up
        h.sup.record("node_ready", "test-9")  # filtered out by --kind
        after = h.sup.record("checkpoint_requested", None, reason="test", request_id="after")
        line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
        assert line["seq"] == after.seq and line["data"]["request_id"] == "after"
        assert proc.returncode is None  # still following
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    # the daemon's stream handler notices the gone reader on its next write
    h.sup.record("checkpoint_requested", None, reason="test", request_id="late")


async def test_checkpoint_and_drain_verbs(spot_daemon) -> None:
    h = spot_daemon
    sock = ["--socket", h.socket_path]
    rc, out, err = await spotctl("checkpoint", *sock)
    assert rc == 2 and "nothing to checkpoint" in err and "Traceback" not in err  # no trainer runs yet

    await running_node(h)
    node = next(iter(h.sup.nodes.values()))
    h.sup.agents.on_heartbeat(node, {"trainer": {"state": "running"}})
    rc, out, err = await spotctl("checkpoint", "--json", *sock)
    assert rc == 0, err
    rid = json.loads(out)["request_id"]
    cmds = h.sup.agents.on_heartbeat(node, {"trainer": {"state": "running"}})["commands"]
    assert cmds == [{"kind": "checkpoint", "reason": "manual", "id": rid}]

    rc, out, err = await spotctl("drain", "no-such-node", *sock)
    assert rc == 2 and "no node 'no-such-node'" in err and node.id in err
    rc, out, err = await spotctl("drain", node.id, *sock)
    assert rc == 0, err
    assert node.state is NodeState.DRAINING and f"{node.id}: draining" in out
    cmds = h.sup.agents.on_heartbeat(node, {"trainer": {"state": "running"}})["commands"]
    assert [c["kind"] for c in cmds] == ["drain"]


async def test_an_action_is_acknowledged_only_once_durable(spot_daemon, monkeypatch) -> None:
    """HA trials (bench/ha_trials.py, seed 29, trials 41/57/66): a leader killed tens of
    ms after answering 200 to ``spotctl scale`` lost the new target, which was still in
    its store's outbox. An action is now answered only once ``Store.durable`` returned;
    not durable, or not leading: 503 and one line, and spotctl exits non-zero."""
    from daemon.controlnode.store import NotLeading

    h = spot_daemon
    fail_durable(monkeypatch, h.sup.store, [RuntimeError("etcd: deadline exceeded"), NotLeading("control-b leads")])
    sock = ["--socket", h.socket_path]
    rc, out, err = await spotctl("scale", "2", *sock)
    assert rc != 0 and "not durable yet" in err and "Traceback" not in err
    rc, out, err = await spotctl("scale", "2", *sock)
    assert rc != 0 and "no longer leads" in err
    rc, out, err = await spotctl("scale", "2", *sock)  # asked again: the same target, now durable
    assert rc == 0, err
    assert h.sup.target_nodes == 2


async def test_events_are_shown_only_once_durable(spot_daemon, monkeypatch) -> None:
    """An event a reader was shown must survive a takeover (the HA cell of
    tests/chaos/test_control_node_kill.py counted one lost: shown by the killed leader's
    follower, still in its outbox). ``/v1/events`` waits for ``Store.durable``; not
    durable: 503 and one line, nothing shown."""
    from daemon.controlnode.store import NotLeading

    h = spot_daemon
    await h.until(lambda: h.sup.store.last_seq() > 0, what="a first event")
    fail_durable(monkeypatch, h.sup.store, [NotLeading("control-b leads")])
    sock = ["--socket", h.socket_path]
    rc, out, err = await spotctl("events", *sock)
    assert rc != 0 and "not durable" in err and out == "" and "Traceback" not in err
    rc, out, err = await spotctl("events", *sock)
    assert rc == 0 and out.strip(), err
