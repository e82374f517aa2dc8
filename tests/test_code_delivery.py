"""Code delivery through the real daemon (Supervisor + ApiServer, the RecordingProvider):
job.workdir pinned per daemon run, nodes ``preparing`` until their agent says, a failed
setup replacing the node, and job.setup_max_failures failures stopping the buying.

Agents are simulated by their reports where the agent is not the point, and real
(``NodeAgent`` with a fake IMDS) where it is. No sleeps: every wait is a condition
re-checked on each event (``DaemonHarness.until``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from conftest import DaemonHarness, ManualClock, RecordingProvider, started_daemon
from daemon.config import Config
from daemon.controlnode.store import Store
from daemon.gpunode.agent import NodeAgent
from daemon.gpunode.metadata.aws import AwsImds
from daemon.providers.local_metadata.aws import FakeImds
from daemon.interfaces.ctl_render import render_status
from daemon.model import JobState, NodeState
from trainers import TRAINERS

# the job's code: a trainer stand-in that exists only in job.workdir (run as -m standin_job),
# saying where it runs and whether the setup's marker was there before it started
STANDIN = (TRAINERS / "workdir_standin.py").read_text()


def _workdir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "standin_job.py").write_text(STANDIN)
    return root


def _config(tmp_path: Path, sockdir: Path, **job: Any) -> Config:
    return Config.model_validate({
        "pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_job", "target_steps": 1_000_000,
                "checkpoint_uri": f"file://{tmp_path}/ckpt", **job},
        "agent": {"heartbeat_interval_s": 0.05},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": str(sockdir / "d.sock"),
                   "reconcile_interval_s": 0.05},
    })


@contextlib.asynccontextmanager
async def daemon(config: Config, tmp_path: Path, sockdir: Path,
                 provider: RecordingProvider | None = None) -> AsyncIterator[DaemonHarness]:
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = provider or RecordingProvider()
    try:
        async with started_daemon(config, provider, store, str(sockdir / "d.sock")) as (sup, api):
            yield DaemonHarness(sup, api, provider, config, str(sockdir / "d.sock"), tmp_path)
    finally:
        store.close()


def launching(h: DaemonHarness) -> list:
    return [n for n in h.sup.nodes.values() if n.state is NodeState.LAUNCHING]


async def register(h: DaemonHarness, n) -> dict[str, Any]:
    """The node's (simulated) agent registers: the job spec it is handed."""
    return h.sup.agents.on_register(n, prewarm=True)["job"]


def failed_setup(sha: str, code: int = 3, line: str = "ERROR: no matching distribution for torch==9") -> dict:
    return {"kind": "setup_failed", "stage": "setup", "exit_code": code, "last_line": line, "sha256": sha}


async def test_a_preparing_node_is_never_admitted_and_is_ready_with_its_code_version(tmp_path, sockdir) -> None:
    config = _config(tmp_path, sockdir, workdir=str(_workdir(tmp_path / "wd")), setup=["touch setup-marker"])
    async with daemon(config, tmp_path, sockdir) as h:
        (published,) = h.events("code_published")
        sha = published.data["code_version"]
        assert published.data["uris"] == [f"file://{tmp_path}/ckpt/code/{sha}.tar.gz"]
        assert (tmp_path / "ckpt" / "code" / f"{sha}.tar.gz").is_file()
        await h.until(lambda: launching(h), what="a launch")
        (n1,) = launching(h)
        spec = await register(h, n1)
        assert spec["workdir"] == {"uri": f"file://{tmp_path}/ckpt/code/{sha}.tar.gz", "sha256": sha,
                                   "bytes": published.data["bytes"]}
        assert spec["setup"] == {"commands": ["touch setup-marker"], "timeout_s": 1800.0}
        assert n1.state is NodeState.PREPARING and n1.code_version == sha
        for _ in range(3):  # passes of the loop: a preparing node is not admitted, nor replaced
            await h.sup.reconcile_once()
        assert n1.state is NodeState.PREPARING and h.sup.job.state is JobState.PENDING
        assert not h.events("node_ready") and len(h.sup.nodes) == 1
        h.sup.intake.on_reports(n1, [{"kind": "code_ready", "sha256": sha, "setup_s": 1.5, "trainer": "warming"}])
        (ready,) = h.events("node_ready")
        assert ready.node == n1.id and ready.data["code_version"] == sha and ready.data["setup_s"] == 1.5
        await h.until(lambda: n1.state is NodeState.RUNNING, what="the prepared node admitted")
        status = h.sup.status()
        assert status["code"]["version"] == sha and status["nodes"][0]["code_version"] == sha
        shown = render_status(status)
        assert f"code {sha[:12]}" in shown
        header, row = shown.splitlines()[-2:]
        assert header.split()[-1] == "CODE" and row.split()[-1] == sha[:12]


async def test_setup_failures_replace_nodes_then_stop_the_buying_with_one_line(tmp_path, sockdir) -> None:
    config = _config(tmp_path, sockdir, workdir=str(_workdir(tmp_path / "wd")), setup="pip install -r req.txt",
                     setup_max_failures=2)
    async with daemon(config, tmp_path, sockdir) as h:
        sha = h.events("code_published")[0].data["code_version"]
        await h.until(lambda: launching(h), what="a launch")
        (n1,) = launching(h)
        await register(h, n1)
        h.sup.agents.node_logs.mask(["index-token-0123456789"])  # a job secret the agent did not mask
        h.sup.intake.on_reports(n1, [failed_setup(sha, 3, "ERROR: no matching distribution for torch==9 "
                                                          "at https://u:index-token-0123456789@pypi.example")])
        (ev,) = h.events("node_setup_failed")
        assert (ev.node, ev.data["stage"], ev.data["exit_code"], ev.data["code_version"]) == (n1.id, "setup", 3, sha)
        assert ev.data["last_line"] == "ERROR: no matching distribution for torch==9 at https://u:***@pypi.example"
        await h.until(lambda: n1.state is NodeState.FAILED and launching(h), what="n1 failed, a replacement")
        assert n1.instance_id in h.provider.terminated
        (n2,) = launching(h)
        await register(h, n2)
        h.sup.intake.on_reports(n2, [failed_setup(sha, 127, "bash: pip: command not found")])
        await h.until(lambda: h.events("setup_halted") and n2.state is NodeState.FAILED, what="the halt")
        (halt,) = h.events("setup_halted")
        line = ("job.setup failed on 2 nodes in a row (last: test-2, setup exit 127: bash: pip: command not found); "
                "no more nodes are bought: fix job.setup / job.workdir, then restart spotvisord")
        assert halt.data == {"failures": 2, "message": line}
        for _ in range(3):
            await h.sup.reconcile_once()
        assert len(h.sup.nodes) == 2 and len(h.provider.launched) == 2  # nothing more is bought
        status = h.sup.status()
        assert status["code"]["halted"] == line
        assert f"NOT BUYING: {line}" in render_status(status)
        h.sup.intake.on_reports(n2, [failed_setup(sha)])  # a repeated report counts once (and n2 is gone)
        assert len(h.events("node_setup_failed")) == 2


async def test_the_version_is_pinned_per_daemon_run(tmp_path, sockdir) -> None:
    """An edit while the daemon runs reaches no node (a replacement gets the first version);
    after a daemon restart, the next node gets the new one, and a node still alive keeps its own."""
    wd = _workdir(tmp_path / "wd")
    config = _config(tmp_path, sockdir, workdir=str(wd), setup_max_failures=10)
    provider = RecordingProvider()
    async with daemon(config, tmp_path, sockdir, provider) as h:
        v1 = h.events("code_published")[0].data["code_version"]
        await h.until(lambda: launching(h), what="a launch")
        (n1,) = launching(h)
        assert (await register(h, n1))["workdir"]["sha256"] == v1
        v2 = STANDIN.replace('VERSION = "v1"', 'VERSION = "v2"')
        assert v2 != STANDIN
        (wd / "standin_job.py").write_text(v2)  # the user edits
        h.sup.intake.on_reports(n1, [failed_setup(v1)])
        await h.until(lambda: launching(h), what="n1's replacement")
        (n2,) = launching(h)
        assert (await register(h, n2))["workdir"]["sha256"] == v1  # still the run's pin
        assert len(list((tmp_path / "ckpt" / "code").iterdir())) == 1
    async with daemon(config, tmp_path, sockdir, provider) as h:  # spotvisord restarted
        (published,) = [e for e in h.events("code_published") if e.data["code_version"] != v1]
        v2 = published.data["code_version"]
        n2 = h.sup.nodes["test-2"]
        assert n2.code_version == v1 and n2.state is NodeState.PREPARING  # alive: keeps the version it has
        assert {n["id"]: n["code_version"] for n in h.sup.status()["nodes"]}["test-2"] == v1
        h.sup.intake.on_reports(n2, [failed_setup(v1)])
        await h.until(lambda: launching(h), what="n2's replacement")
        (n3,) = launching(h)
        assert (await register(h, n3))["workdir"]["sha256"] == v2 and n3.code_version == v2
        assert sorted(p.name for p in (tmp_path / "ckpt" / "code").iterdir()) == sorted(
            [f"{v1}.tar.gz", f"{v2}.tar.gz"])


# -- with a real agent ---------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def real_agent(h: DaemonHarness, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NodeAgent]:
    """The first node's real agent; the job's command is the stand-in (``python -m
    standin_job``, found only in the unpacked workdir), with the daemon's workdir and setup."""
    real = h.sup.job_spec
    monkeypatch.setattr(h.sup, "job_spec", lambda node: {**real(node), "argv": ["-m", "standin_job"]})
    await h.until(lambda: launching(h), what="a launch")
    (node,) = launching(h)
    clock = ManualClock()
    async with FakeImds(instance_id="i-0001", clock=clock) as imds:
        agent = NodeAgent(daemon_url=h.api.agent_url, token=node.token, node_id=node.id,
                          metadata=AwsImds(imds.url, clock=clock), workdir=h.tmp_path / "node",
                          poll_interval_s=0.05, heartbeat_interval_s=0.05)
        task = asyncio.create_task(agent.run(), name="test-agent")
        try:
            yield agent
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)


async def test_a_real_agent_runs_setup_then_the_trainer_in_the_unpacked_workdir(tmp_path, sockdir,
                                                                                monkeypatch) -> None:
    config = _config(tmp_path, sockdir, workdir=str(_workdir(tmp_path / "wd")),
                     setup=["echo setting up; touch setup-marker"])
    async with daemon(config, tmp_path, sockdir) as h:
        sha = h.events("code_published")[0].data["code_version"]
        async with real_agent(h, monkeypatch) as agent:
            ran = agent.workdir / "ran.json"
            await h.until(lambda: ran.exists() and ran.read_text(), what="the trainer started")
            said = json.loads(ran.read_text())
            code = agent.workdir / "code" / sha
            assert said == {"cwd": str(code), "version": "v1", "marker": True}  # after the setup, in the workdir
            (ready,) = h.events("node_ready")
            assert ready.data["code_version"] == sha and ready.data["setup_s"] >= 0
            await h.until(lambda: any("setting up" in ln.line for ln in h.sup.agents.node_logs.tail(ready.node, 50)),
                          what="the setup's output in spotctl tail")


async def test_a_real_agent_whose_setup_fails_never_starts_the_trainer(tmp_path, sockdir, monkeypatch) -> None:
    config = _config(tmp_path, sockdir, workdir=str(_workdir(tmp_path / "wd")),
                     setup=["echo 'fetching weights'; echo 'HTTP 403: token rejected' >&2; exit 4"])
    async with daemon(config, tmp_path, sockdir) as h:
        async with real_agent(h, monkeypatch) as agent:
            await h.until(lambda: h.events("node_setup_failed"), what="the failure reported")
            (ev,) = h.events("node_setup_failed")
            assert (ev.data["stage"], ev.data["exit_code"], ev.data["last_line"]) == (
                "setup", 4, "HTTP 403: token rejected")
            logged = [ln.line for ln in h.sup.agents.node_logs.tail(ev.node, 50)]
            assert any("fetching weights" in t for t in logged), logged  # shipped before the node went
            await h.until(lambda: h.sup.nodes[ev.node].state is NodeState.FAILED, what="the node failed")
            assert agent.runner.proc is None and not (agent.workdir / "ran.json").exists()


async def test_a_tampered_archive_fails_the_node_closed(tmp_path, sockdir, monkeypatch) -> None:
    config = _config(tmp_path, sockdir, workdir=str(_workdir(tmp_path / "wd")), setup=["touch setup-marker"])
    async with daemon(config, tmp_path, sockdir) as h:
        sha = h.events("code_published")[0].data["code_version"]
        stored = tmp_path / "ckpt" / "code" / f"{sha}.tar.gz"
        data = bytearray(stored.read_bytes())
        data[-20] ^= 0xFF  # one byte changed in the store: same size
        stored.write_bytes(bytes(data))
        async with real_agent(h, monkeypatch) as agent:
            await h.until(lambda: h.events("node_setup_failed"), what="the failure reported")
            (ev,) = h.events("node_setup_failed")
            assert ev.data["stage"] == "verify" and f"is not the pinned {sha}" in ev.data["last_line"]
            assert not (agent.workdir / "code" / sha).exists() and agent.runner.proc is None
    shutil.rmtree(tmp_path / "node", ignore_errors=True)


async def test_a_setup_without_a_workdir_runs_in_the_agents_directory(tmp_path, sockdir, monkeypatch) -> None:
    _workdir(tmp_path / "node")  # the stand-in, where the agent's trainer runs by default (its cwd is this test's)
    monkeypatch.chdir(tmp_path / "node")
    config = _config(tmp_path, sockdir, setup=["pwd > where; touch setup-marker"])
    async with daemon(config, tmp_path, sockdir) as h:
        assert not h.events("code_published")
        async with real_agent(h, monkeypatch) as agent:
            ran = agent.workdir / "ran.json"
            await h.until(lambda: ran.exists() and ran.read_text(), what="the trainer started")
            assert (agent.workdir / "where").read_text().strip() == str(agent.workdir)
            (ready,) = h.events("node_ready")
            assert ready.data["code_version"] is None and ready.data["setup_s"] >= 0
