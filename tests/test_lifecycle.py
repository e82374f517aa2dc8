"""The daemon's lifecycle around a job (issue 6, item 6).

- The job completes → every instance is released, a launch still in flight
  included, then ``pool_released`` carries the final cost (Σ price × hours held).
- SIGTERM stops the daemon and leaves the job alone: no instance terminated, and a
  restarted daemon picks the running node up from the store.

The provider is the RecordingProvider of ``conftest.py`` (0.5 USD/h); time is a
ManualClock where the cost is checked.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from conftest import DaemonHarness, ManualClock, RecordingProvider, started_daemon
from daemon.interfaces.cli import running_daemon
from daemon.config import Config
from daemon.model import JobState, NodeState
from daemon.providers.base import Instance
from daemon.interfaces.service import SdNotifier, serve
from daemon.controlnode.store import Store

T0 = 1_000_000.0


def _config(tmp_path: Path, sockdir: str, *, target: int = 1) -> Config:
    return Config.model_validate({
        "pool": {"name": "life", "min_nodes": 1, "target_nodes": target, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 10},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                   "reconcile_interval_s": 0.05, "rejoin_timeout_s": 30},
    })


class GatedProvider(RecordingProvider):
    """Launches of the node ids in ``held`` wait until ``release`` is set (a slow cloud);
    ``passes`` counts ``describe`` calls (one per reconcile pass)."""

    def __init__(self, held: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.held = set(held)
        self.release = asyncio.Event()
        self.passes = 0
        self._passed = asyncio.Event()

    async def launch(self, offer, node) -> Instance:  # type: ignore[override]
        if node.node_id in self.held:
            await self.release.wait()
        return await super().launch(offer, node)

    async def describe(self, tag: str) -> list[Instance]:
        self.passes += 1
        self._passed.set()
        return await super().describe(tag)

    async def reconcile_passes(self, n: int, timeout_s: float = 5.0) -> None:
        """Return once ``n`` more reconcile passes have started (so ``n - 1`` completed)."""
        goal = self.passes + n
        async with asyncio.timeout(timeout_s):
            while self.passes < goal:
                self._passed.clear()
                await self._passed.wait()


@pytest.fixture
async def clocked(tmp_path: Path) -> AsyncIterator[DaemonHarness]:
    """A started daemon on a ManualClock, pool target 2, node 2's launch held."""
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = _config(tmp_path, sockdir, target=2)
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = GatedProvider(held={"life-2"})
    clock = ManualClock(T0)
    try:
        async with started_daemon(config, provider, store, f"{sockdir}/d.sock", clock=clock) as (sup, api):
            try:
                yield DaemonHarness(sup, api, provider, config, f"{sockdir}/d.sock", tmp_path)
            finally:
                provider.release.set()  # before the supervisor closes: its held launch returns
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def _status_line(step: int, event: str = "started") -> dict:
    return {"kind": "trainer_status", "line": {"event": event, "attempt": "a1", "rank": 0, "world_size": 1, "step": step,
                                               "time": time.time()}}


async def test_job_completion_releases_every_instance_and_reports_the_final_cost(clocked: DaemonHarness) -> None:
    h = clocked
    sup, provider, clock = h.sup, h.provider, h.sup.clock
    await h.until(lambda: sup.nodes.get("life-1") is not None and sup.nodes["life-1"].state is NodeState.LAUNCHING,
                  what="node 1 launched")
    n1 = sup.nodes["life-1"]
    assert sup.nodes["life-2"].state is NodeState.REQUESTED  # its launch is held in flight
    sup.agents.on_register(n1)
    await provider.reconcile_passes(2)  # the daemon has seen node 1 ready (and waits for node 2)
    assert n1.state is NodeState.READY
    clock.advance(31)  # past rejoin_timeout_s: the job starts on the one ready node
    sup.agents.on_heartbeat(n1, {"trainer": {"state": "running"}})
    sup.wake()
    await h.until(lambda: n1.state is NodeState.RUNNING, what="job start on node 1")
    sup.intake.on_reports(n1, [_status_line(0)])

    clock.advance(2 * 3600 - 31)  # node 1 held for 2 h, then the job completes
    sup.agents.on_heartbeat(n1, {"step": 10, "trainer": {"state": "running"}})
    sup.intake.on_reports(n1, [_status_line(10, "completed")])
    await h.until(lambda: n1.state is NodeState.TERMINATED, what="node 1 released")
    assert sup.job.state is JobState.COMPLETED
    assert provider.terminated == {n1.instance_id}
    assert not h.events("pool_released"), "a launch is still in flight: the pool is not released yet"

    clock.advance(3600)  # the held launch returns an hour later: its instance is released at once
    provider.release.set()
    await asyncio.wait_for(sup.wait_released(), 5)
    n2 = sup.nodes["life-2"]
    assert n2.instance_id is not None and provider.terminated == {n1.instance_id, n2.instance_id}
    # released (no instance yet), then its instance given back once the launch returned
    assert [e.data["reason"] for e in h.events("node_terminated") if e.node == "life-2"] == [
        "scale_in", "released_while_launching"]
    released = h.events("pool_released")
    assert len(released) == 1
    # node 1: 2 h; node 2: requested at T0, instance released at T0 + 3 h → 3 h; 0.5 USD/h each
    assert released[0].data == {"reason": "job_completed", "cost_usd": 2.5, "node_hours": 5.0, "instances": 2}
    assert all(n.state.is_terminal() for n in sup.nodes.values())


async def test_sigterm_stops_the_daemon_and_leaves_every_instance_running(tmp_path: Path) -> None:
    """`spotvisord run`'s own path (serve + running_daemon) under a real SIGTERM; the
    test plays the node's agent over the agent API and watches the control API."""
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = _config(tmp_path, sockdir)
    provider = RecordingProvider()
    loop = asyncio.get_running_loop()
    ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # where READY=1 arrives
    ready.bind(f"{sockdir}/notify")
    ready.setblocking(False)
    service = asyncio.create_task(serve(running_daemon(config, providers={"local": provider}),
                                        notifier=SdNotifier(f"{sockdir}/notify"), watchdog_interval_s=None))
    try:
        async with asyncio.timeout(10):
            assert (await loop.sock_recv(ready, 4096)).startswith(b"READY=1\n")
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=f"{sockdir}/d.sock")) as ctl, \
                ctl.get("http://spotvisord/v1/events", params={"follow": "1"}) as feed:

            async def next_event(kind: str) -> dict:
                async with asyncio.timeout(5):
                    async for line in feed.content:
                        ev = json.loads(line)
                        if ev["kind"] == kind:
                            return ev
                raise AssertionError(f"the event stream ended before {kind}")

            await next_event("node_launched")
            spec, inst = provider.launched[0]
            auth = {"Authorization": f"Bearer {spec.token}"}
            async with aiohttp.ClientSession(spec.daemon_url, headers=auth) as agent:  # the node's agent
                async with agent.post("/v1/agent/register", json={"node_id": spec.node_id}) as r:
                    assert r.status == 200
                await next_event("node_admitted")
                async with agent.post("/v1/agent/heartbeat",
                                      json={"node_id": spec.node_id, "trainer": {"state": "running"}}) as r:
                    assert (await r.json())["start_trainer"] is True

        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(service, 15) == 0
        assert (await loop.sock_recv(ready, 4096)).startswith(b"STOPPING=1\n")
    finally:
        if not service.done():
            service.cancel()
        ready.close()
        shutil.rmtree(sockdir, ignore_errors=True)

    assert provider.terminated == set(), "a stop must not terminate the job's instances"
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    try:
        [node] = store.nodes()
        assert (node.state, node.instance_id) == (NodeState.RUNNING, inst.id)
        assert not store.events(kinds=["node_terminated", "node_lost", "pool_released"])
    finally:
        store.close()


async def test_a_restarted_daemon_picks_up_the_running_job(tmp_path: Path) -> None:
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = _config(tmp_path, sockdir)
    provider = GatedProvider()  # the cloud: its instances outlive the daemon
    try:
        async with running_daemon(config, providers={"local": provider}) as sup:
            h = DaemonHarness(sup, None, provider, config, f"{sockdir}/d.sock", tmp_path)
            await h.until(lambda: [n.state for n in sup.nodes.values()] == [NodeState.LAUNCHING], what="launch")
            [n1] = sup.nodes.values()
            sup.agents.on_register(n1)
            await h.until(lambda: n1.state is NodeState.RUNNING, what="job start")
            sup.agents.on_heartbeat(n1, {"step": 3, "trainer": {"state": "running"}})
        assert provider.terminated == set()

        # the daemon stays away for an hour: the store's last heartbeat is old news
        store = Store(tmp_path / "state" / "spotvisord.db").open()
        [stored] = store.nodes()
        stored.last_heartbeat = time.time() - 3600
        store.put_node(stored)
        for step, size in ((20, 5_000), (40, 6_000)):  # what the first daemon recorded of the trainer's commits
            store.append_event("checkpoint_committed", "life-1", {"step": step, "attempt": "a1", "reason": "periodic",
                                                                  "bytes": size, "trainer_time": 1000.0 + step})
        store.append_event("job_resumed", "life-1", {"attempt": "a1", "step": 0, "world_size": 1, "lost_steps": 0},
                           at=900.0)  # the job's start, as the first daemon recorded it
        store.close()

        async with running_daemon(config, providers={"local": provider}) as sup:
            await provider.reconcile_passes(3)  # two full passes on the old state
            assert [(n.id, n.state, n.detail) for n in sup.nodes.values()] == [("life-1", NodeState.RUNNING, "")]
            n1 = sup.nodes["life-1"]
            assert sup.job.state is JobState.RUNNING
            # the newest commit is the job's (what a resume or a migration's copy starts from)
            assert (sup.job.last_commit_step, sup.job.last_commit_time, sup.job.last_commit_bytes) == (40, 1040.0, 6_000)
            # when the job started and at which world size (a chaos schedule's at_s and full pool read them)
            assert (sup.job.started_at, sup.job.world_size) == (900.0, 1)
            assert len(provider.launched) == 1 and provider.terminated == set()
            assert len(sup.store.events(kinds=["node_launch_requested"])) == 1
            assert not sup.store.events(kinds=["node_lost", "node_terminated"])
            reply = sup.agents.on_heartbeat(n1, {"step": 4, "trainer": {"state": "running"}})
            assert reply["start_trainer"] is True
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


class SlowTerminateProvider(RecordingProvider):
    """Each terminate takes until two are in flight at once (it fails if they run one after
    another); the first call for ``failing`` raises a ProviderError."""

    def __init__(self, failing: str) -> None:
        super().__init__()
        self.failing = failing
        self.in_flight = 0
        self.most_in_flight = 0
        self.both = asyncio.Event()
        self.calls: list[str] = []

    async def terminate(self, instance_id: str) -> None:
        from daemon.providers.base import ProviderError

        self.calls.append(instance_id)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.in_flight >= 2:
                self.both.set()
            async with asyncio.timeout(2.0):  # one after another: the first never sees the second
                await self.both.wait()
            if instance_id == self.failing and self.calls.count(instance_id) == 1:
                raise ProviderError(f"terminate {instance_id}: throttled")
            await super().terminate(instance_id)
        finally:
            self.in_flight -= 1


async def test_terminations_in_one_pass_run_together_and_a_failed_one_is_retried(tmp_path: Path) -> None:
    # Two nodes whose boot timed out are terminated in the same reconcile pass. With a
    # notice storm on a real cloud (~0.5 s a call) one call after another kept the loop
    # from admitting anyone for tens of seconds.
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = _config(tmp_path, sockdir, target=2)
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = SlowTerminateProvider(failing="i-0001")
    clock = ManualClock(T0)
    try:
        async with started_daemon(config, provider, store, f"{sockdir}/d.sock", clock=clock) as (sup, api):
            h = DaemonHarness(sup, api, provider, config, f"{sockdir}/d.sock", tmp_path)
            await h.until(lambda: len(h.events("node_launched")) == 2, what="two launches")
            clock.advance(config.daemon.launch_timeout_s + 1)  # no agent ever registers: boot timed out
            sup.wake()
            await h.until(lambda: {"i-0001", "i-0002"} <= provider.terminated, timeout_s=10,
                          what="both instances terminated, the throttled one on a later pass")
            assert provider.most_in_flight >= 2
            assert provider.calls.count("i-0001") == 2  # failed once (ProviderError), retried
            assert sup.is_healthy()  # the reconcile task survived the provider error
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


class StaleListingProvider(RecordingProvider):
    """Node 2's launch waits for the next listing to be taken; that listing answers only
    after ``answer`` is set, so node 2's launch lands while it is in flight and is
    missing from it, as from any listing asked for before the launch landed."""

    def __init__(self) -> None:
        super().__init__()
        self.stale = False
        self.listed = asyncio.Event()
        self.answer = asyncio.Event()
        self.passes = 0  # listings answered

    async def launch(self, offer, node) -> Instance:  # type: ignore[override]
        if node.node_id == "life-2":
            self.stale = True
            await self.listed.wait()  # lands while a listing without it is in flight
        return await super().launch(offer, node)

    async def describe(self, tag: str) -> list[Instance]:
        listing = await super().describe(tag)
        if self.stale and not self.answer.is_set():
            self.listed.set()
            await self.answer.wait()
        self.passes += 1
        return listing


async def test_a_launch_that_lands_during_an_instance_listing_is_not_taken_for_lost(tmp_path: Path) -> None:
    """The listing was asked for before node 2's launch landed, so it cannot show node 2's
    instance: node 2 is not lost, and no replacement is launched for it (seen with EC2
    on moto: three instances launched for a pool of two, one terminated at once)."""
    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = _config(tmp_path, sockdir, target=2)
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = StaleListingProvider()
    try:
        async with started_daemon(config, provider, store, f"{sockdir}/d.sock") as (sup, _):
            h = DaemonHarness(sup, _, provider, config, f"{sockdir}/d.sock", tmp_path)
            await h.until(lambda: sup.nodes.get("life-2") is not None and sup.nodes["life-2"].instance_id,
                          what="node 2's launch landed while a listing was in flight")
            provider.answer.set()
            goal = provider.passes + 4  # the stale listing, then three with node 2's instance in it
            await h.until(lambda: provider.passes >= goal, what="four more reconcile passes")
            assert sup.nodes["life-2"].state is not NodeState.LOST
            assert not h.events("node_lost")
            assert len(provider.launched) == 2 and not provider.terminated
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)
