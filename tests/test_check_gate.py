"""The daemon runs the cloud check at start and buys nothing a failed check concerns: it
says why (a ``cloud_check_failed`` event, a ``spotctl status`` line) and picks up a fix at
the next retry, without a restart. A quota error at launch backs its offer family off,
with an event saying when it is tried again."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3

from conftest import RecordingProvider, started_daemon
from daemon.config import Config
from daemon.controlnode.cloud_check import passed
from daemon.controlnode.store import Store
from daemon.interfaces.ctl_render import render_status
from daemon.providers.base import QuotaError


def _config(tmp_path: Path, sock: Path, uri: str, s3: str | None = None) -> Config:
    return Config.model_validate({
        "pool": {"name": f"gate-{uuid.uuid4().hex[:6]}", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 1_000_000, "checkpoint_uri": uri,
                "s3_endpoint_url": s3},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": str(sock / "d.sock"),
                   "reconcile_interval_s": 0.05},
    })


async def test_a_failed_check_buys_nothing_says_why_and_a_fix_is_picked_up(tmp_path, sockdir, s3_server) -> None:
    bucket = f"gate-{uuid.uuid4().hex[:8]}"  # not created yet: the store probe fails
    config = _config(tmp_path, sockdir, f"s3://{bucket}/ckpt", s3_server)
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = RecordingProvider()
    try:
        async with started_daemon(config, provider, store, str(sockdir / "d.sock")) as (sup, _api):
            for _ in range(5):
                await sup.reconcile_once()
            assert provider.launched == []  # nothing bought
            (ev,) = store.events(kinds=["cloud_check_failed"])
            (line,) = ev.data["failed"]
            assert line.startswith("FAIL store s3://" + bucket) and "fix: job.checkpoint_uri" in line
            assert ev.data["blocked_offers"] == [0] and ev.data["retry_in_s"] == 60
            shown = render_status(sup.status(), now=sup.clock())
            assert "not buying offers.0: the cloud check failed" in shown and line in shown

            boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)  # the operator fixes it
            await sup.fleet.checks.check_once()  # what the retry loop does when the retry is due
            for _ in range(200):
                if provider.launched:
                    break
                await sup.wait_for_events(store.last_seq(), timeout_s=0.05)
            assert provider.launched  # bought, without a restart
            (ok,) = store.events(kinds=["cloud_check_passed"])
            assert ok.data["after_failures"] == 1
            assert "not buying" not in render_status(sup.status(), now=sup.clock())
    finally:
        store.close()


class QuotaProvider(RecordingProvider):
    async def launch(self, offer, node):  # type: ignore[override]
        raise QuotaError("MaxSpotInstanceCountExceeded: RunInstances in local")


async def test_a_quota_error_backs_its_family_off_and_says_until_when(tmp_path, sockdir) -> None:
    config = _config(tmp_path, sockdir, f"file://{tmp_path}/ckpt")
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = QuotaProvider()
    try:
        async with started_daemon(config, provider, store, str(sockdir / "d.sock")) as (sup, _api):
            for _ in range(200):  # the daemon's own loop launches, and the launch fails
                if store.events(kinds=["offer_family_backoff"]):
                    break
                await sup.wait_for_events(store.last_seq(), timeout_s=0.05)
            (ev,) = store.events(kinds=["offer_family_backoff"])
            assert ev.data["family"] == "local/local/local" and ev.data["retry_in_s"] == 600.0
            assert ev.data["retry_at"] > sup.clock()
            until = sup.fleet.history(sup.clock()).backoff_until[0]
            assert until != float("inf") and until - sup.clock() <= 600.0  # a backoff, not until a restart
            failed = store.events(kinds=["node_launch_failed"])
            assert failed and failed[-1].data["family"] == "local/local/local"
    finally:
        store.close()


async def test_a_takeover_takes_the_check_its_standby_ran_instead_of_running_one(
        tmp_path, sockdir, s3_server) -> None:
    """HA: the standby ran the cloud check while it waited (it passed); at the takeover the
    new leader buys at once on that run, without a run of its own at start. Here the
    bucket went missing in between, so a run at start would have blocked the offer: the
    launch shows the standby's run was taken, and the next retry's run catches the loss."""
    bucket = f"gate-{uuid.uuid4().hex[:8]}"  # missing: a run now would fail
    config = _config(tmp_path, sockdir, f"s3://{bucket}/ckpt", s3_server)
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    provider = RecordingProvider()
    standby_run = [passed("store", f"s3://{bucket}/ckpt: read, write and delete", offers=[0])]
    try:
        async with started_daemon(config, provider, store, str(sockdir / "d.sock"), checked=standby_run) as (sup, _):
            await sup.reconcile_once()
            assert provider.launched  # bought on the standby's run
            assert store.events(kinds=["cloud_check_failed"]) == []
            await sup.fleet.checks.check_once()  # the gate's next run: the bucket is gone
            (ev,) = store.events(kinds=["cloud_check_failed"])
            assert ev.data["blocked_offers"] == [0]
    finally:
        store.close()
