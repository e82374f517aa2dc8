"""Where ``/metrics`` listens (``daemon.metrics_host``, ``daemon.metrics_port``): loopback by
default, a private address allowed, anything else refused at config load with one line;
and what a scraper can hold there is bounded (connections per address, a first request
in time), as on the agent port."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import aiohttp
import pytest

from daemon.config import load_config
from daemon.interfaces.listener import METRICS_CAPS
from test_config import _assert_problem_output, check_config, one_problem


@pytest.mark.parametrize("host", ["0.0.0.0", "'::'", "''", "8.8.8.8", "203.0.113.10", "'::ffff:8.8.8.8'",
                                  "100.64.0.1", "prometheus.example.com"])
def test_metrics_on_a_public_address_a_wildcard_or_a_name_is_refused(tmp_path: Path, host: str) -> None:
    problem = one_problem(tmp_path, f"daemon: {{metrics_host: {host}, metrics_port: 9400}}\n")
    assert problem.startswith("daemon.metrics_host: "), problem
    assert "no authentication" in problem and "give 127.0.0.1, or the control node's private address" in problem


@pytest.mark.parametrize("host", ["127.0.0.1", "'::1'", "localhost", "10.0.0.10", "172.16.0.10", "192.168.1.20",
                                  "fd00::10"])
def test_metrics_on_loopback_or_a_private_address_passes(tmp_path: Path, host: str) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(f"daemon: {{metrics_host: {host}, metrics_port: 9400}}\n")
    assert load_config(path).daemon.metrics_host == host.strip("'")


def test_check_config_says_it_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "pub.yaml"
    path.write_text("daemon: {metrics_host: 0.0.0.0, metrics_port: 9400}\n")
    _assert_problem_output(check_config(path), path, [["daemon.metrics_host: 0.0.0.0 is a wildcard address",
                                                       "/metrics has no authentication"]])


async def test_a_scraper_cannot_hold_more_than_its_share(spot_daemon) -> None:
    """Connections from one address past ``METRICS_CAPS.per_peer`` are closed at accept; one
    that sends no request is closed after the first-request timeout; a scrape still works."""
    from daemon.interfaces.api import ApiServer

    h = spot_daemon
    h.sup.config = h.config.model_copy(update={"daemon": h.config.daemon.model_copy(update={"metrics_port": 0})})
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    api = ApiServer(h.sup, agent_host="127.0.0.1", agent_port=0, socket_path=f"{sockdir}/d2.sock",
                    first_request_s=0.5)
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await api.start()
        assert api.metrics_url is not None and api.metrics_listener is not None
        port = int(api.metrics_url.split(":")[2].split("/")[0])
        for _ in range(METRICS_CAPS.per_peer + 3):
            held.append(await asyncio.open_connection("127.0.0.1", port))
        # the over-cap ones are closed at accept: EOF; the first per_peer ones time out (no request)
        async with asyncio.timeout(30):
            for reader, _ in held:
                assert await reader.read() == b""
        assert api.metrics_listener.refused["per_peer"] == 3
        assert api.metrics_listener.timed_out == METRICS_CAPS.per_peer
        assert api.metrics_listener.open == 0
        async with aiohttp.ClientSession() as s, s.get(api.metrics_url) as r:
            assert r.status == 200 and "spotvisor_job_target_steps" in await r.text()
    finally:
        for _, w in held:
            w.close()
        await api.aclose()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_listener_that_cannot_bind_names_its_fields_and_the_fix(tmp_path: Path) -> None:
    """``spotvisord run`` printed ``[Errno 99] Cannot assign requested address`` and nothing
    more for the shipped placeholder agent_host: now the address, the fields and the fix
    (exit 1 still: at boot the address may come a moment later, and the unit retries)."""
    import socket
    import subprocess
    import sys

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [  # 192.0.2.1: TEST-NET-1, assigned to no machine; the taken port: held here
        (f"daemon: {{agent_host: 192.0.2.1, agent_port: 7480, state_dir: {tmp_path / 'a'}}}\n",
         "cannot listen on 192.0.2.1:7480 (daemon.agent_host and agent_port): ", "no interface of this machine"),
        (f"daemon: {{metrics_port: {port}, state_dir: {tmp_path / 'b'}}}\n",
         f"cannot listen on 127.0.0.1:{port} (daemon.metrics_host and metrics_port): ", "another process holds"),
    ]
    try:
        for i, (text, head, fix) in enumerate(cases):
            path = tmp_path / f"c{i}.yaml"
            path.write_text(text)
            r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(path)],
                               cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
            (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("spotvisord run: ")]
            assert r.returncode == 1 and line.startswith("spotvisord run: " + head) and fix in line, r.stderr
            assert "Errno" not in line and "Traceback" not in r.stderr
    finally:
        taken.close()
