"""The daemon's HA hooks, in process: a :class:`~daemon.ha.fence.Deposed` that ends one of
the supervisor's tasks (the reconcile loop's provider calls are in a TaskGroup: it comes
as an ExceptionGroup) ends the daemon through ``Supervisor(on_crash=...)``
(:meth:`daemon.ha.leading.Leadership.on_task_crash`); any other crash is logged as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from conftest import RecordingProvider
from daemon.config import load_config
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor
from daemon.ha.fence import Deposed
from daemon.ha.leading import Leadership, leader_config
from daemon.providers.base import ProviderError

ROOT = Path(__file__).resolve().parents[1]


async def _crash(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


async def test_a_deposed_reconcile_task_ends_the_daemon_and_other_crashes_stay_logged(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs" / "ha.yaml")
    assert config.ha is not None
    ha = Leadership(config.ha, config.pool.name)  # no I/O until lead()
    sup = Supervisor(config, provider=RecordingProvider(), store=Store(tmp_path / "db").open(),  # type: ignore[arg-type]
                     on_crash=ha.on_task_crash)
    try:
        with structlog.testing.capture_logs() as logs:
            other = sup.spawn(_crash(ValueError("a bug")), "prices")
            await asyncio.gather(other, return_exceptions=True)
            assert not ha.lost.is_set()
            assert [e["task"] for e in logs if e["event"] == "task_crashed"] == [f"prices:{config.pool.name}"]
            group = ExceptionGroup("provider calls", [ProviderError("x"), Deposed("control-a's fence 7 was refused")])
            task = sup.spawn(_crash(group), "reconcile")
            async with asyncio.timeout(5):
                await ha.lost.wait()
            assert task.done()
            assert "reconcile" in ha.reason and "fence 7 was refused" in ha.reason
            assert len([e for e in logs if e["event"] == "task_crashed"]) == 1  # handled: not a silent crash either
            assert [e["event"] for e in logs if e.get("log_level") == "error"][-1] == "ha_deposed"
    finally:
        await sup.aclose()
        await ha.client.close()


def test_the_election_timings_follow_the_lease() -> None:
    """ha.lease_s 2..60: keepalives 4 times per TTL (at most every 1.5 s); every one valid."""
    assert leader_config(2).renew_every_s == 0.5
    assert leader_config(5).renew_every_s == 1.25 and leader_config(5).ttl_s == 5.0
    assert leader_config(60).renew_every_s == 1.5
