"""The rendezvous store binds exactly where it is told (issue 13, defect 1).

A c10d ``TCPStore`` has no authentication, and torchrun's dynamic rendezvous unpickles
what it reads from it: whoever can reach the port can run code in every node's torchrun
agent. So ``spotvisord rendezvous --host H`` must listen on ``H`` only (c10d's own
server binds the wildcard whatever host it is given), the default is loopback, and
neither the systemd unit nor a shipped cloud config binds a wildcard or public address.

Each test starts the real store as its own process on 127.0.0.1 and probes it from this
machine only: 127.0.0.2 (loopback range, another address) and this machine's own
non-loopback addresses, which the kernel delivers locally.
"""

from __future__ import annotations

import ipaddress
import re
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import yaml
from bench.ports import free_port
from conftest import stop_process

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"rendezvous store listening on (\S+):(\d+)")


def _other_local_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1 (connecting to them stays on the machine)."""
    found = {"127.0.0.2"}
    if shutil.which("ip"):
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
        found |= {m for m in re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out) if m != "127.0.0.1"}
    return sorted(found)


def _refuses(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except OSError:
        return True


class _Store:
    def __init__(self, proc: subprocess.Popen[str], host: str, port: int) -> None:
        self.proc, self.host, self.port = proc, host, port


def _start(argv: list[str], timeout_s: float = 60.0) -> Iterator[_Store]:
    """Start ``argv`` (a rendezvous store), wait for its "listening on H:P" line (it prints it
    once the store accepts connections), yield it, then SIGTERM it."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        line = ""
        while not (m := LISTENING.search(line)):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                pytest.fail(f"no 'listening' line within {timeout_s} s")
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"the store exited {proc.wait()}: {proc.stderr.read()[-2000:]}")
        sel.close()
        yield _Store(proc, m.group(1), int(m.group(2)))
    finally:
        stop_process(proc, 20)
        for f in (proc.stdout, proc.stderr):
            f.close()


@pytest.fixture
def loopback_store() -> Iterator[_Store]:
    """``spotvisord rendezvous --host 127.0.0.1 --port P``, P a free port."""
    port = free_port()
    yield from _start([sys.executable, "-m", "daemon.interfaces.cli", "rendezvous", "--host", "127.0.0.1", "--port", str(port)])


def test_the_store_listens_only_on_the_address_it_is_given(loopback_store: _Store) -> None:
    assert loopback_store.host == "127.0.0.1" and loopback_store.port > 0
    with socket.create_connection(("127.0.0.1", loopback_store.port), timeout=5):
        pass
    others = _other_local_addresses()
    accepted = [a for a in others if not _refuses(a, loopback_store.port)]
    assert accepted == [], f"bound to 127.0.0.1 but accepted connections on {accepted}"


def test_a_c10d_client_uses_the_store_as_torchrun_does(loopback_store: _Store) -> None:
    """torchrun's agents connect as plain TCPStore clients (``--rdzv-conf is_host=false``)."""
    from torch.distributed import TCPStore

    a = TCPStore("127.0.0.1", loopback_store.port, is_master=False, timeout=timedelta(seconds=30))
    b = TCPStore("127.0.0.1", loopback_store.port, is_master=False, timeout=timedelta(seconds=30))
    a.set("torch.rendezvous.test", b"state")
    assert b.get("torch.rendezvous.test") == b"state"
    assert b.add("torch.rendezvous.test.counter", 1) == 1 and a.add("torch.rendezvous.test.counter", 1) == 2
    assert b.compare_set("torch.rendezvous.test", b"state", b"next") == b"next"


def test_the_default_host_is_loopback() -> None:
    # --port 0: the store takes a free port and says which in its line
    for store in _start([sys.executable, "-m", "daemon.interfaces.cli", "rendezvous", "--port", "0"]):
        assert store.port > 0
        assert store.host == "127.0.0.1"
        assert all(_refuses(a, store.port) for a in _other_local_addresses())
    for store in _start([sys.executable, "-m", "daemon.controlnode.rendezvous", "--port", "0"]):
        assert store.host == "127.0.0.1"


@pytest.mark.parametrize("argv", [["--host", ""]])
def test_an_empty_host_is_one_line_and_exit_2(argv: list[str]) -> None:
    """What the unit passes when SPOTVISOR_RDZV_HOST is unset: never read as "every interface"."""
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "rendezvous", *argv, "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--host" in err[0] and "SPOTVISOR_RDZV_HOST" in err[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "0", "[::]"])
def test_a_wildcard_host_is_refused_in_one_line(host: str) -> None:
    """Issue 25, item 10: ``--host 0.0.0.0`` bound every interface with only a warning. It is
    refused before anything listens (exit 2), in one line naming the fix."""
    from daemon.controlnode.rendezvous import listen_socket

    with pytest.raises(ValueError, match="wildcard"):
        listen_socket(host, 0).close()
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "rendezvous", "--host", host, "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"--host {host} is a wildcard" in line and "control node's private address" in line, line


def test_a_taken_port_is_one_line_and_exit_1(loopback_store: _Store) -> None:
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "rendezvous", "--host", "127.0.0.1",
                        "--port", str(loopback_store.port)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{loopback_store.port}" in err[0], r.stderr
    assert err[0].endswith("another process holds the port (ss -ltnp), or give another port")


# -- what ships: the unit and the cloud configs ----------------------------------------------

PRIVATE = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")]


def _is_private(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_loopback or any(ip in net for net in PRIVATE)


def test_the_rendezvous_unit_binds_the_address_the_operator_sets() -> None:
    text = (ROOT / "systemd/spotvisor-rendezvous.service").read_text()
    [exec_start] = re.findall(r"^ExecStart=(.*)$", text, re.M)
    assert "--host ${SPOTVISOR_RDZV_HOST}" in exec_start, exec_start
    assert re.search(r"^EnvironmentFile=/etc/spotvisor/rendezvous\.env$", text, re.M), \
        "the unit must not start without the operator's address file"
    for unit in (ROOT / "systemd").glob("*.service"):
        code = "\n".join(line for line in unit.read_text().splitlines() if not line.startswith("#"))
        assert "0.0.0.0" not in code and "[::]" not in code, unit.name


@pytest.mark.parametrize("name", ["aws.yaml", "aliyun.yaml", "multi-cloud.yaml"])
def test_cloud_configs_bind_a_private_address(name: str) -> None:
    raw = yaml.safe_load((ROOT / "configs" / name).read_text())
    assert _is_private(raw["rendezvous"]["host"]), raw["rendezvous"]
    for domain in raw.get("domains", []):  # every placement domain's own endpoint too
        if "rendezvous" in domain:
            assert _is_private(domain["rendezvous"]["host"]), domain
            assert not domain["rendezvous"].get("allow_public", False)
    # the agent channel carries tokens: a private address, or TLS (a name is never loopback: auto is TLS)
    agent_host = raw["daemon"]["agent_host"]
    assert _is_private(agent_host) or (raw["daemon"].get("agent_tls", "auto") != "off"
                                       and agent_host not in ("0.0.0.0", "::", "")), raw["daemon"]
    assert not raw["rendezvous"].get("allow_public", False)
    text = (ROOT / "configs" / name).read_text()
    assert re.search(r"^#.*security group.*\n(#.*\n)*rendezvous:", text, re.M), \
        f"{name}: the comment above the rendezvous section says who may reach the port"


_ONE_SHOT = """
import sys, time
from daemon.interfaces.cli import rendezvous_process
from daemon.config import Config

config = Config.model_validate({"rendezvous": {"host": "127.0.0.1", "port": int(sys.argv[1])}})
with rendezvous_process(config) as proc:
    print(proc.pid, flush=True)
    time.sleep(600)
"""


def test_a_one_shot_runs_store_ends_with_it_even_on_sigkill() -> None:
    """``spotvisord demo`` starts the store as its own process: SIGKILL the demo and the
    store still ends (its standard input, a pipe only the demo held, ends), not an
    orphan holding the port."""
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", _ONE_SHOT, str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        store_pid = int(parent.stdout.readline())  # printed once the store listens
        assert not _refuses("127.0.0.1", port)
        store = psutil.Process(store_pid)
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs([store], timeout=20)  # it is not our child: psutil waits on it for us
        assert not alive or alive[0].status() == psutil.STATUS_ZOMBIE, "the store outlived the demo that started it"
        assert _refuses("127.0.0.1", port)
    finally:
        parent.kill()


async def test_a_one_shot_runs_stores_start_and_stop_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``spotvisord demo`` starts and stops its stores (a wait of up to 30 s and 10 s each)
    in a thread: its event loop serves signals and the daemon meanwhile. Each patched
    call waits for the loop to run a callback; on the loop itself it never could."""
    import asyncio
    import threading

    from daemon.config import Config
    from daemon.controlnode.rendezvous import StoreProcess
    from daemon.interfaces.cli import rendezvous_stores

    loop = asyncio.get_running_loop()
    served: list[bool] = []

    def while_the_loop_runs(self: StoreProcess, *args: object) -> None:
        ran = threading.Event()
        loop.call_soon_threadsafe(ran.set)
        served.append(ran.wait(timeout=5))

    monkeypatch.setattr(StoreProcess, "start", while_the_loop_runs)
    monkeypatch.setattr(StoreProcess, "stop", while_the_loop_runs)
    config = Config.model_validate({"pool": {"name": "p"}, "job": {"id": "j", "module": "m", "target_steps": 1}})
    async with rendezvous_stores(config) as store:
        assert isinstance(store, StoreProcess)
    assert served == [True, True]
