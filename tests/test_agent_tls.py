"""The agent channel over TLS (daemon/controlnode/tls.py, daemon/interfaces/api.py,
daemon/gpunode/agent.py, daemon.config.DaemonSpec.agent_tls).

Real TLS on 127.0.0.1: the daemon's agent port serves the certificate its own CA
issued (subjectAltName 127.0.0.1), and a real ``NodeAgent`` trusts the CA file it is
given and nothing else. The server side records every request that reaches it, so
"the token was never sent" is checked where it matters.

No sleeps as synchronization: every wait is a condition re-checked on each new event
(``DaemonHarness.until``) or an awaited ``asyncio.Event``, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from cryptography import x509

import daemon.gpunode.agent as agent_mod
import daemon.gpunode.daemon_link as daemon_link
import daemon.interfaces.api as api_mod
from conftest import UNTIL_TIMEOUT_S, DaemonHarness, ManualClock, RecordingProvider, started_daemon
from daemon.config import Config, ConfigError, DaemonSpec, load_config
from daemon.controlnode import tls
from daemon.gpunode.agent import NodeAgent, daemon_ssl_context
from daemon.gpunode.metadata.aws import AwsImds
from daemon.providers.local_metadata.aws import FakeImds
from daemon.model import NodeState
from daemon.providers.base import NodeSpec
from daemon.providers.bootstrap import CA_FILE, render_user_data

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = ["-c", "import time; time.sleep(600)"]  # the trainer: runs until the agent stops it


def _server_cert(tls_dir: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((tls_dir / "agent.pem").read_bytes())


# -- a daemon whose agent port speaks TLS ----------------------------------------------------

class TlsHarness(DaemonHarness):
    tls: tls.AgentTls
    requests: list[tuple[str, str | None]]  # (path, Authorization) of every request that reached the agent port

    @property
    def ca_file(self) -> Path:
        path = self.tmp_path / "daemon-ca.pem"
        path.write_bytes(self.tls.ca_pem)
        return path


@pytest.fixture
async def tls_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TlsHarness]:
    """Store + RecordingProvider + Supervisor + ApiServer with ``daemon.agent_tls: on`` on
    127.0.0.1, wired as ``running_daemon`` wires them (CA made under the state dir)."""
    from daemon.controlnode.store import Store

    requests: list[tuple[str, str | None]] = []
    real_app = api_mod.agent_app

    def recording_agent_app(sup: Any) -> web.Application:
        app = real_app(sup)

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            requests.append((request.path, request.headers.get("Authorization")))
            return await handler(request)

        app.middlewares.insert(0, record)
        return app

    monkeypatch.setattr(api_mod, "agent_app", recording_agent_app)
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    socket_path = f"{sockdir}/d.sock"
    config = Config.model_validate({
        "pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 1_000_000},
        "agent": {"heartbeat_interval_s": 0.05},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": socket_path,
                   "reconcile_interval_s": 0.05, "agent_tls": "on"},
    })
    state = config.daemon.state_path()
    state.mkdir(mode=0o700, parents=True)
    agent_tls = await tls.agent_tls(config.daemon, state)
    assert agent_tls is not None
    store = Store(state / "spotvisord.db").open()
    provider = RecordingProvider()
    try:
        async with started_daemon(config, provider, store, socket_path, ssl_context=agent_tls.context,
                                  agent_ca_pem=agent_tls.ca_pem.decode()) as (sup, api):
            h = TlsHarness(sup, api, provider, config, socket_path, tmp_path)
            h.tls, h.requests = agent_tls, requests
            yield h
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
async def imds() -> AsyncIterator[tuple[FakeImds, ManualClock]]:
    clock = ManualClock()
    async with FakeImds(instance_id="i-0001", clock=clock) as fake:
        yield fake, clock


async def _launched(h: TlsHarness):
    await h.until(lambda: any(n.state is NodeState.LAUNCHING for n in h.sup.nodes.values()), what="a launch")
    return next(iter(h.sup.nodes.values()))


def _agent(h: TlsHarness, node: Any, imds: tuple[FakeImds, ManualClock], ca_file: Path | None,
           name: str = "node") -> NodeAgent:
    fake, clock = imds
    return NodeAgent(daemon_url=h.api.agent_url, token=node.token, node_id=node.id,
                     metadata=AwsImds(fake.url, clock=clock), workdir=h.tmp_path / name,
                     poll_interval_s=0.05, heartbeat_interval_s=0.05, ca_file=ca_file)


async def _stop(task: asyncio.Task[None]) -> None:
    assert not task.done(), f"the agent stopped on its own: {task}"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


class LogTap:
    """Stands in for the agent module's logger: records each call; ``wait(event, n)``
    returns once ``event`` was logged ``n`` times."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    def __getattr__(self, level: str) -> Any:
        def emit(event: str, **kw: Any) -> None:
            self.calls.append((level, event, kw))
            self._changed.set()
        return emit

    def count(self, event: str) -> int:
        return sum(1 for _, e, _ in self.calls if e == event)

    async def wait(self, event: str, n: int) -> None:
        async with asyncio.timeout(UNTIL_TIMEOUT_S):
            while self.count(event) < n:
                self._changed.clear()
                await self._changed.wait()


# -- the agent and the daemon over TLS -------------------------------------------------------

async def test_an_agent_trusting_the_daemons_ca_registers_and_heartbeats(tls_daemon: TlsHarness, imds,
                                                                         monkeypatch) -> None:
    h = tls_daemon
    assert h.api.agent_url.startswith("https://127.0.0.1:")
    node = await _launched(h)
    (spec, _), = h.provider.launched  # what a provider hands the node: the https URL and the CA
    assert spec.daemon_url == h.api.agent_url and spec.ca_cert_pem == h.tls.ca_pem.decode()

    monkeypatch.setattr(h.sup, "job_spec", lambda node: {"argv": SLEEPER, "env": {}})
    beats: list[str] = []
    real = h.sup.agents.on_heartbeat
    monkeypatch.setattr(h.sup.agents, "on_heartbeat", lambda n, body: (beats.append(n.id), real(n, body))[1])
    agent = _agent(h, node, imds, h.ca_file)
    task = asyncio.create_task(agent.run(), name="tls-agent")
    try:
        await h.until(lambda: node.state is not NodeState.LAUNCHING and len(beats) >= 2,
                      what="registered and two heartbeats over TLS")
    finally:
        await _stop(task)
    assert ("/v1/agent/register", f"Bearer {node.token}") in h.requests


async def test_an_agent_trusting_another_ca_never_sends_its_token(tls_daemon: TlsHarness, imds, monkeypatch) -> None:
    h = tls_daemon
    node = await _launched(h)
    other = h.tmp_path / "other"
    _, _, other_ca = tls.ensure_own_ca(other / "tls", "127.0.0.1")  # a CA that also names 127.0.0.1
    assert tls.fingerprint(other_ca) != h.tls.ca_fingerprint

    tap = LogTap()
    monkeypatch.setattr(daemon_link, "log", tap)
    agent = _agent(h, node, imds, other / "tls" / "ca.pem")
    task = asyncio.create_task(agent.run(), name="untrusting-agent")
    try:
        await tap.wait("daemon_certificate_untrusted", 1)
        await h.until(lambda: agent.link.outage.failures >= 3, what="the agent trying again, with backoff")
    finally:
        await _stop(task)
    level, _, kw = next(c for c in tap.calls if c[1] == "daemon_certificate_untrusted")
    assert level == "error" and "certificate verify failed" in kw["error"], kw
    assert tap.count("daemon_certificate_untrusted") == 1, "said once, not at every try"
    assert h.requests == [], "a request reached the daemon through an untrusted channel"
    assert node.state is NodeState.LAUNCHING

    # one request, without the agent's retries: refused in the handshake
    ctx = daemon_ssl_context(other / "tls" / "ca.pem")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.token}"}) as s:
        with pytest.raises(aiohttp.ClientConnectorCertificateError, match="certificate verify failed"):
            await s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": node.id}, ssl=ctx)
        # no CA file: the system's trust store, which does not hold the daemon's own CA
        assert daemon_ssl_context(None) is None
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await s.post(f"{h.api.agent_url}/v1/agent/register", json={"node_id": node.id})
    assert h.requests == []


async def test_the_daemons_name_is_checked(tls_daemon: TlsHarness) -> None:
    """The CA alone is not enough: the certificate must name the address the agent dials."""
    h = tls_daemon
    ctx = daemon_ssl_context(h.ca_file)
    assert ctx is not None and ctx.check_hostname and ctx.verify_mode is ssl.CERT_REQUIRED
    async with aiohttp.ClientSession() as s:
        # the same server, dialled as a name its certificate does not hold
        with pytest.raises(aiohttp.ClientConnectorCertificateError, match="ctl.example"):
            await s.get(f"{h.api.agent_url}/", ssl=ctx, server_hostname="ctl.example")
        async with s.get(f"{h.api.agent_url}/", ssl=ctx, server_hostname="localhost") as r:  # a name it holds
            assert r.status == 404
    assert h.requests == [("/", None)]


async def test_the_local_provider_hands_the_ca_to_its_agents(tmp_path: Path) -> None:
    """``running_daemon`` with the local provider and ``agent_tls: on``: each agent process
    is started with ``--ca-file`` (the daemon's CA, in its work directory) and registers."""
    from daemon.interfaces.cli import running_daemon

    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    raw["pool"].update({"min_nodes": 1, "target_nodes": 1, "max_nodes": 1})
    raw["job"].pop("model", None)
    raw["job"].update({"global_batch_size": 2, "micro_batch_size": 1})
    raw["daemon"] = {"state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock", "agent_tls": "on",
                     "agent_host": "127.0.0.1", "reconcile_interval_s": 0.1, "verify_commits": False}
    raw["providers"]["local"]["launch_delay_s"] = 0.0
    raw["chaos"] = []
    config = Config.model_validate(raw)
    try:
        async with running_daemon(config, with_chaos=False) as sup:
            assert sup.agent_url.startswith("https://127.0.0.1:")
            ca_pem = (tmp_path / "state" / "tls" / "ca.pem").read_text()
            assert sup.agent_ca_pem == ca_pem
            async with asyncio.timeout(60):
                while not any(n.state not in (NodeState.REQUESTED, NodeState.LAUNCHING) for n in sup.nodes.values()):
                    await sup.wait_for_events(sup.store.last_seq(), timeout_s=0.1)
            (node,) = sup.nodes.values()
            assert node.state in (NodeState.READY, NodeState.ADMITTING, NodeState.RUNNING), node  # registered
            assert (tmp_path / "state" / "nodes" / node.id / "daemon-ca.pem").read_text() == ca_pem
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


# -- the CA and the certificate on disk ------------------------------------------------------

def test_first_start_makes_a_ca_and_a_certificate_private_keys_0600(tmp_path: Path) -> None:
    spec = DaemonSpec(agent_host="10.0.0.5")
    assert spec.agent_tls_on()
    ctx, ca_pem = tls.load_agent_tls(spec, tmp_path)
    assert isinstance(ctx, ssl.SSLContext)
    d = tmp_path / "tls"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
    assert modes == {"ca.key": 0o600, "ca.pem": 0o644, "agent.key": 0o600, "agent.pem": 0o644}
    assert (d / "ca.pem").read_bytes() == ca_pem
    cert = _server_cert(d)
    assert tls.names_of(cert) == {"10.0.0.5", "127.0.0.1", "::1", "localhost"}
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)][0] == "10.0.0.5"  # an IP: an iPAddress entry
    ca = x509.load_pem_x509_certificate(ca_pem)
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_restart_reuses_the_ca_and_the_certificate(tmp_path: Path) -> None:
    spec = DaemonSpec(agent_host="10.0.0.5")
    _, ca1 = tls.load_agent_tls(spec, tmp_path)
    cert1 = (tmp_path / "tls" / "agent.pem").read_bytes()
    (tmp_path / "tls" / ".agent.key.x1y2.tmp").write_bytes(b"half a key")  # a write a crash cut short
    _, ca2 = tls.load_agent_tls(spec, tmp_path)
    assert tls.fingerprint(ca2) == tls.fingerprint(ca1)
    assert (tmp_path / "tls" / "agent.pem").read_bytes() == cert1
    assert not list((tmp_path / "tls").glob(".*.tmp"))


def test_a_new_agent_host_gets_a_new_certificate_from_the_same_ca(tmp_path: Path) -> None:
    _, ca1 = tls.load_agent_tls(DaemonSpec(agent_host="10.0.0.5"), tmp_path)
    _, ca2 = tls.load_agent_tls(DaemonSpec(agent_host="ctl.internal"), tmp_path)
    assert ca2 == ca1
    cert = _server_cert(tmp_path / "tls")
    assert tls.covers(cert, "ctl.internal") and not tls.covers(cert, "10.0.0.5")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ctl.internal" in san.get_values_for_type(x509.DNSName)  # a name: a dNSName entry
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca1))


def test_a_certificate_near_expiry_or_damaged_is_issued_again(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    now = dt.datetime.now(dt.timezone.utc)
    _, ca = tls.load_agent_tls(DaemonSpec(agent_host="10.0.0.5"), tmp_path, now=now)
    first = _server_cert(d)
    later = first.not_valid_after_utc - tls.RENEW_BEFORE + dt.timedelta(days=1)  # within the renewal window
    _, ca_later = tls.load_agent_tls(DaemonSpec(agent_host="10.0.0.5"), tmp_path, now=later)
    renewed = _server_cert(d)
    assert ca_later == ca and renewed.serial_number != first.serial_number
    assert renewed.not_valid_after_utc > first.not_valid_after_utc

    (d / "agent.key").write_bytes(b"not a key")
    _, ca_again = tls.load_agent_tls(DaemonSpec(agent_host="10.0.0.5"), tmp_path)
    assert ca_again == ca and _server_cert(d).serial_number != renewed.serial_number
    assert stat.S_IMODE((d / "agent.key").stat().st_mode) == 0o600


def test_the_operators_files_are_used_as_given(tmp_path: Path) -> None:
    ops = tmp_path / "ops"
    cert, key, ca_pem = tls.ensure_own_ca(ops, "10.0.0.5")
    spec = DaemonSpec(agent_host="10.0.0.5", tls_cert_file=str(cert), tls_key_file=str(key),
                      tls_ca_file=str(ops / "ca.pem"))
    state = tmp_path / "state"
    _, got = tls.load_agent_tls(spec, state)
    assert got == ca_pem and not (state / "tls").exists()
    other = spec.model_copy(update={"agent_host": "10.0.0.6"})
    with pytest.raises(tls.TlsError, match="does not name agent_host 10.0.0.6"):
        tls.load_agent_tls(other, state)


# -- the config ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["daemon: {agent_tls: off, agent_host: 10.0.0.5}",  # YAML 1.1: off is false
                                  "daemon: {agent_tls: 'off', agent_host: 10.0.0.5}",
                                  "daemon: {agent_tls: 'off', agent_host: 0.0.0.0}",
                                  "daemon: {agent_tls: 'off', agent_host: ctl.internal}"])
def test_plain_http_beyond_loopback_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    (line,) = err.value.problems
    assert line.startswith("daemon.agent_tls: off would send every node's bearer token in plain HTTP"), line
    assert "daemon.agent_tls: auto or on" in line and "\n" not in line


@pytest.mark.parametrize(("daemon", "on"), [
    ({}, False),  # the local default: 127.0.0.1, plain HTTP as before
    ({"agent_host": "10.0.0.5"}, True),
    ({"agent_host": "0.0.0.0"}, True),
    ({"agent_host": "localhost"}, False),
    ({"agent_host": "::1"}, False),
    ({"agent_tls": "on"}, True),
    ({"agent_tls": True}, True),  # YAML's bare on
    ({"agent_tls": "off"}, False),
    ({"agent_tls": "off", "agent_host": "127.0.0.2"}, False),
])
def test_when_the_agent_port_speaks_tls(daemon: dict[str, Any], on: bool) -> None:
    assert DaemonSpec.model_validate(daemon).agent_tls_on() is on


def test_the_operators_files_come_all_three_or_none(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    path = tmp_path / "c.yaml"
    path.write_text(f"daemon: {{agent_host: 10.0.0.5, tls_cert_file: {pem}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    (line,) = err.value.problems
    assert "tls_key_file, tls_ca_file: required with tls_cert_file" in line, line


def test_check_config_refuses_plain_http_beyond_loopback(tmp_path: Path) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text("daemon: {agent_tls: off, agent_host: 10.0.0.5}\n")
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "check-config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"{path}: daemon.agent_tls: off would send"), line


# -- the node's side: user data and the agent's command line ---------------------------------

def test_the_user_data_writes_the_ca_for_the_agent(tmp_path: Path) -> None:
    _, _, ca_pem = tls.ensure_own_ca(tmp_path / "tls", "10.0.0.5")
    node = NodeSpec(node_id="p-1", pool="p", token="tok123", daemon_url="https://10.0.0.5:7480",
                    ca_cert_pem=ca_pem.decode())
    script = render_user_data(node, dialect="aws")
    assert f"SPOTVISOR_DAEMON_CA_FILE={CA_FILE}" in script
    # run its file-writing part with /etc/spotvisor moved under tmp_path
    etc = tmp_path / "etc"
    body = script.split("command -v spotvisor-agent")[0].replace("/etc/spotvisor", str(etc))
    subprocess.run(["bash", "-c", body], check=True, timeout=30)
    assert (etc / "daemon-ca.pem").read_bytes().strip() == ca_pem.strip()
    assert stat.S_IMODE((etc / "daemon-ca.pem").stat().st_mode) == 0o644
    assert stat.S_IMODE((etc / "agent.env").stat().st_mode) == 0o600
    env = dict(line.split("=", 1) for line in (etc / "agent.env").read_text().splitlines())
    assert env["SPOTVISOR_DAEMON_CA_FILE"] == str(etc / "daemon-ca.pem")  # CA_FILE, moved as the script was
    assert env["SPOTVISOR_DAEMON_URL"] == "https://10.0.0.5:7480"
    assert daemon_ssl_context(etc / "daemon-ca.pem") is not None  # what the agent loads

    # without a CA: the script as before
    plain = render_user_data(NodeSpec(node_id="p-1", pool="p", token="tok123", daemon_url="http://127.0.0.1:1"),
                             dialect="aws")
    assert "CA_FILE" not in plain and 'install -d -m 0700 "$R/etc/spotvisor"' in plain
    with pytest.raises(ValueError, match="ca_cert_pem"):
        render_user_data(NodeSpec(node_id="p-1", pool="p", token="t", daemon_url="https://h:1",
                                  ca_cert_pem="-----BEGIN CERTIFICATE-----\n'; rm -rf /\n-----END CERTIFICATE-----"),
                         dialect="aws")


def test_the_agent_refuses_a_ca_file_it_cannot_use(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    for ca in (str(tmp_path / "missing.pem"), str(bad)):
        r = subprocess.run([sys.executable, "-m", "daemon.gpunode.agent", "run", "--daemon-url", "https://127.0.0.1:9",
                            "--node-id", "n-1", "--workdir", str(tmp_path / "w"), "--ca-file", ca],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "SPOTVISOR_AGENT_TOKEN": "t"})
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        (line,) = r.stderr.splitlines()
        assert line.startswith(f"spotvisor-agent: --ca-file {ca}:"), line


def test_the_agent_reads_its_ca_file_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SPOTVISOR_DAEMON_CA_FILE", CA_FILE)
    args = agent_mod._parse(["run", "--daemon-url", "https://h:1", "--node-id", "n"])
    assert args.ca_file == CA_FILE
    monkeypatch.setenv("SPOTVISOR_DAEMON_CA_FILE", "")
    assert agent_mod._parse(["run", "--daemon-url", "https://h:1", "--node-id", "n"]).ca_file is None



@pytest.mark.parametrize("url", ["http://10.0.0.5:7480", "http://ctl.internal:7480", "http://0.0.0.0:7480",
                                 "ftp://10.0.0.5/", "10.0.0.5:7480"])
def test_the_agent_never_sends_its_token_in_clear_beyond_loopback(tmp_path: Path, url: str) -> None:
    """Issue 25, item 10: told a plain-http daemon URL on another host, the agent sent its
    token in clear. It refuses to start (one line naming the fix, exit 2); https, and
    http to a loopback host, are taken."""
    imds = AwsImds("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="--daemon-url"):
        NodeAgent(daemon_url=url, token="t", node_id="n-1", metadata=imds, workdir=tmp_path)
    for ok in ("https://10.0.0.5:7480", "http://127.0.0.1:7480", "http://localhost:1", "http://[::1]:1"):
        NodeAgent(daemon_url=ok, token="t", node_id="n-1", metadata=imds, workdir=tmp_path)
    r = subprocess.run([sys.executable, "-m", "daemon.gpunode.agent", "run", "--daemon-url", url,
                        "--node-id", "n-1", "--workdir", str(tmp_path / "w")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SPOTVISOR_AGENT_TOKEN": "t"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"spotvisor-agent: --daemon-url {url}") or line.startswith(
        f"spotvisor-agent: --daemon-url {url!r}"), line
    if url.startswith("http://"):
        assert "in clear" in line and "https" in line, line
