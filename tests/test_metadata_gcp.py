"""What only the GCP metadata dialect (daemon/gpunode/metadata/gcp.py) and its local fake
(daemon/providers/local_metadata/gcp.py) do: hanging GETs (``wait_for_change``,
``last_etag``, ``timeout_sec``), the first-sighting deadline, the maintenance event and the
``Metadata-Flavor`` header. What every dialect does alike (notices, faults, lifetime) is
the contract in tests/metadata_contract.py, run by tests/test_metadata_dialects.py.

No sleeps as synchronization: a hanging GET is known to be parked through
``FakeGcpMetadata.wait_watchers``; timeouts come from requests the fake never answers.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from daemon.gpunode.metadata import MetadataUnavailable
from daemon.providers.local_metadata.gcp import FakeGcpMetadata
from daemon.gpunode.metadata.gcp import (
    FLAVOR_HEADER,
    MAINTENANCE_EVENT_PATH,
    PREEMPTED_PATH,
    GcpMetadata,
)
from conftest import ManualClock as Clock
from metadata_contract import GCP, Dialect
import metadata_contract

GOOGLE = {FLAVOR_HEADER: "Google"}


# the contract's fixtures, under their own names (pytest finds fixtures by module attribute)
client, fake, fake_clock, http = (metadata_contract.client, metadata_contract.fake,
                                  metadata_contract.fake_clock, metadata_contract.http)


@pytest.fixture
def dialect() -> Dialect:
    return GCP


def preempted_gets(fake: FakeGcpMetadata) -> list[tuple[str, int]]:
    """``(path_qs, status)`` of the requests for ``instance/preempted``."""
    return [(pq, s) for _, pq, s in fake.request_log if pq.startswith(PREEMPTED_PATH)]


# -- the dialect: plain polls ----------------------------------------------------------------


async def test_false_is_none_over_many_polls(fake: FakeGcpMetadata, client: GcpMetadata) -> None:
    for _ in range(20):
        assert await client.poll() is None
    assert preempted_gets(fake) == [(PREEMPTED_PATH, 200)] * 20  # wait_s=0: no hanging GETs


async def test_notice_is_stable_across_polls(fake: FakeGcpMetadata) -> None:
    clock = Clock()
    async with GcpMetadata(fake.url, clock=clock) as client:
        fake.publish_interruption()
        first = await client.poll()
        assert client.preempted_seen_at == 1000.0
        clock.advance(5)
        second = await client.poll()
        third = await client.poll()
        assert first is not None and first == second == third  # same id and same deadline
        assert client.preempted_seen_at == 1000.0  # first sighting, not the latest
        fake.clear()
        assert await client.poll() is None
        assert client.preempted_seen_at is None


async def test_maintenance_event(fake: FakeGcpMetadata, client: GcpMetadata) -> None:
    assert await client.poll_maintenance() == "NONE"
    for event in ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE", "NONE"):
        fake.publish_maintenance(event)
        assert await client.poll_maintenance() == event
    assert await client.poll() is None  # maintenance is not a preemption
    fake.publish_raw("instance/maintenance-event", "<html>oops</html>")
    with pytest.raises(MetadataUnavailable, match="maintenance-event"):
        await client.poll_maintenance()


# -- the dialect: hanging GETs ---------------------------------------------------------------


async def test_publish_during_hanging_get_is_seen_promptly(fake: FakeGcpMetadata) -> None:
    loop = asyncio.get_running_loop()
    async with GcpMetadata(fake.url, wait_s=5, timeout_s=2.0) as client:
        assert await client.poll() is None  # plain GET: learns FALSE and its ETag
        pending = asyncio.create_task(client.poll())
        await asyncio.wait_for(fake.wait_watchers(1), timeout=2)  # parked on the server
        assert not pending.done()
        started = loop.time()
        fake.publish_interruption()
        notice = await asyncio.wait_for(pending, timeout=3)
        assert loop.time() - started < 1.0  # nowhere near wait_s
        assert notice is not None and notice.raw == "TRUE"
        first, hanging = preempted_gets(fake)
        assert first == (PREEMPTED_PATH, 200)
        assert hanging[1] == 200
        assert "wait_for_change=true" in hanging[0]
        assert "timeout_sec=5" in hanging[0] and "last_etag=" in hanging[0]

        # Already preempted: no more hanging, the same notice at once.
        started = loop.time()
        again = await client.poll()
        assert again == notice and loop.time() - started < 1.0
        assert fake.watchers == 0


async def test_hanging_get_expiry_is_none_not_an_error(fake: FakeGcpMetadata) -> None:
    loop = asyncio.get_running_loop()
    async with GcpMetadata(fake.url, wait_s=1, timeout_s=2.0) as client:
        assert await client.poll() is None
        started = loop.time()
        assert await client.poll() is None  # timeout_sec=1 expired: current value, FALSE
        assert 0.9 <= loop.time() - started < 2.5
        fake.publish_interruption()
        assert await client.poll() is not None  # last_etag differs: returns at once


async def test_change_between_polls_is_not_missed(fake: FakeGcpMetadata) -> None:
    """last_etag makes the next hanging GET return at once if the value changed meanwhile."""
    loop = asyncio.get_running_loop()
    async with GcpMetadata(fake.url, wait_s=5) as client:
        assert await client.poll() is None
        fake.publish_interruption()  # no request in flight
        started = loop.time()
        assert await client.poll() is not None
        assert loop.time() - started < 1.0


async def test_hanging_get_that_never_answers_is_unavailable(fake: FakeGcpMetadata) -> None:
    """A hanging GET is bounded by timeout_sec + timeout_s, then the next one still works."""
    loop = asyncio.get_running_loop()
    async with GcpMetadata(fake.url, wait_s=0.5, timeout_s=0.1) as client:
        assert await client.poll() is None
        fake.hang_next(1)
        started = loop.time()
        with pytest.raises(MetadataUnavailable, match="timed out after 1.1 s"):
            await client.poll()
        assert loop.time() - started < 2.0
        fake.publish_interruption()
        assert await client.poll() is not None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"wait_s": -1.0}, "wait_s"),
        ({"wait_s": float("nan")}, "wait_s"),
        ({"wait_s": float("inf")}, "wait_s"),
    ],
)
def test_bad_options(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GcpMetadata(**kwargs)  # type: ignore[arg-type]


# -- the fake, checked directly ---------------------------------------------------------------


async def test_fake_requires_metadata_flavor(fake: FakeGcpMetadata, http: aiohttp.ClientSession) -> None:
    async with http.get(fake.url + PREEMPTED_PATH) as resp:
        assert resp.status == 403
    async with http.get(fake.url + PREEMPTED_PATH, headers={FLAVOR_HEADER: "google"}) as resp:
        assert resp.status == 403
    async with http.get(fake.url + PREEMPTED_PATH, headers={**GOOGLE, "X-Forwarded-For": "10.0.0.1"}) as resp:
        assert resp.status == 403
    async with http.get(fake.url + PREEMPTED_PATH, headers=GOOGLE) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        assert resp.headers[FLAVOR_HEADER] == "Google"
        assert await resp.text() == "FALSE"


async def test_fake_serves_documents(fake: FakeGcpMetadata, http: aiohttp.ClientSession) -> None:
    async def get(path: str, **params: str) -> tuple[int, str, str | None]:
        async with http.get(fake.url + path, headers=GOOGLE, params=params) as resp:
            return resp.status, await resp.text(), resp.headers.get("ETag")

    status, body, etag_false = await get(PREEMPTED_PATH)
    assert (status, body) == (200, "FALSE") and etag_false and len(etag_false) == 16
    assert (await get(MAINTENANCE_EVENT_PATH))[:2] == (200, "NONE")
    assert (await get("/computeMetadata/v1/instance/id"))[:2] == (200, "4242")
    assert (await get("/computeMetadata/v1/instance/nothing"))[0] == 404
    assert (await get("/elsewhere"))[0] == 404

    fake.publish_interruption()
    status, body, etag_true = await get(PREEMPTED_PATH)
    assert (status, body) == (200, "TRUE") and etag_true != etag_false
    # last_etag differs from the current one: a hanging GET answers at once.
    answer = await get(PREEMPTED_PATH, wait_for_change="true", last_etag=etag_false, timeout_sec="30")
    assert answer[:2] == (200, "TRUE")
    assert (await get(PREEMPTED_PATH, wait_for_change="true", timeout_sec="1.5"))[0] == 400


async def test_fake_hanging_get_without_last_etag_waits_for_next_change(
    fake: FakeGcpMetadata, http: aiohttp.ClientSession
) -> None:
    async def hang() -> str:
        params = {"wait_for_change": "true"}
        async with http.get(fake.url + PREEMPTED_PATH, headers=GOOGLE, params=params) as resp:
            assert resp.status == 200
            return await resp.text()

    pending = asyncio.create_task(hang())
    await asyncio.wait_for(fake.wait_watchers(1), timeout=2)
    fake.publish_interruption()
    assert await asyncio.wait_for(pending, timeout=2) == "TRUE"


async def test_fake_timeout_sec_returns_current_value(
    fake: FakeGcpMetadata, http: aiohttp.ClientSession
) -> None:
    async with http.get(fake.url + PREEMPTED_PATH, headers=GOOGLE) as resp:
        etag = resp.headers["ETag"]
    async with http.get(
        fake.url + PREEMPTED_PATH,
        headers=GOOGLE,
        params={"wait_for_change": "true", "last_etag": etag, "timeout_sec": "0"},
    ) as resp:
        assert resp.status == 200 and await resp.text() == "FALSE" and resp.headers["ETag"] == etag


async def test_fake_lifecycle_releases_hanging_requests(http: aiohttp.ClientSession) -> None:
    fake = FakeGcpMetadata()
    with pytest.raises(RuntimeError, match="start"):
        _ = fake.url
    await fake.aclose()  # before start: fine
    await fake.start()
    with pytest.raises(RuntimeError, match="already started"):
        await fake.start()
    url = fake.url

    async def watch() -> int:
        async with http.get(url + PREEMPTED_PATH, headers=GOOGLE, params={"wait_for_change": "true"}) as resp:
            return resp.status

    fake.hang_next(1)
    async with GcpMetadata(url, timeout_s=5.0) as client:
        held = asyncio.create_task(client.poll())
        await asyncio.wait_for(fake.wait_hanging(), timeout=2)
        watching = asyncio.create_task(watch())
        await asyncio.wait_for(fake.wait_watchers(1), timeout=2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await fake.aclose()  # answers both parked requests, then stops
        assert loop.time() - started < 0.9  # did not wait out the 1 s shutdown timeout
        await fake.aclose()
        assert await watching == 503
        with pytest.raises(MetadataUnavailable, match="503"):
            await held


def test_fake_rejects_bad_input() -> None:
    fake = FakeGcpMetadata()
    with pytest.raises(ValueError, match="action"):
        fake.publish_interruption(action="")
    with pytest.raises(ValueError, match="event"):
        fake.publish_maintenance("REBOOT")


