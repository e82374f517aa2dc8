"""The node agent (daemon/gpunode/agent.py) against the real daemon in the same event loop.

Supervisor + ApiServer (the ``spot_daemon`` fixture) + NodeAgent + FakeImds, with a
trainer stand-in that is a real subprocess: it appends status lines to
``$SPOTVISOR_STATUS_FILE``, answers each new entry of ``$SPOTVISOR_NOTICE_FILE``
with ``checkpoint_committed`` + ``holding`` naming it, and then waits, so a SIGTERM
from the agent ends it by the signal.

No sleeps as synchronization: every wait is a condition re-checked on each new
event (``DaemonHarness.until``), bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import psutil
import pytest

from daemon.gpunode.agent import NodeAgent
from daemon.gpunode.proctree import descendants
from daemon.gpunode.metadata.aws import INSTANCE_ACTION_PATH, TOKEN_PATH, AwsImds
from daemon.gpunode.metadata.base import MetadataDialect
from daemon.providers.local_metadata.aws import FakeImds
from daemon.model import NodeState
from conftest import ManualClock as Clock, agent_running
from trainers import STANDIN


@pytest.fixture(autouse=True)
def _standin_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """These agents' workers are the stand-in (tests/trainers.py): their launchers' zygotes
    need not import trainer.run first (tests/conftest.py asks it for every other node)."""
    monkeypatch.delenv("SPOTVISOR_ZYGOTE_PRELOAD", raising=False)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def fake(clock: Clock) -> AsyncIterator[FakeImds]:
    async with FakeImds(instance_id="i-0001", clock=clock) as imds:
        yield imds


@contextlib.asynccontextmanager
async def running_agent(h, fake: FakeImds | None, clock: Clock | None, monkeypatch: pytest.MonkeyPatch, *,
                        env: dict[str, str] | None = None, token_ttl_s: int = 21600,
                        alarm_after: int = 5,
                        metadata: Callable[[], MetadataDialect] | None = None,
                        daemon_url: str | None = None, torchrun: bool = False) -> AsyncIterator[NodeAgent]:
    """The pool's first node with a real agent (and the stand-in as its trainer: the
    only worker of a one-node ``torchrun`` when ``torchrun``).

    The agent polls ``metadata()`` when given (any dialect's client), else an
    ``AwsImds`` on ``fake`` with ``token_ttl_s`` and ``clock``. It talks to the
    daemon's agent port, or to ``daemon_url`` when given.

    On exit: cancel the agent and check it shut down cleanly (trainer gone, sessions closed).
    """
    if metadata is None:
        if fake is None or clock is None:
            raise ValueError("running_agent needs either metadata= or an AWS fake and a clock")
        aws_fake, aws_clock = fake, clock

        def metadata() -> MetadataDialect:
            return AwsImds(aws_fake.url, token_ttl_s=token_ttl_s, clock=aws_clock)

    argv = [str(STANDIN)]
    if torchrun:
        argv = ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1",
                "--monitor-interval=0.1", *argv]
    monkeypatch.setattr(h.sup, "job_spec", lambda node: {"argv": argv, "env": dict(env or {})})
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    agent = NodeAgent(
        daemon_url=daemon_url or h.api.agent_url, token=node.token, node_id=node.id,
        metadata=metadata(),
        workdir=h.tmp_path / "node", poll_interval_s=0.05, heartbeat_interval_s=0.05,
        metadata_alarm_after=alarm_after, metadata_max_backoff_s=0.2,
    )
    async with agent_running(agent):
        yield agent
    assert agent.runner.proc is None or agent.runner.proc.returncode is not None, "trainer left running"
    assert agent.link.session is not None and agent.link.session.closed


def notice_file(agent: NodeAgent) -> list[dict[str, Any]]:
    return json.loads((agent.workdir / "notices.json").read_text())


async def _second_node_launches(h):
    """Grow the pool to 2; returns the second node once its instance is launching."""
    h.sup.desired_nodes = 2
    h.sup.wake()
    await h.until(lambda: "test-2" in h.sup.nodes and h.sup.nodes["test-2"].state is NodeState.LAUNCHING,
                  what="second node launched")
    return h.sup.nodes["test-2"]


async def _second_node_registers(h):
    """Grow the pool to 2: the second node launches and its (simulated) agent registers.
    Returns the node and the rejoin ``checkpoint_requested`` event it caused."""
    n2 = await _second_node_launches(h)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {n2.token}"}) as s:
        async with s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": n2.id}) as r:
            assert r.status == 200
    await h.until(lambda: h.events("checkpoint_requested"), what="rejoin checkpoint request")
    (req,) = h.events("checkpoint_requested")
    return n2, req


def the_node(h):
    return next(iter(h.sup.nodes.values()))


def trainer_running(agent: NodeAgent) -> bool:
    return agent.runner.proc is not None and agent.trainer == "running"


async def test_token_expiry_is_not_an_error(spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    gate = h.tmp_path / "never"  # the stand-in does not answer: the notice stays in the file
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_GATE": str(gate)},
                             token_ttl_s=60) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        assert fake.token_puts == 1
        clock.advance(61)  # past the token's TTL, between polls
        await h.until(lambda: fake.token_puts >= 2, what="a fresh token after expiry")
        # and an endpoint that forgot the token (401) is refreshed too, not an error
        n = len(fake.request_log)
        fake.forget_tokens()

        def first_401() -> int | None:
            # the agent reads two items (the notice, and the rebalance recommendation beside
            # it): whichever meets the forgotten token first gets the 401
            return next((k for k, (m, _, st) in enumerate(fake.request_log) if k >= n and m == "GET" and st == 401),
                        None)

        await h.until(lambda: first_401() is not None, what="a 401")
        i = first_401()
        await h.until(lambda: ("GET", INSTANCE_ACTION_PATH, 404) in fake.request_log[i:], what="read after 401")
        assert ("PUT", TOKEN_PATH, 200) in fake.request_log[i:]
        assert not h.events("interruption_notice")

        deadline = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(minutes=2)
        fake.publish_interruption("terminate", time=deadline)
        await h.until(lambda: h.events("interruption_notice"), what="interruption_notice")

        node = the_node(h)
        (ev,) = h.events("interruption_notice")
        assert ev.node == node.id
        assert ev.data["action"] == "terminate"
        assert fake.token_puts > 1
        assert node.state is NodeState.DRAINING
        (entry,) = notice_file(agent)
        assert entry["id"] == ev.data["notice_id"]
        assert entry["kind"] == "interruption"
        assert entry["deadline"] == deadline.timestamp()


async def test_interruption_commit_then_sigterm(spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    async with running_agent(h, fake, clock, monkeypatch) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        proc = agent.runner.proc
        assert proc is not None
        fake.publish_interruption("terminate")
        await h.until(lambda: h.events("trainer_exited"), timeout_s=10, what="trainer exit after commit")

        (notice,) = h.events("interruption_notice")
        nid = notice.data["notice_id"]
        commits = h.events("checkpoint_committed")
        assert [c.data["notice_ids"] for c in commits] == [[nid]]
        assert commits[0].data["kinds"] == ["interruption"]
        # the agent ended it by SIGTERM (the stand-in has no handler: it dies by the signal)
        assert proc.returncode == -signal.SIGTERM
        (exited,) = h.events("trainer_exited")
        assert exited.data["exit_code"] == -signal.SIGTERM
        assert exited.seq > commits[0].seq
        # it has left the job: draining, or already released by the daemon ("drained")
        assert the_node(h).state in (NodeState.DRAINING, NodeState.TERMINATED)
        assert all(e.data["reason"] == "drained" for e in h.events("node_terminated"))
        assert notice_file(agent) == []  # answered: removed from the notice file
        status = [json.loads(x) for x in agent.status_path.read_text().splitlines()]
        assert [s["event"] for s in status] == ["started", "checkpoint_committed", "holding"]


async def test_the_trainer_gets_its_nodes_join_credential_in_its_environment_only(
        spot_daemon, fake, clock, monkeypatch, capfd) -> None:
    """Issue 25, item 11: the daemon's reply that starts the trainer carries the node's
    join credential; the agent puts it in the trainer's environment (never its command
    line), and neither the agent nor the daemon logs it."""
    from trainer.contract import JOIN_CREDENTIAL_ENV

    h = spot_daemon
    monkeypatch.setenv(JOIN_CREDENTIAL_ENV, "the agent's own: never passed on")
    async with running_agent(h, fake, clock, monkeypatch) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        assert agent.runner.proc is not None
        pid = agent.runner.proc.pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)
        issued = h.sup.agents.credential(the_node(h))
        assert env[JOIN_CREDENTIAL_ENV] == issued
        assert not any(issued in a or "cert_sig" in a for a in _cmdline(pid))
    secret = json.loads(issued)["key"]
    out, err = capfd.readouterr()
    assert secret not in out + err and "cert_sig" not in out + err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int, timeout_s: float = 10.0) -> list[str]:
    """``pid``'s command line; read again while it is empty (a process in the middle of
    its exec shows none: a clean clone's run on loaded cores read ``[]`` once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        if argv or time.monotonic() > deadline:
            return argv
        time.sleep(0.01)


async def test_a_torchrun_job_runs_in_the_launcher_started_at_registration(
        spot_daemon, fake, clock, monkeypatch) -> None:
    """A ``torchrun`` job is started in the process the agent began at registration,
    its imports done (daemon/gpunode/launcher.py), with the job's environment (the stand-in
    worker needs $SPOTVISOR_STATUS_FILE, which the agent's own environment lacks), and
    the agent's SIGTERM on leaving ends torchrun and its worker."""
    h = spot_daemon
    async with running_agent(h, fake, clock, monkeypatch, torchrun=True) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), timeout_s=60,
                      what="the worker started")
        proc = agent.runner.proc
        assert proc is not None
        assert _cmdline(proc.pid)[-2:] == ["-m", "daemon.gpunode.launcher"]
        assert agent.runner.warm is None
        fake.publish_interruption("terminate")
        await h.until(lambda: h.events("trainer_exited"), timeout_s=60, what="torchrun exit after the commit")
        (notice,) = h.events("interruption_notice")
        assert [c.data["notice_ids"] for c in h.events("checkpoint_committed")] == [[notice.data["notice_id"]]]
        assert proc.returncode != 0  # torchrun ends on the signal (SignalException), as without the launcher
        status = [json.loads(x) for x in agent.status_path.read_text().splitlines()]
        worker = status[0]["pid"]
        assert worker != proc.pid
        await h.until(lambda: not _alive(worker), timeout_s=30, what="the worker gone with torchrun")


async def test_a_prewarmed_launcher_never_started_is_stopped_with_the_agent(tmp_path, monkeypatch) -> None:
    """Warming until the launcher says it has imported; stopped with the agent if the
    node is never admitted."""
    monkeypatch.setenv("SPOTVISOR_ZYGOTE", "1")  # on even where NVIDIA devices are (off there by default)
    agent = NodeAgent(daemon_url="http://127.0.0.1:9", token="t", node_id="n-1", metadata=None,  # type: ignore[arg-type]
                      workdir=tmp_path)
    agent.runner.job = {"argv": ["-m", "torch.distributed.run", "--standalone", "x.py"], "env": {"JOB_VAR": "j"},
                        "secrets": {"JOB_SECRET": "s3cret"}}
    await agent.runner.prewarm()
    warm = agent.runner.warm
    assert warm is not None and warm.returncode is None
    assert _cmdline(warm.pid)[-2:] == ["-m", "daemon.gpunode.launcher"]
    # the job's environment (its zygote imports under it), never its secrets before the job starts
    with open(f"/proc/{warm.pid}/environ", "rb") as f:
        env = dict(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)
    assert env["JOB_VAR"] == "j" and "JOB_SECRET" not in env and "s3cret" not in str(env)
    assert agent.trainer == "warming"  # importing torchrun
    async with asyncio.timeout(60):
        await agent.runner.until_warm()  # the launcher's "ready"
    assert agent.trainer == "not_started" and agent._beat_now.is_set()
    assert warm.returncode is None  # waiting for the job
    zygotes = [psutil.Process(p) for p in descendants(warm.pid)]
    assert len(zygotes) == 1  # forked before the launcher said ready (tests/test_zygote.py)
    await agent.runner.stop_prewarmed()
    assert warm.returncode is not None and agent.runner.warm is None
    await asyncio.to_thread(psutil.wait_procs, zygotes, timeout=30)
    assert not any(z.is_running() and z.status() != psutil.STATUS_ZOMBIE for z in zygotes)  # gone with it
    # a job that is not torchrun is started directly, when admitted: nothing to prewarm
    agent.runner.job = {"argv": ["train.py"], "env": {}}
    await agent.runner.prewarm()
    assert agent.runner.warm is None


@pytest.mark.parametrize("how", ["warm", "waited too long"])
async def test_the_rejoin_waits_for_a_replacement_whose_torchrun_is_importing(
        spot_daemon, fake, clock, monkeypatch, how) -> None:
    """A replacement whose agent prewarms a torchrun job is ``warming`` from its
    registration: the survivors are asked for the rejoin commit (after which they hold
    until the replacement reaches the rendezvous) only once its heartbeat says the
    import is done, or PREWARM_WAIT_S after it registered."""
    from daemon.controlnode import supervisor

    h = spot_daemon
    async with running_agent(h, fake, clock, monkeypatch) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        monkeypatch.setattr(h.sup, "job_spec", lambda node: {"argv": ["-m", "torch.distributed.run", "t.py"],
                                                              "env": {}})
        n2 = await _second_node_launches(h)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {n2.token}"}) as s:
            async with s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": n2.id, "prewarm": True}) as r:
                assert r.status == 200
            assert n2.state is NodeState.READY and n2.trainer == "warming"
            await h.sup.reconcile_once()
            await h.sup.reconcile_once()
            assert not h.events("checkpoint_requested") and n2.state is NodeState.READY  # the survivor trains on
            if how == "warm":
                async with s.post(f"{h.api.agent_url}/v1/agent/heartbeat",
                                  json={"node_id": n2.id, "trainer": {"state": "not_started"}}) as r:
                    assert r.status == 200
            else:
                assert n2.ready_at is not None
                n2.ready_at -= supervisor.PREWARM_WAIT_S
                h.sup.wake()
            await h.until(lambda: h.events("checkpoint_requested"), what="the rejoin request")
        (req,) = h.events("checkpoint_requested")
        assert req.data["reason"] == "rejoin" and req.data["for_nodes"] == [n2.id]


async def test_a_launcher_that_died_while_importing_is_replaced_by_a_plain_start(tmp_path) -> None:
    """The node is not held up by a dead launcher: the agent stops saying ``warming``,
    and when admitted starts torchrun directly."""
    script = tmp_path / "worker.py"
    script.write_text("import os; open(os.environ['OUT'], 'w').write(os.environ['RANK'])\n")
    agent = NodeAgent(daemon_url="http://127.0.0.1:9", token="t", node_id="n-1", metadata=None,  # type: ignore[arg-type]
                      workdir=tmp_path / "node")
    agent.workdir.mkdir()
    agent.runner.job = {"argv": ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1",
                           str(script)], "env": {"OUT": str(tmp_path / "rank")}}
    await agent.runner.prewarm()
    warm = agent.runner.warm
    assert warm is not None
    warm.kill()  # dies before it has imported
    async with asyncio.timeout(60):
        await agent.runner.until_warm()
        assert agent.trainer == "not_started"
        await agent.runner.start()
        proc = agent.runner.proc
        assert proc is not None and proc is not warm
        assert _cmdline(proc.pid)[1:3] == ["-m", "torch.distributed.run"]
        assert await proc.wait() == 0
    assert (tmp_path / "rank").read_text() == "0"


async def test_a_restarted_trainer_starts_from_a_prewarmed_launcher_as_the_first_did(tmp_path, monkeypatch) -> None:
    """The daemon's restart in place (a stalled job: every trainer exited) is started as a
    first start is: the agent prewarms a launcher for the new spec (its zygote forks the
    workers), and the start hands the spec to it, not a fresh torchrun."""
    monkeypatch.setenv("SPOTVISOR_ZYGOTE", "1")  # on even where NVIDIA devices are (off there by default)
    script = tmp_path / "worker.py"
    script.write_text("import os; open(os.environ['OUT'], 'w').write(os.environ['RANK'])\n")
    agent = NodeAgent(daemon_url="http://127.0.0.1:9", token="t", node_id="n-1", metadata=None,  # type: ignore[arg-type]
                      workdir=tmp_path / "node")
    agent.workdir.mkdir()

    def job(out: str) -> dict:
        return {"argv": ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1",
                         str(script)], "env": {"OUT": str(tmp_path / out)}}

    agent.runner.job, agent.runner.prepared = job("first"), True
    try:
        async with asyncio.timeout(120):
            await agent.runner.start()  # never prewarmed here: torchrun started directly
            first = agent.runner.proc
            assert first is not None and await first.wait() == 0
            await agent._restart({"kind": "restart", "id": "r-1", "job": job("second")})
            warm = agent.runner.warm
            assert warm is not None and _cmdline(warm.pid)[-2:] == ["-m", "daemon.gpunode.launcher"]
            assert agent.trainer in ("warming", "not_started")
            await agent.runner.start()
            assert agent.runner.proc is warm  # the new spec went to the prewarmed launcher
            assert await warm.wait() == 0
        assert (tmp_path / "second").read_text() == "0"
    finally:
        for task in list(agent._background):
            task.cancel()
        await asyncio.gather(*agent._background, return_exceptions=True)
        await agent.runner.stop_prewarmed()


async def test_rejoin_checkpoint_request_reaches_notice_file(spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    gate = h.tmp_path / "commit-ok"
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_GATE": str(gate)}) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        n1 = the_node(h)
        assert n1.state is NodeState.RUNNING

        # grow the pool: a second node launches and its (simulated) agent registers
        n2, req = await _second_node_registers(h)
        rid = req.data["request_id"]
        assert req.data["reason"] == "rejoin" and req.data["for_nodes"] == [n2.id]
        assert n2.state is NodeState.ADMITTING

        def pending_ids() -> list[tuple[str, str]]:
            return [(n["id"], n["kind"]) for n in notice_file(agent)]

        await h.until(lambda: pending_ids() == [(rid, "rejoin")], what="rejoin in the notice file")

        gate.touch()  # let the stand-in commit it
        await h.until(lambda: pending_ids() == [], what="rejoin removed after its commit")
        await h.until(lambda: n2.state is NodeState.RUNNING, what="second node admitted")
        commits = h.events("checkpoint_committed")
        assert [c.data["notice_ids"] for c in commits] == [[rid]]
        assert commits[0].data["kinds"] == ["rejoin"]
        # a rejoin commit is not this node's interruption: the trainer keeps running
        assert agent.runner.proc is not None and agent.runner.proc.returncode is None
        assert not h.events("trainer_exited")
        assert n1.state is NodeState.RUNNING


async def test_plain_checkpoint_command(spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    gate = h.tmp_path / "commit-ok"
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_GATE": str(gate)}) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        node = the_node(h)
        h.sup.agents.send(node.id, {"kind": "checkpoint", "reason": "manual", "id": "ck-1"})
        await h.until(lambda: [n["kind"] for n in notice_file(agent)] == ["checkpoint"], what="checkpoint notice")
        assert notice_file(agent)[0]["id"] == "ck-1"
        gate.touch()
        await h.until(lambda: notice_file(agent) == [] and h.events("checkpoint_committed"), what="commit")
        assert h.events("checkpoint_committed")[0].data["notice_ids"] == ["ck-1"]
        assert agent.runner.proc is not None and agent.runner.proc.returncode is None


async def test_only_rank_0_and_a_noticed_node_report_the_jobs_lines(spot_daemon, fake, clock, monkeypatch) -> None:
    """Every node's trainer writes the same ``started`` and ``checkpoint_committed``
    lines; a node that does not host rank 0 forwards its own ``started`` (its word on who
    leads the attempt, daemon/control/attempts.py) and, of the commits, only the one that
    answers its own notice (at 1,000 nodes: one report per commit, not 1,000), and still
    leaves on it."""
    h = spot_daemon
    gate = h.tmp_path / "commit-ok"
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_GATE": str(gate), "STANDIN_RANK": "1"}) as agent:
        await h.until(lambda: trainer_running(agent), what="trainer started")
        await h.until(lambda: agent.status_path.exists() and "started" in agent.status_path.read_text(),
                      what="the started line")
        node = the_node(h)
        h.sup.agents.send(node.id, {"kind": "checkpoint", "reason": "manual", "id": "ck-1"})
        await h.until(lambda: [n["id"] for n in notice_file(agent)] == ["ck-1"], what="checkpoint request")
        gate.touch()
        await h.until(lambda: notice_file(agent) == [], what="the request's commit")
        fake.publish_interruption("terminate")
        await h.until(lambda: h.events("trainer_exited"), timeout_s=10, what="trainer exit after commit")
        (notice,) = h.events("interruption_notice")
        assert [c.data["notice_ids"] for c in h.events("checkpoint_committed")] == [[notice.data["notice_id"]]]
        assert not h.events("job_resumed")  # rank 0's node reports the attempt's start
        assert h.sup.tracker.attempt_of(node.id)  # this node's own start came: it holds ranks of the attempt
        lines = [json.loads(x)["event"] for x in agent.status_path.read_text().splitlines()]
        assert lines.count("checkpoint_committed") == 2


async def test_metadata_errors_are_not_notices(spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    async with running_agent(h, fake, clock, monkeypatch) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        fake.fail_next(3, status=500)
        n = len(fake.request_log)
        await h.until(lambda: [s for _, _, s in fake.request_log[n:]].count(500) == 3, what="three 500s")
        i = max(k for k, (_, _, s) in enumerate(fake.request_log) if s == 500)
        await h.until(lambda: ("GET", INSTANCE_ACTION_PATH, 404) in fake.request_log[i:], what="polling on")
        assert not h.events("interruption_notice")
        assert the_node(h).state is NodeState.RUNNING
        assert notice_file(agent) == []

        fake.publish_interruption("terminate")
        await h.until(lambda: h.events("interruption_notice"), what="the real notice")
        assert the_node(h).state is NodeState.DRAINING


async def test_a_streak_of_metadata_errors_raises_one_alarm_then_recovers(
        spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    async with running_agent(h, fake, clock, monkeypatch, alarm_after=3) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        fake.fail_next(6, status=503, path=INSTANCE_ACTION_PATH)
        await h.until(lambda: h.events("metadata_unreachable"), what="the alarm")
        await h.until(lambda: h.events("metadata_recovered"), what="the recovery")
        assert len(h.events("metadata_unreachable")) == 1  # one alarm per streak, not one per failure
        assert h.events("metadata_unreachable")[0].data["failures"] == 3
        assert not h.events("interruption_notice")
        fake.publish_interruption("terminate")
        await h.until(lambda: h.events("interruption_notice"), what="the real notice after the outage")


async def test_bad_token_is_401(spot_daemon, fake, clock, monkeypatch) -> None:
    h = spot_daemon
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = the_node(h)
    url = h.api.agent_url
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/agent/register", "/v1/agent/heartbeat", "/v1/agent/commands", "/v1/agent/events"):
            body = {"node_id": node.id, "events": []}
            async with s.post(url + path, json=body, headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401, path
            async with s.post(url + path, json=body) as r:  # no token at all
                assert r.status == 401, path
        # the right token for another node id is refused too
        async with s.post(url + "/v1/agent/heartbeat", json={"node_id": "test-99"},
                          headers={"Authorization": f"Bearer {node.token}"}) as r:
            assert r.status == 401
        async with s.post(url + "/v1/agent/heartbeat", json={"node_id": node.id},
                          headers={"Authorization": f"Bearer {node.token}"}) as r:
            assert r.status == 200
    assert node.state in (NodeState.READY, NodeState.RUNNING)  # only the good request counted

    # an agent holding a bad token stops with a clear error instead of retrying forever
    agent = NodeAgent(daemon_url=url, token="wrong", node_id=node.id, metadata=AwsImds(fake.url, clock=clock),
                      workdir=h.tmp_path / "bad-node", poll_interval_s=0.05, heartbeat_interval_s=0.05)
    with pytest.raises(PermissionError, match="token"):
        await asyncio.wait_for(agent.run(), 5)


def counting_heartbeats(h, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times (monotonic) of the heartbeats the daemon answers from now on."""
    times: list[float] = []
    real = h.sup.agents.on_heartbeat

    def on_heartbeat(node, body):
        times.append(asyncio.get_running_loop().time())
        return real(node, body)

    monkeypatch.setattr(h.sup.agents, "on_heartbeat", on_heartbeat)
    return times


async def test_commands_come_by_long_poll_between_heartbeats(spot_daemon, fake, clock, monkeypatch) -> None:
    """A pool told to heartbeat every 30 s: the trainer start and a rejoin checkpoint
    request still reach the node at once, by the command long-poll."""
    h = spot_daemon
    c = h.sup.config
    h.sup.config = c.model_copy(update={"agent": c.agent.model_copy(update={"heartbeat_interval_s": 30.0})})
    beats = counting_heartbeats(h, monkeypatch)
    gate = h.tmp_path / "commit-ok"
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_GATE": str(gate)}) as agent:
        await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
        assert agent.told_interval_s == 30.0  # what the daemon said, not the agent's own 0.05 s
        n1 = the_node(h)
        # the agent heartbeats at once when its trainer starts (not 30 s later): a drain or a
        # checkpoint request goes only to a node the daemon knows runs a trainer
        await h.until(lambda: n1.trainer == "running", what="a heartbeat saying the trainer runs")

        n2, req = await _second_node_registers(h)  # grow the pool → a rejoin request for n1
        rid = req.data["request_id"]
        asked = asyncio.get_running_loop().time()
        await h.until(lambda: [(n["id"], n["kind"]) for n in notice_file(agent)] == [(rid, "rejoin")],
                      what="rejoin in the notice file")
        assert [t for t in beats if t >= asked] == []  # no heartbeat since: the long-poll brought it
        assert len(beats) <= 2 and not h.sup.agents._commands.get(n1.id)  # the first one, and the trainer's start


async def test_an_older_daemon_without_the_long_poll(spot_daemon, fake, clock, monkeypatch) -> None:
    """A daemon that 404s ``/v1/agent/commands``: the agent asks once, then lives on heartbeats."""
    from aiohttp import web

    from daemon.interfaces.api import SUPERVISOR, _heartbeat, _register, _reports

    h = spot_daemon
    polls: list[int] = []

    @web.middleware
    async def count(request: web.Request, handler):
        if request.path == "/v1/agent/commands":
            polls.append(1)
        return await handler(request)

    old = web.Application(middlewares=[count])  # the agent port before the long-poll existed
    old[SUPERVISOR] = h.sup
    old.router.add_post("/v1/agent/register", _register)
    old.router.add_post("/v1/agent/heartbeat", _heartbeat)
    old.router.add_post("/v1/agent/events", _reports)
    runner = web.AppRunner(old, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        gate = h.tmp_path / "commit-ok"
        async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_GATE": str(gate)},
                                 daemon_url=url) as agent:
            await h.until(lambda: trainer_running(agent) and h.events("job_resumed"), what="trainer started")
            node = the_node(h)
            h.sup.agents.send(node.id, {"kind": "checkpoint", "reason": "manual", "id": "ck-old"})
            await h.until(lambda: [n["id"] for n in notice_file(agent)] == ["ck-old"], what="by heartbeat")
            assert polls == [1]  # asked once, got 404, did not retry
    finally:
        await runner.cleanup()


async def test_a_job_whose_trainers_all_exited_is_reported_and_restarted_in_place(
        spot_daemon, fake, clock, monkeypatch) -> None:
    """Issue 25: the only trainer of the job exits 1 (its rendezvous store restarted
    empty) and, before, nothing ever happened again. Now the daemon reports
    ``job_stalled`` (trainers_exited) after the exit grace, moves the job to a new
    rendezvous id and sends the node ``restart``; its agent starts the trainer again in
    place (same node, no relaunch) and the new attempt is recorded (``job_resumed``)."""
    h = spot_daemon
    h.sup.stall.rules = dataclasses.replace(h.sup.stall.rules, exit_grace_s=0.2)
    nonce = h.sup.run_nonce
    marker = h.tmp_path / "failed-once"
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_FAIL_ONCE": str(marker)}) as agent:
        await h.until(lambda: len(h.events("job_resumed")) == 2 and trainer_running(agent), timeout_s=30,
                      what="the trainer restarted in place")
        node = the_node(h)
        (exited,) = h.events("trainer_exited")
        (stalled,) = h.events("job_stalled")
        first, second = h.events("job_resumed")
        assert exited.data["exit_code"] == 1 and exited.node == node.id
        assert stalled.data["reason"] == "trainers_exited" and stalled.data["restart"] == [node.id]
        assert first.seq < exited.seq < stalled.seq < second.seq
        assert first.data["attempt"] != second.data["attempt"]
        assert h.sup.run_nonce != nonce and h.sup.store.get("run_nonce") == h.sup.run_nonce  # a new rendezvous id
        assert node.state is NodeState.RUNNING and len(h.sup.nodes) == 1  # the same node: nothing relaunched
        status = [json.loads(x) for x in agent.status_path.read_text().splitlines()]
        assert [x["event"] for x in status] == ["started", "started"]


async def test_a_stall_while_the_rendezvous_store_is_silent_says_so(spot_daemon, fake, clock, monkeypatch) -> None:
    """A trainer that exits because its store is gone stalls the job as ``trainers_exited``
    or ``rendezvous_closed``: said alone, both point at the trainer. While the rendezvous
    watch's alarm holds, the stall's message names the store, since when, and the fix."""
    from daemon.control.rendezvous_health import StoreHealth

    h = spot_daemon
    h.sup.stall.rules = dataclasses.replace(h.sup.stall.rules, exit_grace_s=0.2)
    h.sup.rendezvous.interval_s = 3600.0  # this test sets the watch's verdict itself
    h.sup.rendezvous.health = StoreHealth("east", "10.0.0.10:29400", failures=3, since=0.0,
                                          error="ConnectionRefusedError: Connection refused", alarmed=True)
    marker = h.tmp_path / "failed-once"
    async with running_agent(h, fake, clock, monkeypatch, env={"STANDIN_FAIL_ONCE": str(marker)}) as agent:
        await h.until(lambda: h.events("job_stalled") and trainer_running(agent), timeout_s=30, what="the stall")
        (stalled,) = h.events("job_stalled")
        assert stalled.data["message"].endswith(
            "; the rendezvous store at 10.0.0.10:29400 (domain east) has not answered since 00:00:00 UTC: "
            "ConnectionRefusedError: Connection refused (start it on 10.0.0.10 (systemctl start spotvisor-rendezvous, "
            "or spotvisord rendezvous --host 10.0.0.10 --port 29400), and let the control node and the job's nodes "
            "reach port 29400 there)")
