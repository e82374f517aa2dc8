"""A new instance a cloud's listing has not shown yet is not a lost node (daemon.control.listing).

EC2's DescribeInstances may leave a just-launched instance out for seconds, at worst
minutes ("Eventual consistency in the Amazon EC2 API"). Taking such an instance for gone
would terminate a booting node and buy another. moto lists at once, so the lag is played
here by a provider whose listing leaves new instances out until the test shows them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from conftest import DaemonHarness, RecordingProvider, started_daemon
from daemon.control.listing import absent_means_gone


class LaggingListing(RecordingProvider):
    """A RecordingProvider whose listing shows only the instances in ``shown``."""

    def __init__(self, lag_s: float) -> None:
        super().__init__()
        self.listing_lag_s = lag_s
        self.shown: set[str] = set()
        self.listings = 0

    async def describe(self, tag: str):  # type: ignore[override]
        self.listings += 1
        return [i for i in await super().describe(tag) if i.id in self.shown]


async def _run(tmp_path: Path, provider: LaggingListing):
    from daemon.config import Config
    from daemon.controlnode.store import Store

    sockdir = tempfile.mkdtemp(prefix="sv-", dir="/tmp")
    config = Config.model_validate({
        "pool": {"name": "lag", "min_nodes": 1, "target_nodes": 1, "max_nodes": 2},
        "job": {"id": "job1", "module": "standin_trainer", "target_steps": 1_000_000},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "socket": f"{sockdir}/d.sock",
                   "reconcile_interval_s": 0.05},
    })
    store = Store(tmp_path / "state" / "spotvisord.db").open()
    return config, store, sockdir


async def _listings(h: DaemonHarness, provider: LaggingListing, n: int) -> None:
    start = provider.listings
    await h.until(lambda: provider.listings >= start + n, what=f"{n} more listings")


async def test_a_new_instance_the_listing_leaves_out_is_not_lost_until_it_was_seen(tmp_path: Path) -> None:
    provider = LaggingListing(lag_s=300.0)
    config, store, sockdir = await _run(tmp_path, provider)
    try:
        async with started_daemon(config, provider, store, f"{sockdir}/d.sock") as (sup, api):
            h = DaemonHarness(sup, api, provider, config, f"{sockdir}/d.sock", tmp_path)
            await h.until(lambda: provider.launched, what="the launch")
            await _listings(h, provider, 10)  # ten passes with the new instance missing
            assert h.events("node_lost") == [] and len(provider.launched) == 1 and provider.terminated == set()
            (_, inst), = provider.launched
            provider.shown.add(inst.id)  # the listing catches up
            await _listings(h, provider, 2)
            provider.shown.discard(inst.id)  # listed before, missing now: gone
            await h.until(lambda: h.events("node_lost"), what="the node lost")
            [lost] = h.events("node_lost")
            assert lost.data["reason"] == "instance_gone"
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


async def test_a_provider_whose_listing_is_the_truth_loses_a_missing_instance_at_once(tmp_path: Path) -> None:
    provider = LaggingListing(lag_s=0.0)  # the local provider's case
    config, store, sockdir = await _run(tmp_path, provider)
    try:
        async with started_daemon(config, provider, store, f"{sockdir}/d.sock") as (sup, api):
            h = DaemonHarness(sup, api, provider, config, f"{sockdir}/d.sock", tmp_path)
            await h.until(lambda: h.events("node_lost"), what="the node lost")
    finally:
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@given(listed=st.booleans(), requested_at=st.integers(0, 2**31), age=st.integers(0, 10_000), lag=st.integers(0, 1_000))
def test_an_absent_instance_is_gone_only_once_seen_or_past_the_lag(
        listed: bool, requested_at: int, age: int, lag: int) -> None:
    # whole seconds: exact in floats, so the boundary is the rule's, not rounding's
    gone = absent_means_gone(listed_before=listed, requested_at=float(requested_at),
                             now=float(requested_at + age), lag_s=float(lag))
    if listed:
        assert gone  # it was there and is not: a reclaim shows at once
    else:
        assert gone == (age >= lag)
