"""Rebalance recommendations and drains: the pool policy decides (ignore | checkpoint | replace)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from conftest import DaemonHarness, RecordingProvider, started_daemon
from daemon.config import Config
from daemon.model import NodeState
from daemon.controlnode.store import Store


@pytest.fixture
async def daemon(request: pytest.FixtureRequest, tmp_path: Path):
    """A started daemon (RecordingProvider, pool 1..2) whose rebalance policy is ``request.param``."""
    policy = request.param
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = Config.model_validate({
        "pool": {"name": "t", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2, "rebalance_policy": policy},
        "job": {"id": "j"},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock", "reconcile_interval_s": 0.05},
    })
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = RecordingProvider()
    try:
        async with started_daemon(config, provider, store, f"{sockdir}/d.sock") as (sup, api):
            yield DaemonHarness(sup, api, provider, config, f"{sockdir}/d.sock", tmp_path)
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def node(h: DaemonHarness, ordinal: int):
    return next(n for n in h.sup.nodes.values() if n.ordinal == ordinal)


async def running_first_node(h: DaemonHarness):
    """Bring node 1 up as an agent would: register, then heartbeat with a running trainer."""
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="launch")
    n1 = node(h, 1)
    h.sup.agents.on_register(n1)
    await h.until(lambda: n1.state is NodeState.RUNNING, what="job start")
    h.sup.agents.on_heartbeat(n1, {"step": 5, "trainer": {"state": "running"}})
    return n1


def rebalance(h: DaemonHarness, n) -> None:
    h.sup.intake.on_reports(n, [{"kind": "rebalance_recommendation", "seen_at": time.time(),
                          "notice": {"id": "rb-1", "provider": "aws", "kind": "rebalance"}}])


@pytest.mark.parametrize("daemon", ["checkpoint"], indirect=True)
async def test_checkpoint_policy_commits_now_and_keeps_the_node(daemon) -> None:
    h = daemon
    n1 = await running_first_node(h)
    rebalance(h, n1)
    reply = h.sup.agents.on_heartbeat(n1, {"step": 6, "trainer": {"state": "running"}})
    assert [(c["kind"], c["reason"]) for c in reply["commands"]] == [("checkpoint", "rebalance")]
    assert n1.state is NodeState.RUNNING
    assert h.events("rebalance_recommendation")[0].data["policy"] == "checkpoint"
    assert len(h.provider.launched) == 1  # no extra capacity bought


@pytest.mark.parametrize("daemon", ["ignore"], indirect=True)
async def test_ignore_policy_only_records(daemon) -> None:
    h = daemon
    n1 = await running_first_node(h)
    rebalance(h, n1)
    assert h.sup.agents.on_heartbeat(n1, {"trainer": {"state": "running"}})["commands"] == []
    assert len(h.events("rebalance_recommendation")) == 1 and len(h.provider.launched) == 1


@pytest.mark.parametrize("daemon", ["replace"], indirect=True)
async def test_replace_policy_launches_first_then_drains_once_the_replacement_is_ready(daemon) -> None:
    h = daemon
    n1 = await running_first_node(h)
    rebalance(h, n1)
    await h.until(lambda: len(h.provider.launched) == 2, what="the replacement launch")
    n2 = node(h, 2)
    await h.until(lambda: n2.state is NodeState.LAUNCHING, what="replacement launched")
    # while the replacement boots, node 1 keeps training: nothing asks it to leave
    assert n1.state is NodeState.RUNNING
    assert h.sup.agents.on_heartbeat(n1, {"trainer": {"state": "running"}})["commands"] == []

    h.sup.agents.on_register(n2)  # the replacement is up
    await h.until(lambda: n1.state is NodeState.DRAINING, what="node 1 drained")
    cmds = h.sup.agents.on_heartbeat(n1, {"trainer": {"state": "running"}})["commands"]
    assert [c["kind"] for c in cmds] == ["drain"]
    assert n2.state is NodeState.READY  # not admitted while node 1 is still in the job

    h.sup.intake.on_reports(n1, [{"kind": "trainer_exited", "exit_code": 1}])  # node 1 left after its commit
    await h.until(lambda: n1.state is NodeState.TERMINATED, what="node 1 released")
    await h.until(lambda: n2.state is NodeState.RUNNING, what="replacement admitted")
    assert h.events("node_terminated")[-1].data["reason"] == "drained"
