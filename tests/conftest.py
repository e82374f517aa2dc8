"""Shared fixtures."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# built agent wheels (daemon.providers.agent_wheel.cache_dir): one cache for the whole run,
# its xdist workers and every daemon they start (a build is 4-30 s at each daemon's first
# launch otherwise), kept out of the user's ~/.cache; keyed by the source's digest
os.environ.setdefault("SPOTVISOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"spotvisor-tests-{os.getuid()}"))

# the node agents' zygotes (daemon/gpunode/zygote.py) import the reference trainer before
# their workers fork: the tests' own trainers (e2e.paced_trainer, ...) wrap trainer.run,
# which a zygote imports by itself only for a job whose module is trainer.* (a user sets
# the same variable in job.env for their own script's imports)
os.environ.setdefault("SPOTVISOR_ZYGOTE_PRELOAD", "trainer.run")

_AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (random port) for the session; yields its endpoint URL.

    Dummy AWS credentials and region us-east-1 are set in the environment while it runs.
    Create a bucket per test (unique name) to keep tests independent.
    """
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _AWS_TEST_ENV.items():
            mp.setenv(name, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


# -- the whole suite under pytest-xdist (make test: -n 3 --dist loadgroup) ---------------------

SLOW_LANES = ("slow-a", "slow-b")  # the xdist groups the slow tests are split into
#: Each slow test's measured seconds (a run of ``-m slow -n 2 --dist loadgroup --durations=0``
#: on 2 idle cores, or its lanes' lines of the whole suite's run under ``-n 3``, as last taken;
#: refresh with ``python tests/slow_costs.py < that run's output``). Relative weights: the
#: whole suite's run on 2 cores took each 1.3-3 x its idle time.
SLOW_COSTS = json.loads((Path(__file__).with_name("slow_costs.json")).read_text())


def slow_weight(item: pytest.Item) -> float:
    """A slow test's cost in seconds, for balancing the lanes: measured
    (:data:`SLOW_COSTS`), else a guess: a run of the whole daemon (an e2e or chaos demo)
    60 s, a torchrun job of a few ranks 20 s."""
    nodeid = item.nodeid.rsplit("@", 1)[0]
    if nodeid in SLOW_COSTS:
        return float(SLOW_COSTS[nodeid])
    return 60.0 if nodeid.startswith(("tests/e2e/", "tests/chaos/")) else 20.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``slow`` tests (torchrun jobs, demo runs, a flood) form two lanes under
    pytest-xdist's ``--dist loadgroup`` (:data:`SLOW_LANES`): each lane runs one test at a
    time on its own worker, so at most two of them load the cores at once, while the other
    tests go to the remaining workers. The lanes are balanced by cost
    (:func:`slow_weight`), longest first, each to the lane with less so far: the same on
    every worker, whatever the collection order. Without xdist nothing changes.

    The group is what xdist's ``xdist_group`` mark would give, an ``@<group>`` suffix on
    the test's id, which is what its scheduler reads; it is set here because xdist 3.8 sets
    it through ``Item._nodeid``, which pytest 9 no longer reads (its id is ``Item._id``),
    so the mark groups nothing there. The scheduler hands out its largest groups first,
    one per worker: the two lanes start at once on two workers.
    tests/test_suite_schedule.py checks the suffixes."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers under --dist loadgroup
        return
    load = dict.fromkeys(SLOW_LANES, 0.0)
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    for item in sorted(slow, key=lambda i: (-slow_weight(i), i.nodeid)):
        lane = min(SLOW_LANES, key=lambda g: (load[g], g))
        load[lane] += slow_weight(item)
        grouped = f"{item.nodeid}@{lane}"
        if hasattr(item, "_id"):  # pytest >= 9: a structured id
            from _pytest.nodeid import NodeId
            item._id = NodeId.parse(grouped)
        else:
            item._nodeid = grouped


class _ChaosMatrixRows:
    """Gathers the chaos matrix's rows (tests/chaos/conftest.py) from each test's teardown
    report, in this process or, under xdist, in the controller from the workers' reports;
    prints the table at the end."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "teardown":
            self.rows += [value for key, value in report.user_properties if key == "chaos_row"]

    def pytest_terminal_summary(self, terminalreporter: object) -> None:
        if self.rows:
            from chaos.conftest import Row, print_matrix
            print_matrix(terminalreporter, [Row(**row) for row in self.rows])


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_ChaosMatrixRows(), "spotvisor-chaos-matrix")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test that ran ``spotvisord demo`` under its ``tmp_path`` (the e2e and chaos
    cells) gets a report section of what the run did (:func:`e2e.conftest.run_evidence`:
    each node's warnings and errors, every rank's ``started`` lines): CI keeps no run
    directory, and an assertion's message shows only 240 characters of a summary."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(tmp, Path) and any((tmp / "state").glob("demo-*")):
        from e2e.conftest import run_evidence
        try:
            report.sections.append(("spotvisor demo run", run_evidence(tmp)))
        except OSError as exc:  # the evidence is a help, never a second failure
            report.sections.append(("spotvisor demo run", f"not readable: {exc}"))


# -- a real daemon (Supervisor + ApiServer) in the test's event loop -------------------------

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import AsyncIterator, Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from daemon.providers.base import Instance, NodeSpec, Provider  # noqa: E402


class RecordingProvider(Provider):
    """A test provider: ``launch`` records and returns a running instance at once,
    ``describe`` lists launched-and-not-terminated ones, ``spot_price`` is 0.5 USD/h."""

    name = "test"

    def __init__(self) -> None:
        self.launched: list[tuple[NodeSpec, Instance]] = []
        self.terminated: set[str] = set()

    async def launch(self, offer, node: NodeSpec) -> Instance:  # type: ignore[override]
        inst = Instance(id=f"i-{len(self.launched) + 1:04d}", node_id=node.node_id, provider=offer.provider,
                        state="running", zone=offer.zone, instance_type=offer.instance_type,
                        launched_at=time.time())
        self.launched.append((node, inst))
        return inst

    async def terminate(self, instance_id: str) -> None:
        self.terminated.add(instance_id)

    async def describe(self, tag: str) -> list[Instance]:
        return [i for spec, i in self.launched if spec.pool == tag and i.id not in self.terminated]

    async def spot_price(self, offer) -> float | None:  # type: ignore[override]
        return 0.5


# How long a harness waits for a condition by default (seconds). The waits are
# event-driven, so a generous bound costs nothing when things work; what they wait for
# often includes starting a Python process, which on a loaded 2-core CI machine can
# take several seconds (a 5 s bound failed there).
UNTIL_TIMEOUT_S = 30.0


@dataclass
class DaemonHarness:
    sup: "object"  # daemon.controlnode.supervisor.Supervisor
    api: "object"  # daemon.interfaces.api.ApiServer
    provider: RecordingProvider
    config: "object"  # daemon.config.Config
    socket_path: str
    tmp_path: Path

    async def until(self, pred: Callable[[], object], timeout_s: float = UNTIL_TIMEOUT_S, what: str = "") -> None:
        """Wait until ``pred()`` is true: re-checked on every new event, at least every 20 ms."""
        sup = self.sup
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    await sup.wait_for_events(sup.store.last_seq(), timeout_s=0.02)  # type: ignore[attr-defined]
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}") from None

    def events(self, kind: str) -> list:
        return self.sup.store.events(kinds=[kind])  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def started_daemon(config: "object", provider: Provider, store: "object", socket_path: str, *,
                         ssl_context: "object" = None, agent_ca_pem: str | None = None, clock: "object" = None,
                         checked: "object" = None):
    """A Supervisor and its ApiServer on 127.0.0.1 (agent port: a free one), started; both
    closed on exit. Yields ``(sup, api)``. ``clock``: the supervisor's (e.g. a
    :class:`ManualClock`); None: its default. ``checked``: a cloud check run before the
    start (an HA standby's), taken instead of a run at start."""
    from daemon.interfaces.api import ApiServer
    from daemon.controlnode.supervisor import Supervisor

    sup = Supervisor(config, provider=provider, store=store,  # type: ignore[arg-type]
                     **({} if clock is None else {"clock": clock}))
    api = ApiServer(sup, agent_host=config.daemon.agent_host, agent_port=0,  # type: ignore[attr-defined]
                    socket_path=socket_path, ssl_context=ssl_context)
    try:
        await api.start()
        assert api.agent_url is not None
        await sup.start(agent_url=api.agent_url, agent_ca_pem=agent_ca_pem, checked=checked)  # type: ignore[arg-type]
        yield sup, api
    finally:
        await sup.aclose()
        await api.aclose()


@contextlib.asynccontextmanager
async def spot_harness(tmp_path: Path, provider: Provider, *, pool: dict | None = None,
                       rendezvous: dict | None = None, **daemon: object) -> AsyncIterator[DaemonHarness]:
    """Store + ``provider`` + Supervisor + ApiServer, started; pool target 1 (max 2), the
    tests' agents told a 0.05 s heartbeat interval; ``daemon``: more ``daemon`` fields;
    ``pool``, ``rendezvous``: fields of those sections.

    The control socket lives in a short ``/tmp`` directory (unix socket paths are
    limited to ~100 characters).
    """
    from daemon.config import Config
    from daemon.controlnode.store import Store

    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    socket_path = f"{sockdir}/d.sock"
    config = Config.model_validate({
        "pool": {"name": "test", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2, **(pool or {})},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 1_000_000},  # stand-ins step on and on
        **({"rendezvous": rendezvous} if rendezvous else {}),
        "agent": {"heartbeat_interval_s": 0.05},  # the daemon tells the tests' agents this interval
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": socket_path,
                   "reconcile_interval_s": 0.05, **daemon},
    })
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    try:
        async with started_daemon(config, provider, store, socket_path) as (sup, api):
            yield DaemonHarness(sup, api, provider, config, socket_path, tmp_path)  # type: ignore[arg-type]
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
async def spot_daemon(tmp_path: Path) -> AsyncIterator[DaemonHarness]:
    """:func:`spot_harness` with a :class:`RecordingProvider`."""
    async with spot_harness(tmp_path, RecordingProvider()) as h:
        yield h


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for unix sockets (paths are limited to ~100 characters)."""
    d = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store(tmp_path: Path) -> Iterator["object"]:
    """An open daemon store (``daemon.controlnode.store.Store``) in ``tmp_path``, closed after the test."""
    from daemon.controlnode.store import Store

    s = Store(tmp_path / "spotvisord.db").open()
    try:
        yield s
    finally:
        s.close()


class ManualClock:
    """A monotonic clock a test moves by hand (shared by FakeImds and AwsImds)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def new_bucket(endpoint: str, prefix: str) -> str:
    """A new, empty bucket ``<prefix>-<12 hex digits>`` on the S3 server at ``endpoint``
    (``s3_server``: moto's); its name."""
    import uuid

    import boto3

    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def ec2_server(s3_server: str) -> str:
    """A moto server for EC2 on 127.0.0.1; yields its endpoint URL.

    moto serves every service on one endpoint (and its state is per process), so this
    is the ``s3_server`` endpoint; dummy credentials and us-east-1 are set while it runs.
    Tag instances with a unique pool per test to keep tests independent.

    moto builds a region's EC2 state on its first request there (seconds); that is
    done here, once, so tests can use sub-second client timeouts.
    """
    import boto3

    for region in ("us-east-1", "us-west-2"):
        boto3.client("ec2", region_name=region, endpoint_url=s3_server).describe_instances()
    return s3_server


# -- a local OSS endpoint (tests/fakes/oss.py) ------------------------------------------------

_OSS_TEST_ENV = {"OSS_ACCESS_KEY_ID": "spotvisor-test-ak", "OSS_ACCESS_KEY_SECRET": "spotvisor-test-sk"}


@pytest.fixture
def faults(ec2_server: str):
    """The EC2 endpoint behind ``fakes.aws_faults.AwsFaultProxy`` (faults injected per test)."""
    from fakes.aws_faults import AwsFaultProxy

    proxy = AwsFaultProxy(ec2_server)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="session")
def oss_server() -> Iterator[object]:
    """A fake OSS endpoint (``fakes.oss.FakeOss``) on 127.0.0.1 (random port) for the session;
    yields the FakeOss (its URL is ``.endpoint``). It verifies V4 signatures scoped to region
    ``cn-hangzhou`` made with the key pair it sets in ``$OSS_ACCESS_KEY_ID`` /
    ``$OSS_ACCESS_KEY_SECRET`` while it runs.

    Create a bucket per test (``create_bucket``, unique name) to keep tests independent,
    and ``reset_faults()`` after arming faults.
    """
    from fakes.oss import FakeOss

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _OSS_TEST_ENV.items():
            mp.setenv(name, value)
        with FakeOss(access_key_id=_OSS_TEST_ENV["OSS_ACCESS_KEY_ID"],
                     access_key_secret=_OSS_TEST_ENV["OSS_ACCESS_KEY_SECRET"], region="cn-hangzhou") as fake:
            yield fake


REPO = Path(__file__).resolve().parents[1]


async def spotctl(*args: str, timeout_s: float = 20.0) -> tuple[int, str, str]:
    """Run ``spotctl ARGS`` (``python -m daemon.interfaces.ctl``) from the repository root; (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.interfaces.ctl", *args, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture(scope="session", autouse=True)
def _worker_zygote_ended() -> Iterator[None]:
    """The resize tests' zygote (tests/worker_procs.py), if this process started one, ends with the session."""
    yield
    if "worker_procs" in sys.modules:
        sys.modules["worker_procs"].stop_worker_zygote()


@pytest.fixture
def rdzv():
    """The job's rendezvous store, as the control node runs it (a TCPStore on 127.0.0.1)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


@pytest.fixture(scope="module")
def rendezvous() -> Iterator[int]:
    """The c10d store, as ``spotvisord rendezvous`` runs it beside the daemon; its port.
    Each test's job has a run id of its own (the daemon's nonce), so a module's tests share it."""

    from bench.ports import free_port
    from daemon.controlnode.rendezvous import wait_until_listening

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.controlnode.rendezvous", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until_listening("127.0.0.1", port, 30.0), "the rendezvous store did not start"
        yield port
    finally:
        proc.kill()
        proc.wait()


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc`` and reap it; SIGKILL it if it has not exited within ``timeout_s``."""

    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def agent_running(agent: "object", name: str = "test-agent") -> AsyncIterator[asyncio.Task]:
    """``agent.run()`` (a :class:`daemon.gpunode.agent.NodeAgent`'s) as a task while the block
    runs; on exit it must still be running, and is cancelled and awaited (10 s at most)."""
    task = asyncio.create_task(agent.run(), name=name)  # type: ignore[attr-defined]
    try:
        yield task
        assert not task.done(), f"the agent stopped on its own: {task}"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


def fail_durable(monkeypatch: pytest.MonkeyPatch, store: Any, failures: list[Exception]) -> None:
    """Make ``store``'s :meth:`~daemon.controlnode.store.Store.durable` raise each of
    ``failures`` in turn (etcd out of reach, ``NotLeading``), then behave again: what a
    daemon's answers do while its state is not durable where the next leader reads it."""
    real = type(store).durable

    async def durable(self: Any) -> None:
        if failures:
            raise failures.pop(0)
        await real(self)

    monkeypatch.setattr(type(store), "durable", durable)


@pytest.fixture
async def clients(etcd_cluster: Any) -> Any:
    """``clients()`` makes an :class:`~daemon.ha.client.EtcdClient` on the test's etcd
    cluster (the ``etcd_cluster`` fixture its module imports from tests/etcd_cluster.py);
    all are closed after the test (an open gRPC channel keeps the process from exiting)."""
    from daemon.ha.client import EtcdClient

    made: list[EtcdClient] = []

    def make() -> EtcdClient:
        made.append(EtcdClient(etcd_cluster.endpoints))
        return made[-1]
    yield make
    for c in made:
        await c.close()
