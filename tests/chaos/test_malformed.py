"""Chaos cells: malformed configs, malformed metadata bodies, malformed agent reports.

- **Configs**: every broken file of ``test_config.BAD`` (and a few more) given to the
  daemon's own entry points (``spotvisord run`` and ``demo``, in-process): exit 2, one
  line per problem naming the file and the field, no traceback, nothing started.
- **Metadata bodies**: a real node agent (:class:`daemon.gpunode.agent.NodeAgent`) whose
  metadata endpoint (each dialect's fake) starts serving an unparsable body in the
  middle of a run: every poll fails with one clear line, the agent keeps polling, the
  daemon gets one ``metadata_unreachable`` alarm (its ``error`` says what is wrong with
  the body) and no notice; the trainer is not disturbed. The endpoint is fixed → the
  agent recovers, and the job runs to completion.
- **Agent reports**: bodies of the wrong shape on the agent API are refused or
  ignored; the daemon keeps serving and records nothing from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chaos.conftest import Matrix, lost_events
from conftest import DaemonHarness, agent_running
from daemon.gpunode.agent import NodeAgent
from daemon.interfaces.cli import main as spotvisord
from daemon.gpunode.metadata.registry import DIALECTS, make_client
from daemon.model import NodeState
from test_agent_dialects import BAD_BODY, started_fake
from test_config import BAD
from trainers import STANDIN

pytestmark = pytest.mark.chaos

# -- configs ------------------------------------------------------------------------------------

MORE_BAD = [
    ("binary_garbage", b"\xff\xfe\x00\x80garbage\xc3\x28\n", ["UTF-8"]),
    ("pool_name_pattern", "pool:\n  name: Bad Name!\n", ["pool.name: "]),
    ("webhook_without_secret", "notify:\n  - {name: ops, type: webhook, url: 'https://x.example/h'}\n",
     ["notify.0: ", "secret_env"]),
    ("sink_env_unset", "notify:\n  - {name: ops, type: slack, url_env: SV_CHAOS_UNSET_URL}\n",
     ["notify.0.url_env: ", "$SV_CHAOS_UNSET_URL is not set"]),
    ("negative_timeout", "daemon:\n  heartbeat_timeout_s: -1\n", ["daemon.heartbeat_timeout_s: "]),
    ("offer_on_unconfigured_provider", "offers:\n  - {provider: aws, region: us-east-1}\n",
     ["offers.0.provider: ", "providers.aws"]),
]


def test_malformed_configs_get_one_clear_line_each_and_start_nothing(tmp_path: Path, capsys, monkeypatch,
                                                                     matrix: Matrix) -> None:
    monkeypatch.delenv("SV_CHAOS_UNSET_URL", raising=False)
    cases = [(name, content, needles) for name, content, needles in BAD] + MORE_BAD
    bad = []
    for name, content, needles in cases:
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        for cmd in (["run", "--config", str(path)], ["demo", "--config", str(path), "--timeout-s", "1"]):
            try:
                code = spotvisord(cmd)
            except BaseException as exc:  # a crash is what this cell looks for
                bad.append(f"{name} {cmd[0]}: raised {exc!r}")
                continue
            out, err = capsys.readouterr()
            lines = err.splitlines()
            if code != 2 or out or "Traceback" in err or len(lines) != 1:
                bad.append(f"{name} {cmd[0]}: exit {code}, stdout {out!r}, stderr {err!r}")
            elif not lines[0].startswith(f"{path}: ") or not all(n in lines[0] for n in needles):
                bad.append(f"{name} {cmd[0]}: unclear line {lines[0]!r} (wanted {needles})")
    matrix.row(f"malformed configs ({len(cases)} files x run/demo)", job_completed=None if not bad else False,
               lost_checkpoints=0, leaked_instances=0, lost_events=0)
    assert not bad, "\n".join(bad)


# -- metadata bodies ----------------------------------------------------------------------------

ALARM_AFTER = 3


@contextlib.asynccontextmanager
async def _agent(h: DaemonHarness, dialect: str, fake: Any, monkeypatch: pytest.MonkeyPatch,
                 finish: Path) -> AsyncIterator[NodeAgent]:
    # the trainer stand-in until finished: steps every 20 ms, commits every 10 steps, and once
    # $STANDIN_FINISH exists commits its final step and completes (exit 0)
    monkeypatch.setattr(h.sup, "job_spec", lambda node: {"argv": [str(STANDIN)],
                                                         "env": {"STANDIN_FINISH": str(finish),
                                                                 "STANDIN_TARGET": str(h.sup.config.job.target_steps)}})
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    node = next(iter(h.sup.nodes.values()))
    kwargs = {"wait_s": 1} if dialect == "gcp" else {}
    agent = NodeAgent(daemon_url=h.api.agent_url, token=node.token, node_id=node.id,
                      metadata=make_client(dialect, fake.url, timeout_s=1.0, **kwargs), workdir=h.tmp_path / "node",
                      poll_interval_s=0.05, heartbeat_interval_s=0.05, metadata_alarm_after=ALARM_AFTER,
                      metadata_max_backoff_s=0.1)
    async with agent_running(agent, "chaos-agent"):
        yield agent


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_malformed_metadata_body_mid_run(spot_daemon: DaemonHarness, dialect: str, monkeypatch,
                                               matrix: Matrix) -> None:
    h = spot_daemon
    finish = h.tmp_path / "finish"
    seen: list = []
    h.sup.subscribe(seen.append)
    async with started_fake(dialect) as fake, _agent(h, dialect, fake, monkeypatch, finish) as agent:
        await h.until(lambda: h.events("job_resumed") and h.events("checkpoint_committed"), timeout_s=10,
                      what="the job running and committing")
        item, body = BAD_BODY[dialect]
        fake.publish_raw(body) if item is None else fake.publish_raw(item, body)  # the fault
        await h.until(lambda: h.events("metadata_unreachable"), timeout_s=10, what="the alarm")
        polls = len(fake.request_log)
        step = h.sup.job.step
        await h.until(lambda: len(fake.request_log) >= polls + 3 and h.sup.job.step > step, timeout_s=10,
                      what="the agent still polling and the trainer still stepping")
        (alarm,) = h.events("metadata_unreachable")
        assert alarm.data["failures"] == ALARM_AFTER and alarm.data["url"] == fake.url
        assert "\n" not in alarm.data["error"] and len(alarm.data["error"]) < 400  # one clear line
        assert not h.events("interruption_notice") and not h.events("trainer_exited")
        node = h.sup.nodes[agent.node_id]
        assert node.state is NodeState.RUNNING and agent.trainer == "running"

        fake.clear()  # the endpoint is fixed
        await h.until(lambda: h.events("metadata_recovered"), timeout_s=10, what="the recovery")
        finish.touch()
        await asyncio.wait_for(h.sup.wait_released(), 10)
        stored = h.sup.store.events()
        commits = [json.loads(x) for x in agent.status_path.read_text().splitlines()]
        committed = {c["step"] for c in commits if c["event"] == "checkpoint_committed"}
    lost = len(committed - {e.data["step"] for e in stored if e.kind == "checkpoint_committed"})
    row = matrix.row(f"malformed metadata body mid-run ({dialect})",
                     job_completed=any(e.kind == "job_completed" for e in stored), lost_checkpoints=lost,
                     leaked_instances=len(h.provider.launched) - len(h.provider.terminated),
                     lost_events=lost_events(stored, seen))
    assert row.clean(), row
    assert len(h.events("metadata_unreachable")) == 1


# -- agent reports ------------------------------------------------------------------------------

async def test_malformed_agent_reports_are_refused_and_the_daemon_keeps_serving(spot_daemon: DaemonHarness,
                                                                                 matrix: Matrix) -> None:
    """What a broken or skewed agent could send: the daemon answers 4xx (or ignores the
    item), never 500 (the real agent would resend a 500'd batch forever), and records
    nothing from it; a well-formed report right after is handled."""
    h = spot_daemon
    await h.until(lambda: h.sup.nodes and next(iter(h.sup.nodes.values())).state is NodeState.LAUNCHING,
                  what="a launch")
    node = next(iter(h.sup.nodes.values()))
    auth = {"Authorization": f"Bearer {node.token}"}
    before = h.sup.store.last_seq()
    bodies: list[tuple[str, Any]] = [
        ("/v1/agent/events", b"{not json"),
        ("/v1/agent/events", [1, 2]),
        ("/v1/agent/events", {"node_id": node.id, "events": "nope"}),
        ("/v1/agent/events", {"node_id": node.id, "events": [1, "x", None, {"kind": 5}]}),
        ("/v1/agent/events", {"node_id": node.id, "events": [{"kind": "interruption_notice", "notice": "garbage"}]}),
        ("/v1/agent/events", {"node_id": node.id, "events": [{"kind": "interruption_notice", "deadline": "soon",
                                                              "notice": {"id": "n-bad", "provider": "aws"}}]}),
        ("/v1/agent/events", {"node_id": node.id, "events": [{"kind": "trainer_status", "line": {"event": "started",
                                                                                                  "step": "x"}}]}),
        ("/v1/agent/events", {"node_id": node.id, "events": [{"kind": "trainer_status",
                                                              "line": {"event": "checkpoint_committed",
                                                                       "step": "nine"}}]}),
        ("/v1/agent/heartbeat", {"node_id": node.id, "step": "x", "trainer": "running", "gpu": "hot", "log": 7}),
        ("/v1/agent/register", {"node_id": ["x"]}),
    ]
    statuses = []
    async with aiohttp.ClientSession(h.api.agent_url, headers=auth) as s:
        for path, body in bodies:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with s.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
                statuses.append((path, body, r.status))
        async with s.post("/v1/agent/register", json={"node_id": node.id}) as r:
            assert r.status == 200
        recorded = [e.kind for e in h.sup.store.events(since=before)]
        good = {"kind": "interruption_notice", "deadline": time.time() + 120, "seen_at": time.time(),
                "notice": {"id": "n-good", "provider": "aws", "action": "terminate"}}
        async with s.post("/v1/agent/events", json={"node_id": node.id, "events": [good]}) as r:
            assert r.status == 200
    await h.until(lambda: h.events("interruption_notice"), what="the good notice handled")
    server_errors = [x for x in statuses if x[2] >= 500]
    notices = [e.data["notice_id"] for e in h.sup.store.events(kinds=["interruption_notice"])]
    # a batch answered 500 is resent by the agent until accepted: every report it sends after is stuck
    matrix.row("malformed agent reports", job_completed=None, lost_checkpoints=0, leaked_instances=0,
               lost_events=lost_events(h.sup.store.events()) + len(server_errors))
    assert not server_errors, server_errors
    assert h.sup.is_healthy()
    # an authenticated request proves the agent alive (node_ready, then the job starts on it);
    # nothing the malformed items claimed (a notice, a commit, a trainer start) is recorded
    assert set(recorded) <= {"node_ready", "node_admitted"}, recorded
    assert notices == ["n-good"]  # what the agent sends after the garbage still gets through
