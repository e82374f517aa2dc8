"""A new instance a cloud's listing has not shown yet is not a lost node (daemon.control.listing).

EC2's DescribeInstances may leave a just-launched instance out for seconds, at worst
minutes ("Eventual consistency in the Amazon EC2 API"). Taking such an instance for gone
would terminate a booting node and buy another. moto lists at once, so the lag is played
here by a provider whose listing leaves new instances out until the test shows them.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from conftest import DaemonHarness, RecordingProvider, spot_harness
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


async def _listings(h: DaemonHarness, provider: LaggingListing, n: int) -> None:
    start = provider.listings
    await h.until(lambda: provider.listings >= start + n, what=f"{n} more listings")


async def test_a_new_instance_the_listing_leaves_out_is_not_lost_until_it_was_seen(tmp_path: Path) -> None:
    provider = LaggingListing(lag_s=300.0)
    async with spot_harness(tmp_path, provider) as h:
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


async def test_a_provider_whose_listing_is_the_truth_loses_a_missing_instance_at_once(tmp_path: Path) -> None:
    provider = LaggingListing(lag_s=0.0)  # the local provider's case
    async with spot_harness(tmp_path, provider) as h:
        await h.until(lambda: h.events("node_lost"), what="the node lost")


async def test_passes_woken_by_events_list_the_instances_once_a_period(tmp_path: Path) -> None:
    """EC2 meters DescribeInstances per account; a pass woken by an event (a heartbeat, a
    launch done) within the reconcile period of the last listing keeps that listing. A
    pass asked for directly (tests, the scale bench) lists anew."""
    provider = LaggingListing(lag_s=0.0)
    async with spot_harness(tmp_path, provider, reconcile_interval_s=300.0) as h:
        await h.until(lambda: provider.launched and provider.listings, what="the launch")
        passes: list[dict] = []
        run = h.sup.reconcile_once

        async def counted(**kw: float) -> None:
            passes.append(kw)
            await run(**kw)

        h.sup.reconcile_once = counted  # type: ignore[method-assign]
        listed = provider.listings
        for i in range(5):  # woken until it runs (a wake during a pass is cleared with it)
            await h.until(lambda: h.sup.wake() or len(passes) > i, what=f"woken pass {i + 1}")
        assert provider.listings == listed and {p["listing_age_s"] for p in passes} == {300.0}
        await run()
        assert provider.listings == listed + 1


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
