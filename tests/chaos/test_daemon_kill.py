"""Chaos cells: the daemon is SIGKILLed mid-launch and mid-checkpoint, then restarted.

The daemon is the real service, ``spotvisord run --config FILE``, in its own process,
killed with a real SIGKILL and started again on the same state directory. Its
provider is AWS (boto3) against moto behind ``fakes.aws_faults.AwsFaultProxy``:
cloud instances outlive the daemon, as they must for a leak or a duplicate to be
possible (the local provider's instances die with the daemon by design).

:class:`Ec2Sim` plays what runs *on* the instances: for every instance moto runs for
the pool it "boots" (after ``boot_s``) a real node agent (:class:`daemon.gpunode.agent.NodeAgent`)
configured from the instance's own user-data (daemon URL, node id, token), with its
own IMDSv2 endpoint (:class:`daemon.providers.local_metadata.aws.FakeImds`); the agent's trainer
is the stand-in (``tests/trainers/standin.py``, training) that trains one step every 50 ms, commits to a shared ledger
(the "object store"), answers notices and completes at its target step. An instance
moto stops listing as live takes its agent down with it.

What is checked, per cell: the job completes; every commit a trainer made has its
``checkpoint_committed`` event; no instance of the pool is alive once the restarted
daemon has released the pool and exited, and no node got two instances; the store's
``seq`` has no gap and every event a ``/v1/events`` follower saw from the killed
daemon is in the final store unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import shutil
import signal
import sqlite3
import sys
import tempfile
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
import yaml

from chaos.conftest import Matrix, lost_events
from daemon.gpunode.agent import NodeAgent
from daemon.gpunode.metadata.aws import AwsImds
from daemon.providers.local_metadata.aws import FakeImds
from daemon.model import Event
from daemon.providers.base import NODE_TAG
from fakes.aws_faults import AwsFaultProxy
from trainers import STANDIN
from bench.ha_harness import instances
from bench.ports import free_port

pytestmark = pytest.mark.chaos

ROOT = Path(__file__).resolve().parents[2]

_LIVE = ("pending", "running")


class _Agent(NodeAgent):
    """The real agent, whose trainer is the stand-in instead of the daemon's torchrun line."""

    def __init__(self, *, trainer_env: dict[str, str], standin: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._trainer_env = trainer_env
        self._standin = standin

    async def _register(self) -> dict[str, Any]:
        await super()._register()
        return {"argv": [str(self._standin)], "env": self._trainer_env}


class Ec2Sim:
    """What runs on the pool's instances in moto (see the module docstring)."""

    def __init__(self, endpoint: str, pool: str, workdir: Path, trainer_env: dict[str, str] | None,
                 boot_s: float = 0.5) -> None:
        """``trainer_env``: the stand-in's environment; None: the agents run the daemon's
        own job spec (real torchrun and the job's trainer)."""
        self.ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name="us-east-1")
        self.pool = pool
        self.workdir = workdir
        self.trainer_env = trainer_env
        self.boot_s = boot_s
        self.standin = STANDIN  # training: STANDIN_LEDGER is in trainer_env
        workdir.mkdir(parents=True, exist_ok=True)
        self.agents: dict[str, tuple[asyncio.Task[None], FakeImds, str]] = {}  # instance → (agent, imds, node)
        #: agents told to end whose end nobody has seen yet (a _down cut short by the watch's cancel)
        self._ending: dict[asyncio.Task[None], FakeImds] = {}
        self._booting: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None

    # -- the cloud's view ------------------------------------------------------------------
    def instances(self, states: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Every instance of the pool moto knows, terminated ones included; only those in
        ``states`` if given (:func:`bench.ha_harness.instances`)."""
        return instances(self.ec2, self.pool, states)

    def live(self) -> list[dict[str, Any]]:
        return self.instances(_LIVE)

    @staticmethod
    def node_of(inst: dict[str, Any]) -> str:
        return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}.get(NODE_TAG, "")

    # -- the instances' side ---------------------------------------------------------------------
    async def __aenter__(self) -> "Ec2Sim":
        self._loop = asyncio.create_task(self._watch(), name="ec2sim")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.cancel()
        for t in [self._loop, *self._tasks]:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for iid in list(self.agents):
            await self._down(iid)
        for task in list(self._ending):  # a _down the watch was in when cancelled: its agent is still ending
            await asyncio.wait({task})
            await self._ended(task)

    async def _watch(self) -> None:
        # the live instances only, 4 times a second: a listing of every instance the pool
        # ever had, 10 times a second, was a third of the test process's CPU (moto's XML
        # serializer), taken from the daemons and trainers it runs beside on 2 cores
        while True:
            live = {inst["InstanceId"] for inst in await asyncio.to_thread(self.live)}
            for iid in sorted(live):
                if iid not in self.agents and iid not in self._booting:
                    self._booting.add(iid)
                    t = asyncio.create_task(self._boot(iid), name=f"boot:{iid}")
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
            for iid in [i for i in self.agents if i not in live]:
                if iid in self.agents:  # not taken down meanwhile
                    await self._down(iid)  # the VM is gone: so is everything on it
            await asyncio.sleep(0.25)

    async def _boot(self, iid: str) -> None:
        await asyncio.sleep(self.boot_s)
        attr = await asyncio.to_thread(self.ec2.describe_instance_attribute, InstanceId=iid, Attribute="userData")
        user_data = base64.b64decode(attr["UserData"]["Value"]).decode()
        env = dict(re.findall(r"^(SPOTVISOR_[A-Z_]+)=(\S+)$", user_data, re.M))  # the agent's env file
        imds = FakeImds(instance_id=iid)
        await imds.start()
        args: dict[str, Any] = dict(
            daemon_url=env["SPOTVISOR_DAEMON_URL"], token=env["SPOTVISOR_AGENT_TOKEN"],
            node_id=env["SPOTVISOR_NODE_ID"], metadata=AwsImds(imds.url, timeout_s=1.0), workdir=self.workdir / iid,
            poll_interval_s=0.1, heartbeat_interval_s=0.2, metadata_max_backoff_s=0.5)
        agent = NodeAgent(**args) if self.trainer_env is None else \
            _Agent(trainer_env=self.trainer_env, standin=self.standin, **args)
        self.agents[iid] = (asyncio.create_task(agent.run(), name=f"agent:{iid}"), imds, env["SPOTVISOR_NODE_ID"])
        self._booting.discard(iid)

    async def _down(self, iid: str) -> None:
        """The VM is gone: so is its agent, and everything the agent started (its shutdown
        stops its torchrun and its prewarmed launcher). The agent is cancelled once and
        waited for without cancelling it again: a second cancel would cut its shutdown
        short and leave those processes running. When this wait is itself cancelled (the
        watch loop's end), ``__aexit__`` waits for the agent instead."""
        task, imds, _ = self.agents.pop(iid)
        self._ending[task] = imds
        task.cancel()
        await asyncio.wait({task})
        await self._ended(task)

    async def _ended(self, task: asyncio.Task[None]) -> None:
        imds = self._ending.pop(task, None)
        if not task.cancelled():
            task.exception()  # the agent's own failure, if any: the VM is gone either way
        if imds is not None:
            await imds.aclose()

    def notice(self, node_id: str, *, lead_s: float) -> None:
        """EC2 publishes a spot interruption notice on the node's IMDS, and reclaims the
        instance at its time (unless the daemon terminated it first)."""
        iid, (_, imds, _) = next((i, a) for i, a in self.agents.items() if a[2] == node_id)
        imds.publish_interruption("terminate", time=datetime.now(timezone.utc) + timedelta(seconds=lead_s))

        async def reclaim() -> None:
            await asyncio.sleep(lead_s)
            await asyncio.to_thread(self.ec2.terminate_instances, InstanceIds=[iid])

        t = asyncio.create_task(reclaim(), name=f"reclaim:{iid}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)


class Daemon:
    """``spotvisord run --config FILE`` in its own process, with a ``/v1/events`` follower."""

    def __init__(self, config: Path, socket_path: str, log: Path) -> None:
        self.config = config
        self.socket_path = socket_path
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.seen: list[dict[str, Any]] = []  # what the follower was shown
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(self.config), cwd=ROOT,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)
        ready = asyncio.get_running_loop().create_future()
        self._follower = asyncio.create_task(self._follow(ready), name="follower")
        async with asyncio.timeout(30):
            await ready

    async def _follow(self, ready: asyncio.Future[None]) -> None:
        since = 0
        while self.proc is not None and self.proc.returncode is None:
            try:
                conn = aiohttp.UnixConnector(path=self.socket_path)
                async with aiohttp.ClientSession(connector=conn) as s, \
                        s.get("http://spotvisord/v1/events", params={"follow": "1", "since": str(since)}) as r:
                    if not ready.done():
                        ready.set_result(None)
                    if r.status != 200:  # 503: not durable yet, or (HA) no longer leading: ask again
                        await r.read()
                        await asyncio.sleep(0.05)
                        continue
                    async for line in r.content:
                        if line.strip():
                            ev = json.loads(line)
                            self.seen.append(ev)
                            since = ev["seq"]
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.05)

    def saw(self, kind: str, node: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["kind"] == kind and (node is None or e["node"] == node)]

    async def until(self, pred, timeout_s: float = 20.0, what: str = "") -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not pred():
                    if self.proc is not None and self.proc.returncode is not None:
                        raise AssertionError(f"the daemon exited ({self.proc.returncode}) waiting for {what}: "
                                             + self.log.read_text()[-3000:])
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; events: "
                                 f"{[(e['seq'], e['kind'], e['node']) for e in self.seen]}") from None

    async def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        await self._stop_follower()

    async def exited(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            rc = await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise AssertionError(f"the daemon did not exit: {self.log.read_text()[-3000:]}") from None
        await self._stop_follower()
        return rc

    async def _stop_follower(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower


@pytest.fixture
async def world(tmp_path: Path, faults: AwsFaultProxy, ec2_server: str) -> AsyncIterator[dict[str, Any]]:
    """A config for ``spotvisord run`` (AWS through the fault proxy, one node, fixed agent
    port so a restarted daemon is where the agents' user-data says; the job's checkpoint
    store in moto's S3, so each launch's user-data carries a presigned agent-wheel URL, as
    on EC2), and the Ec2Sim."""
    pool = f"kill-{uuid.uuid4().hex[:8]}"
    sockdir = tempfile.mkdtemp(prefix="svk-", dir="/tmp")
    boto3.client("s3", endpoint_url=ec2_server, region_name="us-east-1").create_bucket(Bucket=pool)
    raw = {
        "pool": {"name": pool, "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "j", "global_batch_size": 16, "micro_batch_size": 1, "target_steps": 30,  # STANDIN_TARGET
                "checkpoint_uri": f"s3://{pool}/ckpt", "s3_endpoint_url": ec2_server},
        "agent": {"heartbeat_interval_s": 0.2},  # what the daemon tells the agents (as the Ec2Sim starts them)
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                   "agent_host": "127.0.0.1", "agent_port": free_port(), "reconcile_interval_s": 0.1,
                   "rejoin_timeout_s": 5},
        "providers": {"local": None, "aws": {"image_id": "ami-03cf127a", "endpoint_url": faults.url}},
        "offers": [{"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "p4d.24xlarge",
                    "gpu_type": "A100-40GB", "gpus_per_node": 8}],
    }
    cfg = tmp_path / "spotvisord.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    gate = tmp_path / "flush-done"
    trainer_env = {"STANDIN_LEDGER": str(tmp_path / "ledger.json"), "STANDIN_TARGET": "30", "STANDIN_STEP_S": "0.05",
                   "STANDIN_GATE": str(gate)}
    daemons: list[Daemon] = []

    def daemon() -> Daemon:
        d = Daemon(cfg, f"{sockdir}/d.sock", tmp_path / "spotvisord.log")
        daemons.append(d)
        return d

    try:
        async with Ec2Sim(ec2_server, pool, tmp_path / "instances", trainer_env) as sim:
            yield {"pool": pool, "endpoint": ec2_server, "daemon": daemon, "sim": sim, "gate": gate,
                   "ledger": tmp_path / "ledger.json", "db": tmp_path / "state" / "spotvisord.db",
                   "trainer_env": trainer_env}
    finally:
        for d in daemons:  # a test that failed half-way leaves no daemon behind
            if d.proc is not None and d.proc.returncode is None:
                d.proc.kill()
                await d.proc.wait()
            await d._stop_follower()
        shutil.rmtree(sockdir, ignore_errors=True)


def _stored_events(db: Path) -> list[Event]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as c:
        return [Event(s, t, k, n, json.loads(d)) for s, t, k, n, d in
                c.execute("SELECT seq, time, kind, node, data FROM events ORDER BY seq")]


def _outcome(world: dict[str, Any], seen_before_kill: list[dict[str, Any]]) -> dict[str, Any]:
    sim: Ec2Sim = world["sim"]
    stored = _stored_events(world["db"])
    ledger = set(json.loads(world["ledger"].read_text()))
    instances = sim.instances()
    per_node: dict[str, int] = {}
    for inst in instances:
        per_node[sim.node_of(inst)] = per_node.get(sim.node_of(inst), 0) + 1
    return {
        "stored": stored,
        "job_completed": any(e.kind == "job_completed" for e in stored),
        "lost_checkpoints": len(ledger - {e.data["step"] for e in stored if e.kind == "checkpoint_committed"}),
        "leaked": len([i for i in instances if i["State"]["Name"] in _LIVE]),
        "duplicates": sum(n - 1 for n in per_node.values()),
        "lost_events": lost_events(stored, seen_before_kill),
    }


def _kinds(stored: list[Event], kind: str) -> list[Event]:
    return [e for e in stored if e.kind == kind]


def _execute_late(endpoint: str, params: dict[str, str]) -> None:
    """EC2 executes, now, a RunInstances request that was on the wire: the recorded form,
    sent as it was to ``endpoint`` (the fault proxy: EC2's ClientToken idempotency, which
    moto lacks; the region is the credential scope's)."""
    auth = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/ec2/aws4_request, SignedHeaders=host, Signature=0"
    req = urllib.request.Request(endpoint + "/", data=urllib.parse.urlencode(params).encode(),
                                 headers={"Content-Type": "application/x-www-form-urlencoded", "Authorization": auth})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


#: DescribeInstances as EC2 answers it while its eventually consistent listing leaves a new
#: instance out (https://docs.aws.amazon.com/ec2/latest/devguide/eventual-consistency.html)
_EMPTY_LISTING = ('<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
                  "<requestId>lagging-listing</requestId><reservationSet/></DescribeInstancesResponse>")


@pytest.mark.parametrize("case", ["landed", "lands_after_restart", "landed_listing_lags"],
                         ids=["launch_landed", "launch_lands_after_restart", "launch_landed_listing_lags"])
async def test_daemon_sigkill_mid_launch(world: dict[str, Any], faults: AwsFaultProxy, case: str,
                                         matrix: Matrix) -> None:
    """launch_landed: EC2 created the instance, its answer never reached the daemon: the
    new daemon lists it and adopts it. launch_landed_listing_lags: the same, but EC2's
    listing leaves the new instance out while the new daemon starts; it sends the same
    RunInstances again (same ClientToken, same parameters byte for byte: the wheel's signed
    URL as the first call had it), and EC2 answers with the instance the first created.
    launch_lands_after_restart: the request is still on the wire at the kill; the new
    daemon's replay creates the node's instance, and EC2 then answers the first request
    with it. Each way: one node, one instance, no purchase given up."""
    sim: Ec2Sim = world["sim"]
    landed = case != "lands_after_restart"
    if landed:
        faults.delay_next("RunInstances", 30.0)  # forwarded at once, answered (to a dead daemon) 30 s later
    else:
        faults.delay_next("RunInstances", 600.0, after_forward=False)  # held on the wire
    a = world["daemon"]()
    await a.start()
    await a.until(lambda: a.saw("node_launch_requested"), what="the launch request")
    # the launch waits for the agent's wheel, built at start: 4 s here, 16-33 s on a loaded machine
    await a.until(lambda: faults.actions("RunInstances"), timeout_s=120, what="RunInstances on the wire")
    if landed:
        await a.until(lambda: sim.live(), what="the instance in EC2")
    await a.sigkill()
    assert not a.saw("node_launched")  # the daemon died inside provider.launch
    seen = list(a.seen)

    if case == "landed_listing_lags":  # the listing leaves the instance out until the new daemon's replay
        faults.answer(lambda seen: (200, _EMPTY_LISTING, "text/xml")
                      if seen.action == "DescribeInstances" and len(faults.actions("RunInstances")) < 2 else None)
    b = world["daemon"]()
    await b.start()
    if case != "landed":
        await b.until(lambda: [e for e in b.saw("node_launched", f"{world['pool']}-1") if e["data"].get("replayed")],
                      what="node 1's launch sent again")
    faults.answer(None)
    if case == "lands_after_restart":  # EC2 runs the request that was on the wire at the kill only now
        await asyncio.to_thread(_execute_late, faults.url, faults.actions("RunInstances")[0].params)
    assert await b.exited(90) == 0  # the job completed, every instance released: it exits by itself
    out = _outcome(world, seen)
    what = {"landed": "instance created", "lands_after_restart": "request lands late",
            "landed_listing_lags": "instance created, not listed yet"}[case]
    row = matrix.row(f"daemon SIGKILL mid-launch ({what})",
                     job_completed=out["job_completed"], lost_checkpoints=out["lost_checkpoints"],
                     leaked_instances=out["leaked"] + out["duplicates"], lost_events=out["lost_events"])
    assert row.clean(), (row, out["duplicates"])
    stored = out["stored"]
    launched = [(e.node, e.data.get("adopted", False)) for e in _kinds(stored, "node_launched")]
    pool = world["pool"]
    assert _kinds(stored, "node_launch_failed") == []
    assert [e for e in _kinds(stored, "node_terminated") if e.data["reason"] == "unowned_instance"] == []
    assert len(sim.instances()) == 1
    if case == "landed":
        assert launched == [(f"{pool}-1", True)]  # adopted, not launched again
        assert len(faults.actions("RunInstances")) == 1
        return
    assert launched == [(f"{pool}-1", False)]  # the node itself, not a second one
    assert [e.data.get("replayed") for e in _kinds(stored, "node_launched")] == [True]
    calls = faults.actions("RunInstances")
    assert len({json.dumps(c.params, sort_keys=True) for c in calls}) == 1  # byte for byte, the token included
    if case == "landed_listing_lags":
        assert len(calls) == 2 and calls[1].replayed  # EC2 answered the replay with the first one's instance
    else:
        assert len(calls) == 3 and calls[2].replayed  # ... and the late first request with the replay's
    assert faults.replayed == 1


async def test_daemon_sigkill_mid_checkpoint(world: dict[str, Any], matrix: Matrix) -> None:
    """The node gets an interruption notice; its trainer starts the flush (held open by a
    gate: a big checkpoint uploading); the daemon, which has already launched the
    replacement, is SIGKILLed. A new daemon starts while the flush is still running; the
    replacement boots and registers; then the flush commits. The commit and the trainer's
    exit reach the new daemon through the agent's retries; the replacement joins only
    after the noticed node has left; the job completes."""
    sim: Ec2Sim = world["sim"]
    pool = world["pool"]
    world["trainer_env"]["STANDIN_HOLD_AT"] = "5"  # 30 steps of 0.05 s could end before a notice under load
    a = world["daemon"]()
    await a.start()
    await a.until(lambda: a.saw("job_resumed"), timeout_s=120, what="the job running")  # the wheel, a boot
    sim.notice(f"{pool}-1", lead_s=60)  # the trainer reads it at step 5 or before
    await a.until(lambda: a.saw("interruption_notice") and a.saw("node_launched", f"{pool}-2"),
                  what="the notice and the replacement launched")
    await a.sigkill()  # the flush is in progress (the gate is closed)
    assert not a.saw("checkpoint_committed")
    seen = list(a.seen)

    b = world["daemon"]()
    await b.start()
    await b.until(lambda: b.saw("node_ready", f"{pool}-2"), timeout_s=120, what="the replacement registered")
    world["gate"].touch()  # the flush completes
    assert await b.exited(90) == 0
    out = _outcome(world, seen)
    row = matrix.row("daemon SIGKILL mid-checkpoint (notice flush in flight)",
                     job_completed=out["job_completed"], lost_checkpoints=out["lost_checkpoints"],
                     leaked_instances=out["leaked"] + out["duplicates"], lost_events=out["lost_events"])
    assert row.clean(), (row, out["duplicates"])
    stored = out["stored"]
    (commit,) = [e for e in _kinds(stored, "checkpoint_committed") if e.data["reason"] == "notice"]
    (notice,) = _kinds(stored, "interruption_notice")
    assert commit.data["notice_ids"] == [notice.data["notice_id"]]
    exited = next(e for e in _kinds(stored, "trainer_exited") if e.node == f"{pool}-1")
    admitted = next(e for e in _kinds(stored, "node_admitted") if e.node == f"{pool}-2")
    assert admitted.seq > exited.seq, "the replacement joined while the noticed node was still in the job"
    resumed = [e for e in _kinds(stored, "job_resumed") if e.node == f"{pool}-2"]
    assert resumed and resumed[0].data["step"] == commit.data["step"]  # resumed from the notice's commit
    assert len(sim.instances()) == 2
