"""spotvisord under systemd (issue 6, item 1): sd_notify readiness, the watchdog, the units.

The daemon talks to a real AF_UNIX datagram socket the test opens, as systemd's
notify socket; the units are checked by the real ``systemd-analyze`` on exactly
what ``make install-systemd`` installs (skipped where ``systemd-analyze`` is missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import RecordingProvider
from daemon.interfaces import cli
from daemon.interfaces.cli import running_daemon
from daemon.config import Config
from daemon.interfaces.service import SdNotifier, dump_tasks, on_usr1_dump_tasks, serve, watchdog_interval_s

ROOT = Path(__file__).resolve().parent.parent
MAX_EXPOSURE = 3.0


def _listen(path: str | bytes) -> socket.socket:
    """The service manager's side: a datagram socket bound at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    return sock


def _fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n") if line)


# -- the notifier and the watchdog interval --------------------------------------------------

def test_without_notify_socket_the_notifier_is_a_no_op() -> None:
    n = SdNotifier.from_env({})
    assert not n.enabled
    assert n.ready("up") is False and n.send(WATCHDOG=1) is False
    n.close()


def test_the_notifier_reaches_an_abstract_socket() -> None:
    name = f"spotvisor-test-{uuid.uuid4().hex}"
    with _listen(b"\0" + name.encode()) as sock:
        sock.settimeout(5)
        n = SdNotifier.from_env({"NOTIFY_SOCKET": f"@{name}"})
        assert n.ready("pool p: up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=pool p: up"
        n.close()
        n.close()  # idempotent


def test_a_notify_socket_nobody_listens_on_is_logged_not_raised(sockdir: Path) -> None:
    n = SdNotifier(str(sockdir / "gone"))
    assert n.enabled and n.send(WATCHDOG=1) is False
    n.close()


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "4242"}, 0.5),  # ours
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "4243"}, None),  # another process's watchdog
])
def test_the_ping_interval_is_half_of_watchdog_usec(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(env, pid=4242) == expected


def test_a_bad_watchdog_usec_is_one_line_and_exit_2(tmp_path: Path, sockdir: Path, monkeypatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30s")
    assert cli.main(["run", "--config", str(_config_file(tmp_path, sockdir))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["spotvisord run: WATCHDOG_USEC='30s' is not a positive number of microseconds"]


# -- the real daemon under a notify socket -----------------------------------------------------

def _config_file(tmp_path: Path, sockdir: Path) -> Path:
    """A tiny local pool whose one instance never boots within the test (no agent, no torch)."""
    path = tmp_path / "pool.yaml"
    path.write_text(
        "pool: {name: sd, min_nodes: 1, target_nodes: 1, max_nodes: 1}\n"
        f"daemon: {{state_dir: '{tmp_path / 'state'}', socket: '{sockdir / 'd.sock'}', reconcile_interval_s: 0.2}}\n"
        "providers: {local: {launch_delay_s: 3600}}\n"
        "offers: [{provider: local, zone: local-a}]\n"
    )
    return path


def test_spotvisord_run_notifies_ready_pings_the_watchdog_and_stops_on_sigterm(tmp_path: Path,
                                                                                sockdir: Path) -> None:
    config = _config_file(tmp_path, sockdir)
    with _listen(str(sockdir / "notify")) as sock:
        sock.settimeout(30)  # start-up imports take seconds on a busy machine
        env = {**os.environ, "NOTIFY_SOCKET": str(sockdir / "notify"), "WATCHDOG_USEC": "1000000",
               "PYTHONUNBUFFERED": "1"}
        env.pop("WATCHDOG_PID", None)
        proc = subprocess.Popen([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(config)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            ready = _fields(sock.recv(4096))
            assert ready["READY"] == "1"
            assert ready["STATUS"].startswith("pool sd: job pending"), ready
            assert (sockdir / "d.sock").exists(), "READY=1 before the control socket was up"

            sock.settimeout(5)
            pings = []
            while len(pings) < 4:
                msg = _fields(sock.recv(4096))
                assert "READY" not in msg and "STOPPING" not in msg, msg
                if msg.get("WATCHDOG") == "1":
                    pings.append(time.monotonic())
            gaps = [b - a for a, b in zip(pings, pings[1:])]
            # WatchdogSec=1 s: a ping every 0.5 s; systemd would kill us past 1 s
            assert all(0.2 < g < 1.0 for g in gaps), gaps

            proc.send_signal(signal.SIGTERM)
            while "STOPPING" not in (msg := _fields(sock.recv(4096))):
                assert msg.get("WATCHDOG") == "1", msg  # pings may still arrive until the stop
            assert msg["STOPPING"] == "1" and msg["STATUS"].startswith("stopping (signal)"), msg
            assert proc.wait(30) == 0, proc.stderr.read().decode(errors="replace")[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()


@contextlib.asynccontextmanager
async def _capturing(cm, box: list) -> AsyncIterator[object]:
    async with cm as sup:
        box.append(sup)
        yield sup


async def test_sigusr1_logs_every_task_and_the_await_chain_it_sits_in() -> None:
    """``kill -USR1`` (what ``spotvisord run`` installs): one ``tasks_dumped`` line, each
    task with the frames it waits through, down to the innermost coroutine and the async
    generator it iterates."""
    import structlog

    gate = asyncio.Event()

    async def events():
        await gate.wait()
        yield 1

    async def inner() -> None:
        async for _ in events():
            pass

    async def outer() -> None:
        await inner()

    stuck = asyncio.create_task(outer(), name="stuck")
    await asyncio.sleep(0)
    on_usr1_dump_tasks()
    try:
        with structlog.testing.capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):  # the handler runs on the loop (add_signal_handler): a few turns
                if logs:
                    break
                await asyncio.sleep(0.01)
            dump_tasks()
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
        stuck.cancel()
    assert [e["event"] for e in logs] == ["tasks_dumped", "tasks_dumped"]
    [chain] = [v for k, v in logs[0]["tasks"].items() if k.startswith("stuck#")]
    assert [frame.rsplit(" ", 1)[1] for frame in chain] == ["outer", "inner", "events", "wait"], chain


async def test_a_blocked_event_loop_or_a_dead_reconciler_stops_the_pings(tmp_path: Path, sockdir: Path) -> None:
    """The pings come from the daemon's own loop: while it is blocked (a stuck
    synchronous call) nothing is sent, so systemd's watchdog fires; they resume when
    it runs again. A reconciler that has died withholds them too."""
    interval = 0.1
    config = Config.model_validate({
        "pool": {"name": "wd", "min_nodes": 1, "target_nodes": 1, "max_nodes": 1},
        "daemon": {"state_dir": str(tmp_path / "state"), "socket": str(sockdir / "d.sock"),
                   "reconcile_interval_s": 0.05},
    })
    loop = asyncio.get_running_loop()
    box: list = []
    with _listen(str(sockdir / "notify")) as sock:
        sock.setblocking(False)

        async def next_fields(timeout_s: float = 5.0) -> dict[str, str]:
            async with asyncio.timeout(timeout_s):
                return _fields(await loop.sock_recv(sock, 4096))

        def queued() -> list[dict[str, str]]:
            """Every datagram waiting in the socket, read without yielding to the loop."""
            out = []
            with contextlib.suppress(BlockingIOError):
                while True:
                    out.append(_fields(sock.recv(4096)))
            return out

        daemon = _capturing(running_daemon(config, providers={"local": RecordingProvider()}), box)
        service = asyncio.create_task(serve(daemon, notifier=SdNotifier(str(sockdir / "notify")),
                                            watchdog_interval_s=interval))
        try:
            assert (await next_fields())["READY"] == "1"
            for _ in range(3):
                assert (await next_fields())["WATCHDOG"] == "1"

            queued()
            time.sleep(15 * interval)  # the loop is stuck: a blocking call, on purpose
            assert [m for m in queued() if "WATCHDOG" in m] == [], "pings were sent while the loop was blocked"
            assert (await next_fields(10 * interval))["WATCHDOG"] == "1"  # and resume once it runs

            [sup] = box
            sup._reconciler.cancel()  # the reconciler dies: the daemon is up but useless
            with contextlib.suppress(asyncio.CancelledError):
                await sup._reconciler
            queued()
            with pytest.raises(TimeoutError):
                await next_fields(10 * interval)
            assert not sup.is_healthy()
        finally:
            service.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await service


# -- the units --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def installed_units(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make install-systemd`` staged under a temporary DESTDIR, ExecStart= pointing at
    this venv's commands (systemd-analyze verify wants executables that exist)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dest = tmp_path_factory.mktemp("destdir")
    subprocess.run(["make", "-s", "install-systemd", f"DESTDIR={dest}", f"BINDIR={Path(sys.executable).parent}"],
                   cwd=ROOT, check=True, capture_output=True, timeout=60)
    units = dest / "etc/systemd/system"
    assert sorted(p.name for p in units.iterdir()) == [
        "spotvisor-agent.service", "spotvisor-rendezvous.service", "spotvisord.service"]
    assert (dest / "etc/sysusers.d/spotvisor.conf").exists()
    return units


def test_systemd_analyze_verify_passes(installed_units: Path) -> None:
    r = subprocess.run(["systemd-analyze", "verify", *sorted(map(str, installed_units.glob("*.service")))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_spotvisord_service_exposure_is_at_most_3(installed_units: Path) -> None:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(installed_units / "spotvisord.service")],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for spotvisord\.service: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    print(f"systemd-analyze security spotvisord.service: exposure {m.group(1)}")
    assert float(m.group(1)) <= MAX_EXPOSURE, r.stdout


def test_the_service_unit_says_what_the_daemon_does(installed_units: Path) -> None:
    text = (installed_units / "spotvisord.service").read_text()
    directives = dict(re.findall(r"^(Type|WatchdogSec|Restart|StateDirectory|RuntimeDirectory|"
                                 r"ConfigurationDirectory|User)=(.*)$", text, re.M))
    assert directives == {"Type": "notify", "WatchdogSec": "30", "Restart": "on-failure", "User": "spotvisor",
                          "StateDirectory": "spotvisor", "RuntimeDirectory": "spotvisor",
                          "ConfigurationDirectory": "spotvisor"}


def test_the_service_reads_its_own_secrets_from_an_optional_environment_file(installed_units: Path) -> None:
    """Issue 26: the Slack webhook URL and cloud keys reach the daemon through
    ``EnvironmentFile=`` (optional: "-"), never through the config or a drop-in; the
    config names them by variable (notify[].url_env), which resolve_sinks reads."""
    from daemon.config import SinkSpec
    from daemon.feed.redaction import Redactor
    from daemon.feed.sinks import resolve_sinks

    text = (installed_units / "spotvisord.service").read_text()
    assert re.findall(r"^EnvironmentFile=(.*)$", text, re.M) == ["-/etc/spotvisor/spotvisord.env"]
    assert "0600" in text  # the comment says how to make it
    hook = "https://hooks.slack.com/services/T000/B000/" + "x" * 24
    env_file = "# /etc/spotvisor/spotvisord.env\nSPOTVISOR_SLACK_WEBHOOK_URL=" + hook + "\n"
    environ = dict(line.split("=", 1) for line in env_file.splitlines() if line and not line.startswith("#"))
    (target,) = resolve_sinks([SinkSpec(name="ops", type="slack", url_env="SPOTVISOR_SLACK_WEBHOOK_URL")], environ,
                              redactor=Redactor())
    assert target.url == hook


def test_the_units_raise_the_open_file_limit_the_agent_port_is_sized_from() -> None:
    """Issue 25, item 4: spotvisord's LimitNOFILE leaves the agent port room for a
    10,000-node pool's connections (4 a node) after the reserve; the rendezvous store,
    which every torchrun agent connects to, is past the default 1,024 too."""
    from daemon.control.bounds import CONNECTIONS_PER_NODE, connection_caps

    units = ROOT / "systemd"
    (daemon_limit,) = re.findall(r"^LimitNOFILE=(\d+)$", (units / "spotvisord.service").read_text(), re.M)
    assert connection_caps(int(daemon_limit), max_nodes=10_000).total >= CONNECTIONS_PER_NODE * 10_000
    (rdzv_limit,) = re.findall(r"^LimitNOFILE=(\d+)$", (units / "spotvisor-rendezvous.service").read_text(), re.M)
    assert int(rdzv_limit) >= 9 * 1000  # a 1,000-node pool, 8 workers and an agent a node
