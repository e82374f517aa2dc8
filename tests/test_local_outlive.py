"""Issue 29: local instances that outlive the daemon (under ``spotvisord demo``'s runner).

- A LocalProvider built anew on the same state directory, with the runner's lifeline,
  adopts a live instance from its record and ignores a record whose init is dead or
  whose pid another process now has (:mod:`daemon.providers.local_instance`).
- The instance's own metadata endpoint publishes a notice only for its admin token, from
  loopback, and reclaims the instance at the deadline
  (:mod:`daemon.providers.local_metadata.serve`).
- A restarted daemon fires only the chaos events no earlier daemon recorded, and says once
  that it is the restart (:func:`daemon.providers.chaos.events_left`, ``kills_unanswered``).

The whole path, with real SIGKILLs: ``tests/chaos/test_local_daemon_kill.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.config import LocalProviderSpec
from daemon.model import Event
from daemon.providers.chaos import events_left, kills_unanswered
from daemon.providers.local import LocalProvider
from daemon.providers.local_instance import (
    INSTANCE_ENV,
    LIFELINE_FD_ENV,
    RECORD_FILE,
    InstanceRecord,
    process_alive,
)
from daemon.providers.local_metadata.aws import FakeImds
from daemon.providers.local_metadata.serve import admin_routes, authorized, publish_interruption
from daemon.state_dir import prepare_state_dir, private_dir

OFFER = {"index": 0, "provider": "local", "region": "local", "zone": "local-a", "instance_type": "local.cpu",
         "gpus_per_node": 1, "price_usd_h": None, "max_price_usd_h": None, "on_demand": False,
         "placement_group": None}


@pytest.fixture
def lifeline(monkeypatch: pytest.MonkeyPatch):
    r, w = os.pipe()
    monkeypatch.setenv(LIFELINE_FD_ENV, str(r))
    yield r
    os.close(r)
    os.close(w)


def _record(state: Path, node_id: str, iid: str, pid: int, create_time: float, pool: str = "demo") -> Path:
    workdir = private_dir(state / "nodes" / node_id, root=state)
    InstanceRecord(id=iid, node_id=node_id, pool=pool, pid=pid, create_time=create_time,
                   imds_url="http://127.0.0.1:1", dialect="aws", offer=OFFER, launched_at=1000.0).write(workdir)
    return workdir


async def test_a_new_provider_adopts_the_live_instance_and_ignores_dead_or_reused_pids(
        tmp_path: Path, lifeline: int) -> None:
    state = prepare_state_dir(tmp_path / "state")
    vm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          env={**os.environ, INSTANCE_ENV: "local-1-0001"})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        born = psutil.Process(vm.pid).create_time()
        live_dir = _record(state, "n1", "local-1-0001", vm.pid, born)
        _record(state, "n2", "local-1-0002", dead.pid, 123.0)  # its init is gone
        _record(state, "n3", "local-1-0003", os.getpid(), psutil.Process().create_time() - 50)  # pid reused
        _record(state, "n4", "local-1-0004", vm.pid, psutil.Process(vm.pid).create_time(), pool="other")
        assert (os.stat(live_dir / RECORD_FILE).st_mode & 0o777) == 0o600

        provider = LocalProvider(spec=LocalProviderSpec(launch_delay_s=0), state_dir=state)
        assert provider.outlives_daemon
        (inst,) = await provider.describe("demo")
        assert (inst.id, inst.node_id, inst.state, inst.zone, inst.launched_at) == (
            "local-1-0001", "n1", "running", "local-a", 1000.0)
        assert [i.id for i in await provider.describe("other")] == ["local-1-0004"]

        await provider.terminate("local-1-0001")  # not our child: killed and waited for all the same
        assert not process_alive(vm.pid, born)  # (psutil reaped our child: Popen reads 0, not -9)
        assert not (live_dir / RECORD_FILE).exists()
        assert await provider.describe("demo") == []
        await provider.aclose()
    finally:
        vm.kill()
        vm.wait()


async def test_closing_a_provider_under_a_runner_leaves_its_adopted_instances_running(
        tmp_path: Path, lifeline: int) -> None:
    state = prepare_state_dir(tmp_path / "state")
    vm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          env={**os.environ, INSTANCE_ENV: "local-1-0001"})
    try:
        _record(state, "n1", "local-1-0001", vm.pid, psutil.Process(vm.pid).create_time())
        provider = LocalProvider(spec=LocalProviderSpec(launch_delay_s=0), state_dir=state)
        assert len(await provider.describe("demo")) == 1
        await provider.aclose()  # a daemon's stop: the instances are the runner's, as a cloud's
        assert process_alive(vm.pid, psutil.Process(vm.pid).create_time())
        again = LocalProvider(spec=LocalProviderSpec(launch_delay_s=0), state_dir=state)
        assert [i.id for i in await again.describe("demo")] == ["local-1-0001"]
    finally:
        vm.kill()
        vm.wait()


def test_without_a_runner_nothing_is_adopted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIFELINE_FD_ENV, raising=False)
    state = prepare_state_dir(tmp_path / "state")
    _record(state, "n1", "local-1-0001", os.getpid(), psutil.Process().create_time())
    provider = LocalProvider(spec=LocalProviderSpec(launch_delay_s=0), state_dir=state)
    assert not provider.outlives_daemon
    assert asyncio.run(provider.describe("demo")) == []


def test_a_lifeline_variable_naming_no_pipe_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIFELINE_FD_ENV, "987")
    with pytest.raises(ValueError, match=LIFELINE_FD_ENV):
        LocalProvider(spec=LocalProviderSpec(launch_delay_s=0), state_dir=tmp_path)


def test_an_unreadable_record_is_no_instance(tmp_path: Path) -> None:
    workdir = private_dir(prepare_state_dir(tmp_path / "s") / "nodes" / "n1", root=tmp_path / "s")
    (workdir / RECORD_FILE).write_text("{not json")
    assert InstanceRecord.read(workdir / RECORD_FILE) is None
    (workdir / RECORD_FILE).unlink()
    (workdir / RECORD_FILE).symlink_to("/etc/hostname")  # planted: refused, not followed
    assert InstanceRecord.read(workdir / RECORD_FILE) is None


# --------------------------------------------------------------------------- the admin route


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer s3cret", True), ("Bearer s3cre", False), ("Bearer s3cret ", False), ("bearer s3cret", False),
    ("s3cret", False), ("", False), (None, False),
])
def test_the_admin_route_takes_its_own_token_only(header: str | None, ok: bool) -> None:
    assert authorized(header, "s3cret") is ok
    assert authorized(header, "") is False  # no token configured: nobody


async def test_the_instance_endpoint_publishes_for_its_token_and_reclaims_at_the_deadline() -> None:
    reclaimed = asyncio.Event()
    fake: FakeImds | None = None
    fake = FakeImds(extra_routes=admin_routes(lambda: fake, "tok-1", reclaim=reclaimed.set))
    async with fake:
        with pytest.raises(RuntimeError, match="401"):
            await publish_interruption(fake.url, "tok-2", action="terminate", deadline=time.time() + 0.3)
        assert "spot/instance-action" not in fake._items and not reclaimed.is_set()

        published = await publish_interruption(fake.url, "tok-1", action="terminate", deadline=time.time() + 0.3)
        assert published == fake.published_at and published is not None
        assert '"action": "terminate"' in fake._items["spot/instance-action"]
        assert not reclaimed.is_set()
        await asyncio.wait_for(reclaimed.wait(), 5)  # at the deadline, by the instance's side


# --------------------------------------------------------------------------- chaos across restarts


def _chaos(seq: int, data: dict) -> Event:
    return Event(seq, 1000.0 + seq, "chaos_injected", None, data)


records = st.lists(st.one_of(
    st.builds(lambda i, a, sk: _chaos(0, {"index": i, "action": a, **({"skipped": True} if sk else {})}),
              st.integers(-2, 14), st.sampled_from(["notice", "kill", "kill_store", "store_restarted",
                                                    "kill_daemon", "kill_control_node", "daemon_restarted"]),
              st.booleans()),
    st.builds(lambda k: Event(0, 1.0, k, None, {"index": 1}), st.sampled_from(["node_lost", "job_resumed"])),
), max_size=20)


@settings(max_examples=300, deadline=None)
@given(stored=records, n=st.integers(0, 12))
def test_a_restarted_daemon_fires_exactly_the_events_no_daemon_recorded(stored: list[Event], n: int) -> None:
    left = events_left(stored, n)
    recorded = {e.data["index"] for e in stored if e.kind == "chaos_injected"}
    assert left == sorted(set(left))  # config order, once each
    assert set(left) == set(range(n)) - recorded
    # order and repeats of the records do not matter
    assert events_left(list(reversed(stored)) + stored, n) == left


@settings(max_examples=300, deadline=None)
@given(stored=records)
def test_each_daemon_kill_is_answered_by_one_restart_record(stored: list[Event]) -> None:
    unanswered = kills_unanswered(stored)
    answered = {e.data["index"] for e in stored if e.kind == "chaos_injected" and e.data["action"] == "daemon_restarted"}
    assert all(e.data["action"] in ("kill_daemon", "kill_control_node") and not e.data.get("skipped")
               and e.data["index"] not in answered for e in unanswered)
    restarts = [_chaos(99, {"index": e.data["index"], "action": "daemon_restarted"}) for e in unanswered]
    assert kills_unanswered(stored + restarts) == []  # once answered, never again


@pytest.mark.parametrize(("action", "outlives", "store_pid", "reason"), [
    ("kill_daemon", False, None, "no outside runner here"),  # spotvisord run: systemd restarts it
    ("kill_control_node", False, "123", "no outside runner here"),
    ("kill_control_node", True, None, "no rendezvous store pid"),
    ("kill_control_node", True, "", "no rendezvous store pid"),  # the runner's file names no pid
])
def test_a_daemon_kill_without_a_runner_is_recorded_as_skipped(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, action: str, outlives: bool, store_pid: str | None,
        reason: str) -> None:
    from types import SimpleNamespace

    from daemon.config import ChaosEvent
    from daemon.providers import chaos
    from daemon.providers.local_instance import STORE_PID_FILE_ENV

    if store_pid is None:
        monkeypatch.delenv(STORE_PID_FILE_ENV, raising=False)
    else:
        (tmp_path / "rendezvous.pid").write_text(store_pid)
        monkeypatch.setenv(STORE_PID_FILE_ENV, str(tmp_path / "rendezvous.pid"))
    monkeypatch.setattr(chaos.os, "kill", lambda *a: pytest.fail(f"killed {a}"))
    recorded: list[tuple] = []
    sup = SimpleNamespace(job=SimpleNamespace(step=7), record=lambda kind, node, **data: recorded.append((kind, data)))
    chaos._kill_daemon(sup, 3, ChaosEvent(action=action, at_step=5), SimpleNamespace(outlives_daemon=outlives))
    [(kind, data)] = recorded
    assert (kind.value, data["index"], data["action"], data["skipped"]) == ("chaos_injected", 3, action, True)
    assert reason in data["reason"]
