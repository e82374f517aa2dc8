"""spotctl (daemon/interfaces/ctl.py) end to end: every verb against a running daemon, one-shot
and in the interactive shell driven through a real pty.

The daemon (Supervisor + ApiServer, the ``spot_daemon`` fixture, or ``own_daemon``
for a restart) runs in the test's event loop; spotctl is a real subprocess talking
to its real unix socket. Where a verb needs a node that really trains, a real
``NodeAgent`` runs in the loop with a trainer stand-in as its torchrun: it prints
lines to stdout (so ``trainer.log``), reports ``started``, and answers each new
notice-file entry with ``checkpoint_committed`` + ``holding`` (once a gate file
exists, when ``STANDIN_GATE`` is set). For ``simulate-preemption`` the pool is on
the real local provider (agents as processes, each with its fake IMDS).

No sleeps as synchronisation: every wait is a condition re-checked on each new
event (``DaemonHarness.until``) or a read with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog

from conftest import DaemonHarness, RecordingProvider, agent_running, spotctl
from daemon.gpunode.agent import NodeAgent
from daemon.config import Config
from daemon.gpunode.gpu import GpuSampler
from daemon.gpunode.metadata.aws import AwsImds
from daemon.providers.local_metadata.aws import FakeImds
from daemon.model import NodeState
from trainers import STANDIN

#: the stand-in as spotctl's tests run it: five lines to stdout, commits of 0.5 s and 1000 bytes
STANDIN_ARGV = [str(STANDIN), "--step", "3", "--print-lines", "5", "--commit-s", "0.5", "--commit-bytes", "1000"]

REPO = Path(__file__).resolve().parents[1]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotctl"), err
    assert "Traceback" not in err
    return lines[0]


async def register(h: DaemonHarness, node_id: str) -> None:
    """The node's (simulated) agent registers: the node becomes ready."""
    node = h.sup.nodes[node_id]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        async with s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": node.id}) as r:
            assert r.status == 200


async def running_node(h: DaemonHarness) -> None:
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    await register(h, node.id)
    await h.until(lambda: node.state is NodeState.RUNNING, what="node running")


@contextlib.asynccontextmanager
async def agent_on_first_node(h: DaemonHarness, monkeypatch: pytest.MonkeyPatch, *,
                              sampler: GpuSampler | None = None,
                              env: dict[str, str] | None = None) -> AsyncIterator[NodeAgent]:
    """The pool's first node with a real agent (its trainer: the stand-in); on exit the
    agent is cancelled and must have shut down cleanly."""
    monkeypatch.setattr(h.sup, "job_spec", lambda node: {"argv": STANDIN_ARGV, "env": dict(env or {})})
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    async with FakeImds(instance_id="i-0001") as imds:
        agent = NodeAgent(daemon_url=h.api.agent_url, token=node.token, node_id=node.id,  # type: ignore[attr-defined]
                          metadata=AwsImds(imds.url), workdir=h.tmp_path / "node", poll_interval_s=0.05,
                          heartbeat_interval_s=0.05, gpu_sampler=sampler)
        async with agent_running(agent):
            await h.until(lambda: node.trainer == "running" and h.events("job_resumed"), what="trainer started")
            yield agent
    assert agent.runner.proc is None or agent.runner.proc.returncode is not None, "trainer left running"


@contextlib.asynccontextmanager
async def own_daemon(tmp_path: Path, sockdir: str, raw: dict[str, Any],
                     provider: Any = None) -> AsyncIterator[DaemonHarness]:
    """A daemon like ``spot_daemon`` on a config of the test's own, in ``tmp_path/state``."""
    from daemon.interfaces.api import ApiServer
    from daemon.controlnode.store import Store
    from daemon.controlnode.supervisor import Supervisor

    socket_path = f"{sockdir}/d.sock"
    config = Config.model_validate({
        "job": {"id": "job1", "module": "standin_trainer"},
        **raw,
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": socket_path, "reconcile_interval_s": 0.05,
                   **raw.get("daemon", {})},
    })
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = provider if provider is not None else RecordingProvider()
    sup = Supervisor(config, providers={"local": provider}, store=store)
    api = ApiServer(sup, agent_host="127.0.0.1", agent_port=0, socket_path=socket_path)
    try:
        await api.start()
        assert api.agent_url is not None
        await sup.start(agent_url=api.agent_url)
        yield DaemonHarness(sup, api, provider, config, socket_path, tmp_path)
    finally:
        await sup.aclose()
        await api.aclose()
        store.close()


@pytest.fixture
def sockdir() -> AsyncIterator[str]:
    d = tempfile.mkdtemp(prefix="sv-", dir="/tmp")  # unix socket paths are limited to ~100 characters
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- status / nodes -----------------------------------------------------------------------------
async def test_status_job_line_durations_and_recoveries(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    h.sup.record("job_resumed", "test-1", attempt="a1", step=0)
    h.sup.record("interruption_notice", "test-1", notice_id="n-1")  # a job member lost: one recovery
    h.sup.record("node_lost", "test-9", reason="never admitted")  # not a job member: not a recovery
    rc, out, err = await spotctl("--socket", h.socket_path, "status", "--json")
    assert rc == 0, err
    job = json.loads(out)["job"]
    assert job["recoveries"] == 1
    first = h.events("node_launch_requested")[0].time
    assert job["submitted_at"] == round(first, 1)
    assert 0 <= job["running_s"] <= job["total_s"] < 60 and job["paused_s"] == 0
    node = json.loads(out)["nodes"][0]
    assert node["gpu"] is None  # no GPU sample: absent, never zeros

    rc, text, err = await spotctl("--socket", h.socket_path, "status")
    assert rc == 0, err
    head, row, pool = text.splitlines()[:3]
    cols = re.split(r"\s{2,}", head)
    assert cols == ["JOB", "STATE", "STEP", "WORLD", "SUBMITTED", "TOT. DURATION", "JOB DURATION", "#RECOVERIES",
                    "RESTARTS", "LAST COMMIT"]
    values = dict(zip(cols, re.split(r"\s{2,}", row)))
    assert values["JOB"] == "job1" and values["STATE"] == "RUNNING" and values["#RECOVERIES"] == "1"
    assert values["SUBMITTED"].endswith(" ago") and values["LAST COMMIT"] == "none"
    assert pool.startswith("pool test  1 live / target 1 nodes (1..2)")
    assert pool.endswith("domain local-local")  # the placement domain the job runs in
    assert text.splitlines()[3].split()[:2] == ["NODE", "DOMAIN"]
    assert text.splitlines()[4].split()[1] == "local-local"
    assert text.splitlines()[4].split()[-1] == "n/a"  # the node's SM% column: no sample


# -- tail ---------------------------------------------------------------------------------------
async def test_tail_one_shot_follow_and_errors(spot_daemon, monkeypatch) -> None:
    h = spot_daemon
    more = h.tmp_path / "more.txt"
    async with agent_on_first_node(h, monkeypatch, env={"STANDIN_MORE": str(more)}):
        await h.until(lambda: h.sup.agents.node_logs.last_seq("test-1") >= 5, what="five log lines shipped")
        sock = ["--socket", h.socket_path]
        rc, out, err = await spotctl(*sock, "tail", "test-1", "-n", "3")
        assert rc == 0, err
        assert out.splitlines() == ["trainer line 3", "trainer line 4", "trainer line 5"]
        rc, out, err = await spotctl(*sock, "tail", "test-1", "--json")
        assert rc == 0, err
        rows = [json.loads(x) for x in out.splitlines()]
        assert [r["line"] for r in rows] == [f"trainer line {i}" for i in range(1, 6)]
        assert [r["seq"] for r in rows] == [1, 2, 3, 4, 5] and {r["node"] for r in rows} == {"test-1"}

        rc, out, err = await spotctl(*sock, "tail", "test-7")
        assert rc == 2 and "no node 'test-7'" in one_line(err) and "test-1" in err
        rc, out, err = await spotctl(*sock, "tail", "test-1", "-n", "many")
        assert rc == 2 and "'many' is not a whole number" in one_line(err)
        rc, out, err = await spotctl(*sock, "tail")
        assert rc == 2 and "node" in one_line(err)

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.interfaces.ctl", *sock, "tail", "test-1", "-n", "1", "-f", cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"trainer line 5\n"
            more.write_text("more 1\nmore 2\n")  # the trainer prints it; the agent ships it
            assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"more 1\n"
            assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"more 2\n"
            assert proc.returncode is None  # still following
            # the node is gone (its agent with it): the follow ends instead of waiting forever
            h.sup.set_state(h.sup.nodes["test-1"], NodeState.LOST, "test: instance gone")
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            assert proc.stderr is not None
            assert "the daemon ended the log (the node has terminated)" in (await proc.stderr.read()).decode()
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


# -- scale --------------------------------------------------------------------------------------
async def test_scale_grows_shrinks_and_refuses(spot_daemon) -> None:
    h = spot_daemon
    sock = ["--socket", h.socket_path]
    rc, out, err = await spotctl(*sock, "scale", "3")
    assert rc == 2 and "the pool allows 1..2 nodes" in one_line(err)
    rc, out, err = await spotctl(*sock, "scale", "0")
    assert rc == 2 and "1..2" in one_line(err)

    rc, out, err = await spotctl(*sock, "scale", "2", "--json")  # before the job starts: it starts on 2
    assert rc == 0, err
    assert json.loads(out) == {"target_nodes": 2, "old": 1, "paused": False, "draining": []}
    assert h.sup.store.get("target_nodes") == 2
    await h.until(lambda: len(h.sup.nodes) == 2 and all(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()),
                  what="two launches")
    for node_id in ("test-1", "test-2"):
        await register(h, node_id)
    await h.until(lambda: all(n.state is NodeState.RUNNING for n in h.sup.nodes.values()), what="both running")
    rc, out, err = await spotctl(*sock, "status", "--json")
    assert json.loads(out)["pool"]["target_nodes"] == 2

    rc, out, err = await spotctl(*sock, "scale", "1")  # shrink: the youngest running node drains
    assert rc == 0, err
    assert out.strip() == "target 1 nodes (was 2); draining test-2 (each commits, then leaves)"
    # no trainer runs on it, so it is released as soon as it drained
    assert h.sup.nodes["test-2"].state in (NodeState.DRAINING, NodeState.TERMINATED)
    assert h.sup.nodes["test-1"].state is NodeState.RUNNING
    (ev,) = h.events("pool_scaled")[1:]
    assert ev.data == {"old": 2, "new": 1, "paused": False, "draining": ["test-2"]}


async def test_scale_refuses_a_world_size_the_batch_cannot_split(tmp_path, sockdir) -> None:
    raw = {"pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 4},
           "job": {"id": "job1", "module": "x", "global_batch_size": 12, "micro_batch_size": 2}}
    async with own_daemon(tmp_path, sockdir, raw) as h:
        rc, out, err = await spotctl("--socket", h.socket_path, "scale", "4")  # 12 / (2 x 4) is not whole
        assert rc == 2
        assert "world size 4 cannot share global batch 12 in micro batches of 2 (node counts that can: 1, 2, 3)" \
            in one_line(err)


async def test_scale_survives_a_daemon_restart(tmp_path, sockdir) -> None:
    raw = {"pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 3}}
    async with own_daemon(tmp_path, sockdir, raw) as h:
        rc, out, err = await spotctl("--socket", h.socket_path, "scale", "3")
        assert rc == 0, err
    async with own_daemon(tmp_path, sockdir, raw) as h2:  # same store, a fresh daemon
        rc, out, err = await spotctl("--socket", h2.socket_path, "status", "--json")
        assert rc == 0, err
        assert json.loads(out)["pool"]["target_nodes"] == 3
        assert h2.sup.desired_nodes == 3


# -- pause / resume -----------------------------------------------------------------------------
async def test_pause_commits_releases_and_resume_relaunches(spot_daemon, monkeypatch) -> None:
    h = spot_daemon
    sock = ["--socket", h.socket_path]
    gate = h.tmp_path / "commit-ok"
    async with agent_on_first_node(h, monkeypatch, env={"STANDIN_GATE": str(gate)}) as agent:
        rc, out, err = await spotctl(*sock, "pause", "--json")
        assert rc == 0, err
        assert json.loads(out) == {"state": "pausing", "draining": ["test-1"], "committing": ["test-1"]}
        (req,) = h.events("checkpoint_requested")
        assert req.data["reason"] == "drain" and req.data["why"] == "pause"

        rc, out, err = await spotctl(*sock, "resume")  # the commit has not happened yet (gated)
        assert rc == 2 and "still releasing test-1" in one_line(err)
        rc, out, err = await spotctl(*sock, "pause")
        assert rc == 2 and "already paused" in one_line(err)

        gate.touch()
        await h.until(lambda: h.events("job_paused"), timeout_s=15, what="job_paused")
        (commit,) = h.events("checkpoint_committed")
        assert commit.data["notice_ids"] == [req.data["request_id"]]
        assert agent.trainer == "exited"  # the agent stopped it after the commit
        node = h.sup.nodes["test-1"]
        assert node.state is NodeState.TERMINATED
        assert [e.data["reason"] for e in h.events("node_terminated")] == ["drained"]
        (paused,) = h.events("job_paused")
        assert paused.data["last_commit_step"] == commit.data["step"] == 4

        rc, out, err = await spotctl(*sock, "status", "--json")
        status = json.loads(out)
        assert status["job"]["state"] == "paused" and status["pool"]["paused"] is True
        assert status["pool"]["desired_nodes"] == 0
        rc, text, err = await spotctl(*sock, "status")
        assert "paused: no capacity held (spotctl resume relaunches)" in text
        assert len(h.sup.nodes) == 1  # nothing relaunched while paused

        rc, out, err = await spotctl(*sock, "scale", "2")  # applies at resume
        assert rc == 0 and "(applies at resume: the job is paused)" in out
        rc, out, err = await spotctl(*sock, "resume", "--json")
        assert rc == 0, err
        assert json.loads(out) == {"state": "pending", "target_nodes": 2, "resume_from_step": 4, "trainer_reports": True}
        await h.until(lambda: sum(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()) == 2,
                      what="two nodes relaunched")
        (unpaused,) = h.events("job_unpaused")
        assert unpaused.data == {"target_nodes": 2, "resume_from_step": 4}
        assert h.sup.store.get("paused") is False
        rc, out, err = await spotctl(*sock, "resume")
        assert rc == 2 and "not paused" in one_line(err)


# -- cost ---------------------------------------------------------------------------------------
async def test_cost_against_hand_computed_numbers(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    h.sup.desired_nodes = 0  # release it, so its hours stop growing
    h.sup.wake()
    node = h.sup.nodes["test-1"]
    await h.until(lambda: node.state is NodeState.TERMINATED, what="released")
    t0 = 1_700_000_000.0
    node.created_at, node.ended_at = t0, t0 + 5400  # held 1.5 h at 0.5 USD/h

    rc, out, err = await spotctl("--socket", h.socket_path, "cost", "--json")
    assert rc == 0, err
    cost = json.loads(out)
    assert cost["spot_usd"] == 0.75 and cost["hours"] == 1.5
    assert cost["on_demand_usd"] is None and cost["savings_usd"] is None and cost["unpriced_nodes"] == ["test-1"]
    rc, text, err = await spotctl("--socket", h.socket_path, "cost")
    assert "on-demand equivalent: n/a (set offers[].on_demand_price_usd_h in the config)" in text

    offers = [h.config.offers[0].model_copy(update={"on_demand_price_usd_h": 2.0})]
    h.sup.config = h.config.model_copy(update={"offers": offers})
    rc, out, err = await spotctl("--socket", h.socket_path, "cost", "--json")
    cost = json.loads(out)
    (row,) = cost["nodes"]
    assert row["billed_from"] == t0 and row["billed_to"] == t0 + 5400 and row["price_usd_h"] == 0.5
    # 1.5 h x 2.0 USD/h = 3.00 on demand; 3.00 - 0.75 = 2.25 saved = 75 %
    assert (cost["on_demand_usd"], cost["savings_usd"], cost["savings_pct"]) == (3.0, 2.25, 75.0)
    assert cost["spot_usd_h_now"] == 0.0 and cost["unpriced_nodes"] == []
    rc, text, err = await spotctl("--socket", h.socket_path, "cost")
    assert rc == 0, err
    lines = text.splitlines()
    assert re.split(r"\s{2,}", lines[1]) == ["test-1", "local/local/-/local.cpu", "terminated", "1.500", "0.500",
                                             "0.75", "2.000", "3.00"]
    assert "on-demand equivalent USD 3.00, savings USD 2.25 (75.0 %)" in text
    assert any(x.startswith("how: spot: each node's price at launch x its hours held") for x in lines)


# -- simulate-preemption ------------------------------------------------------------------------
async def test_simulate_preemption_refused_off_the_local_provider(spot_daemon) -> None:
    h = spot_daemon
    await running_node(h)
    sock = ["--socket", h.socket_path]
    rc, out, err = await spotctl(*sock, "simulate-preemption", "test-1")
    assert rc == 2 and out == ""
    assert "works only on the local provider; node test-1 runs on 'test'" in one_line(err)
    rc, out, err = await spotctl(*sock, "simulate-preemption", "test-5")
    assert rc == 2 and "no node 'test-5'" in one_line(err)
    rc, out, err = await spotctl(*sock, "simulate-preemption", "test-1", "--lead-s", "0")
    assert rc == 2 and "--lead-s" in one_line(err)
    assert not h.events("chaos_injected")


async def test_simulate_preemption_on_the_local_provider(tmp_path, sockdir, monkeypatch) -> None:
    from daemon.config import LocalProviderSpec
    from daemon.providers.local import LocalProvider

    provider = LocalProvider(spec=LocalProviderSpec(launch_delay_s=0), state_dir=tmp_path / "state",
                             agent_args=["--poll-interval-s", "0.1", "--heartbeat-interval-s", "0.1"])
    raw = {"pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2}}
    from daemon.controlnode.supervisor import Supervisor

    monkeypatch.setattr(Supervisor, "job_spec", lambda self, node: {"argv": STANDIN_ARGV, "env": {}})
    async with own_daemon(tmp_path, sockdir, raw, provider=provider) as h:
        await h.until(lambda: any(n.trainer == "running" for n in h.sup.nodes.values()), timeout_s=30,
                      what="the local node's trainer running")
        rc, out, err = await spotctl("--socket", h.socket_path, "simulate-preemption", "test-1", "--lead-s", "20",
                                     "--json")
        assert rc == 0, err
        reply = json.loads(out)
        assert reply["node"] == "test-1" and reply["lead_s"] == 20.0 and reply["deadline"] > time.time() + 10
        # the agent sees it on its metadata endpoint like a real notice, and the job answers it
        await h.until(lambda: h.events("interruption_notice"), timeout_s=15, what="the notice seen by the agent")
        (notice,) = h.events("interruption_notice")
        assert notice.node == "test-1" and notice.data["action"] == "terminate"
        (chaos,) = h.events("chaos_injected")
        assert chaos.data["source"] == "operator" and chaos.data["lead_s"] == 20.0
        await h.until(lambda: h.events("checkpoint_committed"), timeout_s=15, what="the notice's commit")
        assert h.sup.nodes["test-1"].state in (NodeState.DRAINING, NodeState.TERMINATED)
        # a second notice for a node that is leaving (or gone) is refused, not promised
        rc, out, err = await spotctl("--socket", h.socket_path, "simulate-preemption", "test-1")
        assert rc == 2 and out == "" and "reclaims it" not in err
        assert re.search(r"node test-1 (already has an interruption notice|is terminated)", one_line(err)), err
        assert len(h.events("chaos_injected")) == 1


# -- node ids in the URL, and answers of another shape (issue 25, item 8) ----------------------
async def test_a_node_id_never_reaches_another_route(spot_daemon) -> None:
    """``spotctl drain "x/../../checkpoint?"`` once sent ``POST /v1/checkpoint`` (the URL's
    ``..`` segments resolved) and ``../pause?`` would pause the job. spotctl refuses what is
    not a node id in one line (exit 2); the daemon refuses one that reaches it anyway (400),
    and nothing is checkpointed, drained or paused."""
    h = spot_daemon
    await running_node(h)
    sock = ["--socket", h.socket_path]
    for argv in (["drain", "x/../../checkpoint?"], ["drain", "../pause?"], ["drain", ".."],
                 ["tail", "test-1/../../pause"], ["simulate-preemption", "../../pause?x="]):
        rc, out, err = await spotctl(*sock, *argv)
        assert rc == 2 and out == "", (argv, err)
        assert f"{argv[1]!r} is not a node id" in one_line(err), err
    import yarl

    conn = aiohttp.UnixConnector(path=h.socket_path)
    async with aiohttp.ClientSession(connector=conn) as s:
        for raw in ("x%2F..%2F..%2Fcheckpoint%3F", "..%2Fpause", "%2E%2E", "test-1%20"):
            url = yarl.URL(f"http://spotvisord/v1/nodes/{raw}/drain", encoded=True)  # sent as is
            async with s.post(url) as r:
                assert r.status == 400, (raw, r.status)
                assert "is not a node id" in (await r.json())["error"], raw
    assert not h.events("checkpoint_requested") and not h.sup.paused
    assert h.sup.nodes["test-1"].state is NodeState.RUNNING
    rc, out, err = await spotctl(*sock, "drain", "test-1")  # a real id still works
    assert rc == 0 and out.startswith("test-1: draining"), err


async def _spotctl_against(sock: str, answer: Any, argv: list[str]) -> tuple[int, str, str]:
    """spotctl ``argv`` against a stand-in daemon on ``sock`` that gives every request
    ``answer`` (JSON; a string ending in a newline: an NDJSON stream as it is)."""
    from aiohttp import web

    async def reply(request: web.Request) -> web.Response:
        if isinstance(answer, str) and answer.endswith("\n"):
            return web.Response(text=answer, content_type="application/x-ndjson")
        return web.json_response(answer)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", reply)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, sock).start()
    try:
        return await spotctl("--socket", sock, *argv)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("argv", "answer"), [
    (["drain", "test-1"], {"request_id": "manual-1"}),  # what the path-confused request got back
    (["checkpoint"], {"node": "test-1"}),
    (["status"], []),
    (["cost"], {"nodes": "x"}),
    (["scale", "2"], {"target_nodes": 2}),
    (["resume"], "ok"),
    (["simulate-preemption", "test-1"], {"node": "test-1", "lead_s": 30}),
    (["events"], "[1, 2]\n"),
    (["events"], "not json\n"),
    (["tail", "test-1"], "{}\n"),
])
async def test_an_answer_of_another_shape_is_one_line_exit_1(sockdir: str, argv: list[str], answer: Any) -> None:
    sock = f"{sockdir}/odd.sock"
    rc, out, err = await _spotctl_against(sock, answer, argv)
    assert rc == 1, (argv, out, err)
    line = one_line(err)
    assert line.startswith(f"spotctl: unexpected answer from spotvisord at {sock}: "), line
    assert "same version" in line


@pytest.mark.parametrize(("argv", "answer", "said"), [
    (["checkpoint"], {"request_id": "manual-1", "trainer_reports": True}, "the job commits at its next step boundary"),
    (["checkpoint"], {"request_id": "manual-1", "trainer_reports": False},
     "has reported no step, so a commit may not follow"),
    (["resume"], {"state": "pending", "target_nodes": 2, "resume_from_step": None, "trainer_reports": True},
     "the job resumes from its last commit (the start)"),
    (["resume"], {"state": "pending", "target_nodes": 2, "resume_from_step": None, "trainer_reports": False},
     "the job's script (job.command) resumes from what it saved itself"),
])
async def test_checkpoint_and_resume_promise_no_commit_a_silent_script_cannot_make(
        sockdir: str, argv: list[str], answer: Any, said: str) -> None:
    """A ``job.command`` script that reports nothing may not commit on request, and what it
    resumes from is its own: spotctl says so, and the step-boundary promise only otherwise."""
    rc, out, err = await _spotctl_against(f"{sockdir}/said.sock", answer, argv)
    assert rc == 0, err
    assert said in out and ("step boundary" in out) == (said == "the job commits at its next step boundary")


def test_the_daemon_says_whether_the_trainer_reports_what_a_commit_needs() -> None:
    from types import SimpleNamespace

    from daemon.interfaces.api import _trainer_reports

    def sup(command: str | None, step: int | None, commit: int | None) -> Any:
        return SimpleNamespace(config=SimpleNamespace(job=SimpleNamespace(command=command)),
                               job=SimpleNamespace(step=step, last_commit_step=commit))

    assert _trainer_reports(sup(None, None, None))  # spotvisor's own trainer: before its first step too
    assert not _trainer_reports(sup("train.py", None, None))  # a script that said nothing
    assert _trainer_reports(sup("train.py", 12, None)) and _trainer_reports(sup("train.py", None, 10))  # HF callback


# -- hostile values: one line, or rendered (issue 25, item 9) ----------------------------------
async def _control(h: DaemonHarness, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One raw request on the control socket: (status, JSON body or text)."""
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=h.socket_path)) as s:
        async with s.request(method, f"http://spotvisord{path}", json=body) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


@pytest.mark.parametrize("case", ["since", "lead_s", "event_time", "event_data_not_an_object"])
async def test_hostile_values_are_one_line_errors_or_rendered(tmp_path, sockdir, case: str, monkeypatch) -> None:
    """``events --since 10^23`` broke the stream (SQLite integers end at 2^63-1);
    ``simulate-preemption --lead-s inf|nan|1e308`` answered 500; a stored event time of
    1e308 crashed ``spotctl events``; a stored event whose data is a JSON array stopped
    the daemon from starting. (A config integer of 5,000 digits: test_config.BAD.)"""
    from daemon.controlnode import store as store_mod
    from daemon.controlnode.store import Store

    monkeypatch.setattr(store_mod, "log", structlog.get_logger("spotvisor.store"))  # uncached: captured
    if case.startswith("event_"):  # what an older daemon, or a hand edit, left in the store
        seeded = Store(tmp_path / "state" / "spotvisord.db").open()
        if case == "event_time":
            seeded.append_event("chaos_injected", "test-1", {"action": "notice"}, at=1e308)
        else:
            for kind in ("job_resumed", "checkpoint_committed", "node_launched"):
                seeded.db.execute("INSERT INTO events(time, kind, node, data) VALUES (?, ?, ?, ?)",
                                  (time.time(), kind, None, "[1, 2]"))
            seeded.db.execute("INSERT INTO events(time, kind, node, data) VALUES (?, ?, ?, ?)",
                              (time.time(), "job_resumed", None, "not json"))
        seeded.close()
    raw = {"pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2}}
    with structlog.testing.capture_logs() as logs:
        async with own_daemon(tmp_path, sockdir, raw) as h:  # it starts, whatever the store holds
            sock = ["--socket", h.socket_path]
            if case == "since":
                for since in (str(10**23), str(2**63), "9" * 5000):
                    rc, out, err = await spotctl(*sock, "events", "--since", since)
                    assert rc == 2 and out == "" and "--since" in one_line(err), err
                for since in (str(10**23), "1e23", "-1", "9" * 5000):
                    status, body = await _control(h, "GET", f"/v1/events?since={since}")
                    assert status == 400 and "since must be an event seq" in body["error"], (since, body)
                rc, out, err = await spotctl(*sock, "events", "--since", str(2**63 - 1))
                assert rc == 0 and out == "", err  # the largest seq: nothing after it
            elif case == "lead_s":
                await h.until(lambda: "test-1" in h.sup.nodes, what="a node")
                for lead in ("inf", "nan", "1e308", "-1", "86401"):
                    rc, out, err = await spotctl(*sock, "simulate-preemption", "test-1", "--lead-s", lead)
                    assert rc == 2 and out == "" and "--lead-s" in one_line(err) and "(0, 86400]" in err, err
                for lead in (float("inf"), float("nan"), 1e308, 10**400, 0):
                    status, body = await _control(h, "POST", "/v1/nodes/test-1/simulate-preemption",
                                                  {"lead_s": lead})
                    assert status == 400, (lead, status, body)
                    assert body["error"] == "lead_s must be a number of seconds in (0, 86400]", body
                assert not h.events("chaos_injected")
            else:
                rc, out, err = await spotctl(*sock, "events", "--kind", "chaos_injected", "--kind", "job_resumed")
                assert rc == 0 and err == "", err
                if case == "event_time":
                    assert out.startswith("<time 1e+308> #1"), out
                else:
                    assert "value=1,2" in out and "value=not json" in out, out
                    assert all(isinstance(e.data, dict) for e in h.sup.store.events())
                rc, out, err = await spotctl(*sock, "status")
                assert rc == 0, err
    if case == "event_data_not_an_object":
        bad = [e for e in logs if e["event"] == "store_event_data_not_an_object"]
        assert sorted(e["seq"] for e in bad) == [1, 2, 3, 4]  # one line per event, however often it is read


# -- the interactive shell, through a pty -------------------------------------------------------
_ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\x07")  # escapes, and the bell of an ambiguous completion


def _make_controlling_tty() -> None:  # in the child, after setsid: the pty becomes its terminal
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # ... and Ctrl-C acts as in a fresh terminal session. A SIGINT ignored by whoever started
    # pytest (a `cmd &` in a non-interactive shell sets SIG_IGN, and exec keeps it) would
    # otherwise reach spotctl ignored: Python then installs no KeyboardInterrupt handler, the
    # ^C is echoed and nothing happens (``restore_signals`` resets only SIGPIPE and SIGXFSZ).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class PtyShell:
    """``spotctl`` (no command) on a real pty: readline, echo and Ctrl-C as in a terminal."""

    def __init__(self, proc: asyncio.subprocess.Process, master: int) -> None:
        self.proc, self.master = proc, master
        self.buf = b""
        self.eof = False
        self._more = asyncio.Event()
        asyncio.get_running_loop().add_reader(master, self._readable)

    @classmethod
    async def start(cls, sock: str, home: Path) -> "PtyShell":
        master, slave = os.openpty()
        env = {**os.environ, "HOME": str(home), "TERM": "dumb", "INPUTRC": "/dev/null", "COLUMNS": "200"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daemon.interfaces.ctl", "--socket", sock, stdin=slave, stdout=slave, stderr=slave,
            cwd=REPO, env=env, start_new_session=True, preexec_fn=_make_controlling_tty)
        os.close(slave)
        return cls(proc, master)

    def _readable(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        if not data:
            self.eof = True
            asyncio.get_running_loop().remove_reader(self.master)
        self.buf += _ANSI.sub(b"", data)
        self._more.set()
        self._more = asyncio.Event()

    async def expect(self, pattern: str, timeout_s: float = 15.0) -> str:
        """Everything up to and including ``pattern`` (a regex); consumed from the buffer."""
        rx = re.compile(pattern.encode(), re.S)
        try:
            async with asyncio.timeout(timeout_s):
                while (m := rx.search(self.buf)) is None:
                    if self.eof:
                        raise AssertionError(f"the shell ended before {pattern!r}: {self.buf!r}")
                    await self._more.wait()
        except TimeoutError:
            raise AssertionError(f"no {pattern!r} within {timeout_s} s; the screen: {self.buf!r}") from None
        text, self.buf = self.buf[: m.end()], self.buf[m.end():]
        return text.decode(errors="replace").replace("\r", "")

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    async def run(self, line: str) -> str:
        """Type ``line`` + Enter; the output up to the next prompt (without the echoed line)."""
        self.send(line + "\r")
        out = await self.expect(r"spotctl> ")
        out = out[: -len("spotctl> ")]
        return out.split(line, 1)[1].lstrip("\n") if line in out else out

    async def close(self) -> int:
        if self.proc.returncode is None:
            self.proc.kill()
        rc = await self.proc.wait()
        if not self.eof:
            asyncio.get_running_loop().remove_reader(self.master)
        os.close(self.master)
        return rc


def json_in(text: str) -> Any:
    return json.loads(text[text.index("{"): text.rindex("}") + 1])


async def test_every_verb_in_the_shell(spot_daemon, monkeypatch, tmp_path) -> None:
    h = spot_daemon
    home = tmp_path / "home"
    home.mkdir()
    async with agent_on_first_node(h, monkeypatch):
        await h.until(lambda: h.sup.agents.node_logs.last_seq("test-1") >= 5, what="log lines shipped")
        sh = await PtyShell.start(h.socket_path, home)
        try:
            assert "spotctl shell" in await sh.expect(r"spotctl> ")
            status = json_in(await sh.run("status --json"))
            assert status["job"]["state"] == "running" and status["nodes"][0]["id"] == "test-1"
            assert "job1" in await sh.run("status")
            assert re.search(r"test-1\s+local", await sh.run("nodes"))
            assert json_in(await sh.run("nodes --json"))["nodes"][0]["state"] == "running"
            events = await sh.run("events --json --kind node_admitted")
            assert json_in(events)["kind"] == "node_admitted"
            assert (await sh.run("tail test-1 -n 2")).split("\n")[:2] == ["trainer line 4", "trainer line 5"]
            assert json_in(await sh.run("tail test-1 -n 1 --json"))["line"] == "trainer line 5"
            assert json_in(await sh.run("cost --json"))["nodes"][0]["id"] == "test-1"
            assert "spot USD so far" in await sh.run("cost")
            assert "checkpoint requested" in await sh.run("checkpoint")
            assert "the pool allows 1..2 nodes" in await sh.run("scale 7")  # an error, and the shell goes on
            assert "target 2 nodes (was 1)" in await sh.run("scale 2")
            assert "works only on the local provider" in await sh.run("simulate-preemption test-1")
            assert "usage: spotctl tail" in await sh.run("help tail")
            assert "unknown command 'frob'" in await sh.run("frob")

            # Ctrl-C ends a follow and returns to the prompt. Wait for the follow's own output
            # (an event line: "#SEQ pool_scaled"), not the echo of the typed line: a Ctrl-C
            # that lands while readline still reads the line is only seen at the next key
            # (CPython's readline checks signals only when its select() is interrupted) and
            # the terminal discards the rest of the line, so no prompt would come back.
            sh.send("events -f --kind pool_scaled\r")
            await sh.expect(r"#\d+\s+pool_scaled")
            sh.send("\x03")
            await sh.expect(r"spotctl> ")
            assert sh.proc.returncode is None

            # tab completion of verbs and node ids (test-2: launched by `scale 2` on a reconcile tick)
            await h.until(lambda: "test-2" in h.sup.nodes, what="the second node launched")
            sh.send("sta\t")
            await sh.expect(r"status ")
            sh.send("\x15")  # Ctrl-U: clear the line
            sh.send("drain te\t")
            await sh.expect(r"drain test-")  # the common prefix of test-1 and test-2
            sh.send("1\r")
            assert "test-1: draining" in await sh.expect(r"spotctl> ")
            assert "pausing" in await sh.run("pause")
            await h.until(lambda: h.events("job_paused"), timeout_s=15, what="job_paused")
            assert "resuming: launching 2 nodes" in await sh.run("resume")
            sh.send("quit\r")
            assert await asyncio.wait_for(sh.proc.wait(), 10) == 0
        finally:
            await sh.close()
    history = (home / ".spotctl_history").read_text().splitlines()
    assert "status --json" in history and "drain test-1" in history and history[-1] == "quit"

    # the history comes back in a new shell (Up arrow = the previous command)
    sh = await PtyShell.start(h.socket_path, home)
    try:
        await sh.expect(r"spotctl> ")
        sh.send("\x10")  # Ctrl-P: the previous command
        await sh.expect(r"quit")
        sh.send("\x15\x04")  # clear, then Ctrl-D leaves
        assert await asyncio.wait_for(sh.proc.wait(), 10) == 0
    finally:
        await sh.close()


def test_no_daemon_one_line_exit_1() -> None:
    import subprocess

    sock = f"{tempfile.gettempdir()}/sv-none-{os.getpid()}/d.sock"
    for verb in (["tail", "n1"], ["cost"], ["scale", "2"], ["pause"], ["resume"], ["simulate-preemption", "n1"]):
        p = subprocess.run([sys.executable, "-m", "daemon.interfaces.ctl", "--socket", sock, *verb], cwd=REPO,
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 1, (verb, p.stderr)
        assert sock in one_line(p.stderr) and p.stdout == ""


def test_events_after_a_demo_has_ended_shows_what_it_recorded(tmp_path: Path) -> None:
    """``make demo`` has ended by the time one asks what it did: with no daemon answering,
    ``spotctl events`` (run where the demo ran, no socket named) prints the newest demo
    run's recorded events, saying so on stderr, filtered as asked; elsewhere, or with a
    socket named, it is the one-line ``cannot reach`` and exit 1."""
    import subprocess

    from daemon.controlnode.store import Store

    for run, kinds in (("demo-20261207-100000", ["pool_started"]),
                       ("demo-20261207-110000", ["pool_started", "interruption_notice", "job_completed"])):
        store = Store(tmp_path / ".spotvisor" / run / "spotvisord.db").open()
        for kind in kinds:
            store.append_event(kind, "demo-2" if kind == "interruption_notice" else None, {"step": 7})
        store.close()

    def ctl(*argv: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "SPOTVISOR_SOCKET"}
        env["PYTHONPATH"] = str(REPO)
        return subprocess.run([sys.executable, "-m", "daemon.interfaces.ctl", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=60)

    p = ctl("events")
    assert p.returncode == 0, p.stderr
    assert "demo-20261207-110000" in one_line(p.stderr) and "no spotvisord answers" in p.stderr
    assert [line.split()[3] for line in p.stdout.splitlines()] == ["pool_started", "interruption_notice",
                                                                    "job_completed"], p.stdout
    p = ctl("events", "--json", "--kind", "interruption_notice", "-f")
    assert p.returncode == 0 and "nothing more to follow" in p.stderr, p.stderr
    [ev] = [json.loads(line) for line in p.stdout.splitlines()]
    assert (ev["seq"], ev["kind"], ev["node"], ev["data"]) == (2, "interruption_notice", "demo-2", {"step": 7})
    p = ctl("events", "--since", "2")
    assert [line.split()[3] for line in p.stdout.splitlines()] == ["job_completed"], p.stdout
    for p in (ctl("events", "--socket", str(tmp_path / "none.sock")), ctl("events", cwd=tmp_path / ".spotvisor")):
        assert p.returncode == 1 and "cannot reach spotvisord" in one_line(p.stderr) and p.stdout == "", p.stderr
    # tail, cost and status need the daemon; after the run they say where its logs, cost and figures are
    p = ctl("tail", "demo-2")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "cannot reach spotvisord" in p.stderr and ".spotvisor/demo-20261207-110000/nodes/<node>/trainer.log" in p.stderr
    p = ctl("cost")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "spot_cost_usd" in p.stderr, p.stderr
    p = ctl("status")  # the first thing one types after `make demo`
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "demo-summary.json" in p.stderr and "spotctl events" in p.stderr, p.stderr
    # a demo of one's own config (`spotvisord demo --config mine.yaml`) records under its state_dir
    store = Store(tmp_path / ".spotvisor-mine" / "demo-20261207-120000" / "spotvisord.db").open()
    store.append_event("job_completed", None, {"step": 60})
    store.close()
    (tmp_path / "mine.yaml").write_text("daemon: {state_dir: .spotvisor-mine}\n")
    p = ctl("--config", "mine.yaml", "events")
    assert p.returncode == 0 and ".spotvisor-mine/demo-20261207-120000" in one_line(p.stderr), p.stderr
    assert [line.split()[3] for line in p.stdout.splitlines()] == ["job_completed"], p.stdout


def test_the_shell_prompt_needs_no_http_client() -> None:
    """The shell's prompt (and ``-h``, and a usage error) loads no aiohttp, pydantic or torch: the
    HTTP client was about two thirds of spotctl's start-up, and the shell needs it only for a verb."""
    import subprocess

    code = ("import sys; from pathlib import Path; from daemon.interfaces.ctl import SpotShell; SpotShell(Path('/none'))\n"
            "print(sorted(m for m in ('aiohttp', 'pydantic', 'structlog', 'torch') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_status_shows_a_migration_in_flight_and_the_counts() -> None:
    from daemon.interfaces.ctl import render_status

    status = {
        "job": {"id": "j", "state": "running", "step": 40, "target_steps": 100, "world_size": 2, "restarts": 0,
                "resizes_in_process": 4},
        "pool": {"name": "p", "target_nodes": 3, "min_nodes": 1, "max_nodes": 3},
        "nodes": [{"id": "p-1", "domain": "aws-use1", "provider": "aws", "zone": "us-east-1a",
                   "instance_type": "g5", "gpus": 4, "state": "running"}],
        "placement": {"domain": "aws-use1", "migrations": 1, "migrations_failed": 0,
                      "migration": {"from": "aws-use1", "to": "aliyun-hz", "phase": "booting", "reason": "capacity"}},
    }
    head, row, pool = render_status(status, now=0.0).splitlines()[:3]
    assert pool.endswith("domain aws-use1 (1 migrations, 0 failed)  migrating aws-use1 -> aliyun-hz "
                         "(booting, capacity)"), pool
    # 0 worker-group restarts, and the in-process resizes said as such (a user read "0+4" as a puzzle)
    assert dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", row)))["RESTARTS"] == "0 (+4 in-process)"


def test_the_pool_line_shows_the_deadline_and_the_expected_finish() -> None:
    from daemon.interfaces.ctl import _placement

    now = time.time()
    line = _placement({"domain": "aws-use1", "deadline": {
        "deadline": now + 10 * 3600, "hours_to_deadline": 10.0, "hours_of_work_left": 12.5,
        "expected_finish": now + 12.5 * 3600, "slack_h": -2.5, "markets": ["on_demand"]}})
    assert "deadline in 10 h, 12.5 h of work left, expected to finish" in line
    assert "(-2.5 h LATE), buying on_demand" in line
    ok = _placement({"domain": "d", "deadline": {"deadline": now, "hours_to_deadline": 5, "hours_of_work_left": 1,
                                                 "expected_finish": now + 3600, "slack_h": 4, "markets": None,
                                                 "policy": "home_zone"}})
    assert ok.endswith("(4 h to spare), buying any (home_zone)"), ok  # which policy spends it


def test_an_exit_by_signal_reads_as_the_signal() -> None:
    """A trainer the agent stopped after its notice's commit exits -15: the event line names
    SIGTERM, so it does not read as a crash; a plain exit status stays as it is."""
    from daemon.interfaces.ctl_render import render_event

    stopped = render_event({"seq": 9, "time": 0.0, "kind": "trainer_exited", "node": "demo-2",
                            "data": {"exit_code": -15}})
    assert "exit_code=-15 (SIGTERM)" in stopped, stopped
    failed = render_event({"seq": 10, "time": 0.0, "kind": "trainer_exited", "node": "demo-2",
                           "data": {"exit_code": 1}})
    assert "exit_code=1" in failed and "(" not in failed.split("exit_code=")[1], failed
