"""The daemon's side of the agent API (daemon/interfaces/api.py, daemon/controlnode/supervisor.py): the
heartbeat interval it tells each node, and the command long-poll.

The daemon (``spot_daemon``) runs in the test's event loop; the "agent" is plain
HTTP requests with the node's token. No sleeps as synchronization: every wait is a
condition (``DaemonHarness.until``) or an awaited request, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from conftest import fail_durable
from daemon.model import NodeState


def configure(h, *, agent: dict[str, Any] | None = None, daemon: dict[str, Any] | None = None) -> None:
    """Change the running daemon's config (the Supervisor reads it on each use)."""
    c = h.sup.config
    h.sup.config = c.model_copy(update={"agent": c.agent.model_copy(update=agent or {}),
                                        "daemon": c.daemon.model_copy(update=daemon or {})})


class Agent:
    """One node's side of the agent API, as plain requests."""

    def __init__(self, h, node, session: aiohttp.ClientSession) -> None:
        self.url, self.node, self.s = h.api.agent_url, node, session

    async def post(self, path: str, **body: Any) -> tuple[int, Any]:
        async with self.s.post(f"{self.url}{path}", json={"node_id": self.node.id, **body}) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

    async def register(self) -> dict[str, Any]:
        status, reply = await self.post("/v1/agent/register")
        assert status == 200, reply
        return reply

    async def heartbeat(self, trainer: str = "running") -> dict[str, Any]:
        status, reply = await self.post("/v1/agent/heartbeat", trainer={"state": trainer})
        assert status == 200, reply
        return reply

    async def poll(self, wait_s: Any) -> tuple[int, Any]:
        return await self.post("/v1/agent/commands", wait_s=wait_s)


@pytest.fixture
async def agent(spot_daemon) -> AsyncIterator[Agent]:
    """The pool's first node, its agent registered."""
    h = spot_daemon
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        yield Agent(h, node, s)


async def held(h, node_id: str, polls: int = 1) -> None:
    """Wait until the daemon holds the node's ``polls``-th long-poll."""
    await h.until(lambda: h.sup.agents._command_polls.get(node_id, 0) >= polls, what="the long-poll held")


async def test_the_interval_grows_with_the_pool_and_is_told_to_each_node(spot_daemon, agent) -> None:
    h = spot_daemon
    # the local demo's pool (here 1 node, floor 0.05 s): the floor, unchanged
    reply = await agent.register()
    assert reply["heartbeat_interval_s"] == 0.05
    assert (await agent.heartbeat())["heartbeat_interval_s"] == 0.05

    configure(h, daemon={"max_heartbeats_per_second": 1.0})  # 1 heartbeat a second for the whole pool
    h.sup.desired_nodes = 4  # three more launch: nodes about to heartbeat count too
    h.sup.wake()
    await h.until(lambda: sum(1 for n in h.sup.nodes.values() if n.state is NodeState.LAUNCHING) == 3,
                  what="three more launches")
    await h.until(lambda: h.sup.agents.heartbeat_interval_s == 4.0, what="the interval rescaled")
    told = (await agent.heartbeat())["heartbeat_interval_s"]
    assert 2.0 <= told < 6.0  # 4 nodes / 1 per s: the time to the node's next slot, 4 s apart
    # the planner judges the node by what it was told (its lost timeout scales with it)
    assert h.sup.view(agent.node).heartbeat_interval_s == told

    def slot(told_s: float) -> float:  # where in the 4 s cycle the node's next heartbeat is due
        return (h.sup.clock() + told_s) % 4.0

    # an extra heartbeat (its trainer started) is told the way back to the same slot
    first = slot(told)
    again = slot((await agent.heartbeat())["heartbeat_interval_s"])
    assert min(abs(again - first), 4.0 - abs(again - first)) < 0.05
    # and nodes that register together get slots of their own, spread over the cycle
    slots = [first]
    for n in [n for n in h.sup.nodes.values() if n.state is NodeState.LAUNCHING]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {n.token}"}) as s:
            async with s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": n.id}) as r:
                slots.append(slot((await r.json())["heartbeat_interval_s"]))
    slots.sort()
    gaps = [b - a for a, b in zip(slots, slots[1:])] + [slots[0] + 4.0 - slots[-1]]
    assert len(slots) == 4 and min(gaps) > 0.1, slots
    # and the periodic reconcile pass (a cloud describe + a plan over every node) slows with
    # it: a quarter of the heartbeat interval, never faster than daemon.reconcile_interval_s
    configure(h, daemon={"reconcile_interval_s": 0.5})
    assert h.sup.periodic_pass_s() == 1.0
    configure(h, daemon={"reconcile_interval_s": 2.0})
    assert h.sup.periodic_pass_s() == 2.0


async def test_a_command_queued_while_a_long_poll_waits_is_answered_at_once_and_once(
        spot_daemon, agent) -> None:
    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    # the start decision changed since the node was last told: the first poll answers at once
    status, reply = await asyncio.wait_for(agent.poll(20), 5)
    assert status == 200 and reply.pop("join_credential") and reply == {"commands": [], "start_trainer": True,
                                                                    "rendezvous": "127.0.0.1:29400"}
    await agent.heartbeat("running")  # the trainer runs: a checkpoint can be asked for

    t0 = time.monotonic()
    poll = asyncio.create_task(agent.poll(20))
    await held(h, agent.node.id, polls=2)
    assert not poll.done()
    rid = h.sup.operator.request_checkpoint("manual")
    status, reply = await asyncio.wait_for(poll, 5)
    assert time.monotonic() - t0 < 5  # long before its 20 s
    assert status == 200 and reply["commands"] == [{"kind": "checkpoint", "reason": "manual", "id": rid}]
    assert (await agent.heartbeat())["commands"] == []  # taken by the poll: not delivered twice

    # and the other way round: a heartbeat that comes first takes it, the poll then has none
    h.sup.operator.drain(agent.node, "operator")
    assert [c["kind"] for c in (await agent.heartbeat())["commands"]] == ["drain"]
    status, reply = await agent.poll(0)
    assert status == 200 and reply["commands"] == []


async def test_a_long_poll_with_nothing_to_say_answers_empty_after_wait_s(spot_daemon, agent) -> None:
    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    assert (await agent.poll(0))[1]["start_trainer"] is True
    t0 = time.monotonic()
    status, reply = await asyncio.wait_for(agent.poll(0.3), 5)
    assert status == 200 and reply["commands"] == [] and time.monotonic() - t0 >= 0.3
    # the daemon holds a poll at most agent.command_wait_s (a random share of it)
    h.sup.config = h.sup.config.model_copy(
        update={"agent": h.sup.config.agent.model_copy(update={"command_wait_s": 0.4})})
    held_s = []
    for _ in range(4):
        t0 = time.monotonic()
        status, reply = await asyncio.wait_for(agent.poll(3600), 5)
        held_s.append(time.monotonic() - t0)
        assert status == 200 and reply["commands"] == []
    assert all(s < 0.4 + 0.3 for s in held_s), held_s
    for bad in ("soon", -1, True, None):
        status, text = await agent.poll(bad)
        assert status == 400 and "wait_s" in text


async def test_a_newer_poll_supersedes_a_held_one(spot_daemon, agent) -> None:
    """An agent whose connection was lost polls again: the old poll gives way and takes nothing."""
    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    await agent.poll(0)
    await agent.heartbeat("running")
    old = asyncio.create_task(agent.poll(20))
    await held(h, agent.node.id, polls=2)
    new = asyncio.create_task(agent.poll(20))
    status, _ = await asyncio.wait_for(old, 5)
    assert status == 503
    rid = h.sup.operator.request_checkpoint("manual")
    status, reply = await asyncio.wait_for(new, 5)
    assert status == 200 and [c["id"] for c in reply["commands"]] == [rid]


async def test_held_polls_answer_when_the_daemon_closes(spot_daemon, agent) -> None:
    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    await agent.poll(0)
    poll = asyncio.create_task(agent.poll(20))
    await held(h, agent.node.id, polls=2)
    await asyncio.wait_for(h.sup.aclose(), 10)
    status, _ = await asyncio.wait_for(poll, 5)
    assert status == 503


async def test_the_long_poll_needs_the_nodes_token(spot_daemon, agent) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{agent.url}/v1/agent/commands", json={"node_id": agent.node.id, "wait_s": 0},
                          headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401


async def test_a_node_told_to_start_gets_its_join_credential_and_no_other_node_does(spot_daemon, agent) -> None:
    """Issue 25, item 11: the reply that tells a node to start its trainer carries the
    node's join credential (trainer.credential), for this node and this run, signed with
    the pool's join key, which the store keeps; a node not in the job gets none."""
    from daemon.controlnode.agent_link import JOIN_KEY
    from trainer.credential import Authority, NodeCredential

    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    reply = await agent.heartbeat("running")
    cred = NodeCredential(reply["join_credential"])
    assert (cred.node, cred.run) == (agent.node.id, h.sup.job_spec(agent.node)["env"]["SPOTVISOR_RUN_ID"])
    key = Authority(bytes.fromhex(h.sup.store.get(JOIN_KEY)))
    fields = {"run": cred.run, "node": cred.node, "number": 1}
    assert key.public_key == json.loads(reply["join_credential"])["authority"]
    assert cred.verifier().check("ticket", fields, cred.prove("ticket", fields), now=time.time()) == agent.node.id
    assert (await agent.heartbeat("running"))["join_credential"] == reply["join_credential"]  # issued once
    h.sup.run_nonce = "restarted"  # a stalled job's restart moves it to a new run id: a credential for that one
    assert NodeCredential((await agent.heartbeat("running"))["join_credential"]).run == f"{h.sup.config.job.id}-restarted"
    h.sup.operator.drain(agent.node, "operator")
    assert agent.node.state is NodeState.DRAINING
    assert "join_credential" not in await agent.heartbeat("running")  # leaving: not told to start any more


async def test_a_reply_not_durable_yet_is_withheld_and_told_at_the_next_ask(spot_daemon, agent, monkeypatch) -> None:
    """Fenced admissions (issue 29): a reply that tells a node to act goes out only once
    the state it follows from is durable where the pool's next daemon reads it
    (``Store.durable``; HA: committed under the leader's fence). Not durable (etcd out of
    reach) or not leading: 503, and the reply's commands and start decision are kept, in
    order, for the next ask; nothing is told twice."""
    from daemon.controlnode.store import NotLeading

    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    await agent.heartbeat("running")  # told to start, and the trainer runs: a checkpoint can be asked for
    first = h.sup.operator.request_checkpoint("manual")
    fail_durable(monkeypatch, h.sup.store, [RuntimeError("etcd: deadline exceeded"), NotLeading("daemon b leads the pool")])
    status, text = await agent.post("/v1/agent/heartbeat", trainer={"state": "running"})
    assert status == 503 and "not durable" in text
    second = h.sup.operator.request_checkpoint("manual")  # queued behind the withheld one
    status, text = await agent.poll(0)
    assert status == 503 and "does not lead" in text
    status, reply = await agent.poll(0)  # durable again: everything withheld, in order, once
    assert status == 200 and reply["start_trainer"] is True and reply["join_credential"]
    assert [c["id"] for c in reply["commands"]] == [first, second]
    assert (await agent.heartbeat())["commands"] == []


async def test_a_report_batch_sent_again_is_applied_once_and_answered_only_once_durable(
        spot_daemon, agent, monkeypatch) -> None:
    """The agent numbers its reports (``seq``, per agent process ``agent``). A batch whose
    answer was lost (a 503 while its writes were not durable: HA, etcd out of reach) comes
    again: its reports are not applied twice, and the node's record keeps what was, so a
    new leader skips them too. Another agent process (the agent restarted) starts anew."""
    h = spot_daemon
    await agent.register()
    await h.until(lambda: agent.node.state is NodeState.RUNNING, what="the job starts on the node")
    batch = [{"kind": "trainer_exited", "exit_code": 1, "seq": 1},
             {"kind": "metadata_unreachable", "failures": 5, "error": "timeout", "url": "http://169.254.169.254",
              "seq": 2}]
    fail_durable(monkeypatch, h.sup.store, [RuntimeError("etcd: deadline exceeded")])
    status, text = await agent.post("/v1/agent/events", events=batch, agent="a1")
    assert status == 503 and "not durable" in text  # the agent sends it again
    status, _ = await agent.post("/v1/agent/events", events=batch, agent="a1")
    assert status == 200
    assert len(h.events("trainer_exited")) == 1 and len(h.events("metadata_unreachable")) == 1
    stored = next(n for n in h.sup.store.nodes() if n.id == agent.node.id)
    assert (stored.reports_from, stored.reports_applied) == ("a1", 2)
    status, _ = await agent.post("/v1/agent/events", events=batch[:1], agent="b2")  # a new agent process
    assert status == 200 and len(h.events("trainer_exited")) == 2
    for bad in ("A1", "x" * 65, 7, ""):
        status, text = await agent.post("/v1/agent/events", events=batch, agent=bad)
        assert status == 400 and "agent" in text


@pytest.mark.parametrize("wait_s", [60.0, 0.0])
async def test_the_nodes_started_together_are_told_to_wait_for_each_other(tmp_path, wait_s: float) -> None:
    """The nodes admitted together at the job's start are each told how many they are and
    until when their torchruns wait for each other (``rendezvous.start_wait_s``,
    trainer.rendezvous); ``start_wait_s: 0`` tells them nothing."""
    from conftest import RecordingProvider, spot_harness

    async with spot_harness(tmp_path, RecordingProvider(), pool={"target_nodes": 2},
                            rendezvous={"start_wait_s": wait_s}) as h:
        await h.until(lambda: sum(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()) == 2,
                      what="two launches")
        t0 = time.time()
        replies = []
        for node in list(h.sup.nodes.values()):
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
                await Agent(h, node, s).register()
        await h.until(lambda: all(n.state is NodeState.RUNNING for n in h.sup.nodes.values()), what="the start")
        for node in list(h.sup.nodes.values()):
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
                replies.append(await Agent(h, node, s).heartbeat("not_started"))
        assert all(r["start_trainer"] for r in replies)
        if wait_s:
            assert [r["start_cohort"]["nodes"] for r in replies] == [2, 2]
            assert all(t0 + wait_s - 5 < r["start_cohort"]["until"] <= time.time() + wait_s for r in replies)
        else:
            assert not [r for r in replies if "start_cohort" in r]
        # a stalled job's trainers restart together under a new rendezvous id: a new cohort
        from daemon.control.actions import JobStalled

        first = [r.get("start_cohort") for r in replies]
        h.sup.act(JobStalled("no_step", "no step", 900.0, 900.0, restart=tuple(h.sup.nodes)))
        again = []
        for node in list(h.sup.nodes.values()):
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
                again.append((await Agent(h, node, s).heartbeat("not_started")).get("start_cohort"))
        if wait_s:
            assert [c["nodes"] for c in again] == [2, 2]
            assert all(c["until"] > f["until"] for c, f in zip(again, first))
        else:
            assert again == [None, None]

