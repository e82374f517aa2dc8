"""A job whose rendezvous store does not answer is never silent: the control node probes
the store of the job's domain, raises ``rendezvous_unreachable`` once per outage (with
the fix), shows it in ``spotctl status`` while it lasts and says ``rendezvous_recovered``
when the store answers again. A store back within a few seconds raises nothing."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import RecordingProvider, started_daemon
from daemon.config import Config
from daemon.control.rendezvous_health import ALARM_AFTER, alarm, fix, observe
from daemon.controlnode.rendezvous_watch import probe
from daemon.controlnode.store import Store
from daemon.interfaces.ctl_render import render_status


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 5))
def test_one_alarm_per_outage_of_alarm_after_probes_and_one_recovery_after_it(answers, alarm_after) -> None:
    health, verdicts = None, []
    for t, ok in enumerate(answers):
        health, verdict = observe(health, domain="d", endpoint="10.0.0.10:29400", error=None if ok else "refused",
                                  now=float(t), alarm_after=alarm_after)
        verdicts.append(verdict)
    # the expected verdicts, from the runs of failures
    expected, run, alarmed = [], 0, False
    for ok in answers:
        if ok:
            expected.append("rendezvous_recovered" if alarmed else None)
            run, alarmed = 0, False
        else:
            run += 1
            expected.append("rendezvous_unreachable" if run == alarm_after else None)
            alarmed = alarmed or run == alarm_after
    assert verdicts == expected
    assert bool(alarm(health, local=True)) == alarmed  # status shows the alarm exactly while it holds


def test_a_probe_of_another_endpoint_starts_afresh_and_the_alarm_says_since_when_and_the_fix() -> None:
    h = None
    for t in range(ALARM_AFTER - 1):
        h, v = observe(h, domain="east", endpoint="10.0.0.10:29400", error="refused", now=100.0 + t)
        assert v is None
    # the job moved to another domain: its store's streak starts at one
    h, v = observe(h, domain="west", endpoint="10.1.0.10:29400", error="refused", now=200.0)
    assert v is None and h.failures == 1
    for t in range(ALARM_AFTER - 1):
        h, v = observe(h, domain="west", endpoint="10.1.0.10:29400", error="timed\nout", now=201.0 + t)
    assert v == "rendezvous_unreachable"
    shown = alarm(h, local=False)
    assert shown["since"] == 200.0 and shown["error"] == "timed out" and shown["domain"] == "west"
    assert "systemctl start spotvisor-rendezvous" in shown["fix"] and "port 29400" in shown["fix"]
    assert fix("127.0.0.1:29400", local=True) == ("start it on this machine: spotvisord rendezvous --host 127.0.0.1 "
                                                   "--port 29400")
    with pytest.raises(ValueError, match="alarm_after"):
        observe(None, domain="d", endpoint="e:1", error=None, now=0.0, alarm_after=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_probe_answers_none_for_a_listener_and_why_for_a_closed_port() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        assert await probe("127.0.0.1", port) is None
    assert "ConnectionRefusedError" in (await probe("127.0.0.1", port) or "")


async def test_the_daemon_says_its_store_does_not_answer_and_when_it_answers_again(tmp_path: Path, sockdir) -> None:
    port = _free_port()  # nothing listens there: no rendezvous store was started
    config = Config.model_validate({
        "pool": {"name": f"rdzv-{uuid.uuid4().hex[:6]}", "min_nodes": 1, "target_nodes": 1, "max_nodes": 1},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 100,
                "checkpoint_uri": f"file://{tmp_path}/ckpt"},
        "rendezvous": {"host": "127.0.0.1", "port": port},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": str(sockdir / "d.sock"),
                   "reconcile_interval_s": 0.05},
    })
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    try:
        async with started_daemon(config, RecordingProvider(), store, str(sockdir / "d.sock")) as (sup, _api):
            for _ in range(ALARM_AFTER):  # what the daemon's probe loop does every few seconds
                await sup.rendezvous.probe_once()
            (ev,) = store.events(kinds=["rendezvous_unreachable"])  # once, however many probes failed
            assert ev.data["endpoint"] == f"127.0.0.1:{port}" and "ConnectionRefusedError" in ev.data["error"]
            assert ev.data["fix"] == f"start it on this machine: spotvisord rendezvous --host 127.0.0.1 --port {port}"
            shown = render_status(sup.status(), now=sup.clock())
            assert f"RENDEZVOUS STORE NOT ANSWERING at 127.0.0.1:{port} (domain " in shown
            assert "no node can start training until it does" in shown and ev.data["fix"] in shown

            server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)  # the operator starts it
            async with server:
                await sup.rendezvous.probe_once()
                (back,) = store.events(kinds=["rendezvous_recovered"])
                assert back.data["endpoint"] == f"127.0.0.1:{port}"
                assert "RENDEZVOUS STORE" not in render_status(sup.status(), now=sup.clock())
                assert len(store.events(kinds=["rendezvous_unreachable"])) == 1
    finally:
        store.close()
