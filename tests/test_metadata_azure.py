"""What only the Azure Scheduled Events dialect (daemon/gpunode/metadata/azure.py) and its
local fake (daemon/providers/local_metadata/azure.py) do: the events document (resources,
event types, incarnation, api-versions), the ``StartRequests`` approval and a started
event's deadline, checked against the Scheduled Events and IMDS documents. What every
dialect does alike (notices, faults, lifetime) is the contract in
tests/metadata_contract.py, run by tests/test_metadata_dialects.py.

No sleeps: the first-seen stamp uses an injected clock.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import aiohttp
import pytest

from daemon.gpunode.metadata import MetadataUnavailable, Notice, NoticeKind, notice_id
from daemon.gpunode.metadata.azure import SCHEDULED_EVENTS_PATH, AzureScheduledEvents, parse_rfc1123
from daemon.providers.local_metadata.azure import FakeAzureScheduledEvents, format_rfc1123
from conftest import ManualClock as Clock
from metadata_contract import AZURE, Dialect
import metadata_contract

VM = "vm-spot-0"
DEADLINE = datetime(2026, 4, 11, 22, 26, 58, tzinfo=timezone.utc)


# the contract's fixtures, under their own names (pytest finds fixtures by module attribute)
client, fake, fake_clock, http = (metadata_contract.client, metadata_contract.fake,
                                  metadata_contract.fake_clock, metadata_contract.http)


@pytest.fixture
def dialect() -> Dialect:
    return AZURE


def _preempt_id(fake: FakeAzureScheduledEvents) -> str:
    (event,) = [e for e in fake.events if e["EventType"] == "Preempt" and VM in e["Resources"]]
    return event["EventId"]


# -- the dialect -------------------------------------------------------------------


async def test_no_events_is_none_over_many_polls(
    fake: FakeAzureScheduledEvents, client: AzureScheduledEvents
) -> None:
    for _ in range(20):
        assert await client.poll() is None
    assert client.last_incarnation == 1
    gets = [(m, p, s) for m, p, s, _ in fake.request_log]
    assert gets == [("GET", SCHEDULED_EVENTS_PATH, 200)] * 20


async def test_preempt_is_a_notice_with_notbefore_deadline(
    fake: FakeAzureScheduledEvents, client: AzureScheduledEvents
) -> None:
    fake.publish_interruption(time=DEADLINE)
    event_id = _preempt_id(fake)
    first = await client.poll()
    assert first is not None
    assert first.provider == "azure"
    assert first.kind is NoticeKind.INTERRUPTION
    assert first.action == "preempt"
    assert first.deadline == DEADLINE and first.deadline.tzinfo is not None
    raw = json.loads(first.raw)
    assert raw["EventId"] == event_id and raw["EventType"] == "Preempt"
    assert raw["NotBefore"] == "Sat, 11 Apr 2026 22:26:58 GMT"
    assert raw["Resources"] == [VM] and raw["EventSource"] == "Platform"
    assert raw["DurationInSeconds"] == -1 and raw["EventStatus"] == "Scheduled"
    assert first.id == notice_id("azure", NoticeKind.INTERRUPTION, event_id)
    assert Notice.from_dict(json.loads(json.dumps(first.to_dict()))) == first
    assert client.last_incarnation == 2

    for _ in range(5):
        again = await client.poll()
        assert again == first and again.id == first.id

    fake.clear()
    assert await client.poll() is None


async def test_event_for_another_resource_is_ignored(fake: FakeAzureScheduledEvents) -> None:
    fake.publish_event("Preempt", resources=["vm-spot-7"], not_before=DEADLINE)
    fake.publish_event("Freeze", not_before=DEADLINE, duration_s=5)
    fake.publish_event("Reboot", status="Started")
    async with AzureScheduledEvents(fake.url, resource_name=VM) as mine:
        for _ in range(3):
            assert await mine.poll() is None
    # Without a resource name every Preempt counts (a standalone VM sees only its own).
    async with AzureScheduledEvents(fake.url) as anyone:
        notice = await anyone.poll()
        assert notice is not None and json.loads(notice.raw)["Resources"] == ["vm-spot-7"]
    # Resource names compare case-insensitively.
    async with AzureScheduledEvents(fake.url, resource_name="VM-SPOT-7") as upper:
        assert await upper.poll() is not None


async def test_earliest_preempt_wins(fake: FakeAzureScheduledEvents) -> None:
    later = fake.publish_event("Preempt", resources=["a", VM], not_before=DEADLINE + timedelta(seconds=9))
    sooner = fake.publish_event("Preempt", resources=[VM, "b"], not_before=DEADLINE)
    async with AzureScheduledEvents(fake.url, resource_name=VM) as client:
        notice = await client.poll()
    assert notice is not None and json.loads(notice.raw)["EventId"] == sooner != later


async def test_acknowledge_approves_the_event(
    fake: FakeAzureScheduledEvents, client: AzureScheduledEvents
) -> None:
    fake.publish_interruption(time=DEADLINE)
    event_id = _preempt_id(fake)
    notice = await client.poll()
    assert notice is not None
    incarnation = fake.incarnation

    await client.acknowledge(notice)
    assert fake.acknowledged == [event_id]
    (event,) = fake.events
    assert event["EventStatus"] == "Started" and event["NotBefore"] == ""
    assert fake.incarnation == incarnation + 1
    assert ("POST", SCHEDULED_EVENTS_PATH, 200) in [r[:3] for r in fake.request_log]

    # Started, NotBefore blank: still the same notice id, and the deadline seen before.
    started = await client.poll()
    assert started is not None and started.id == notice.id and started.deadline == DEADLINE
    assert json.loads(started.raw)["EventStatus"] == "Started"

    await client.acknowledge(notice)  # a valid id is always 200, even if approved already
    assert fake.acknowledged == [event_id, event_id]
    assert fake.incarnation == incarnation + 1


async def test_started_without_prior_sighting_gets_thirty_seconds(
    fake: FakeAzureScheduledEvents,
) -> None:
    clock = Clock(50.0)
    fake.publish_event("Preempt", status="Started")
    before = datetime.now(timezone.utc).replace(microsecond=0)
    async with AzureScheduledEvents(fake.url, resource_name=VM, clock=clock) as client:
        first = await client.poll()
        assert first is not None and first.deadline is not None
        assert timedelta(seconds=29) <= first.deadline - before <= timedelta(seconds=32)
        event_id = json.loads(first.raw)["EventId"]
        assert client.first_seen_s(event_id) == 50.0
        clock.advance(5)
        second = await client.poll()
        assert second == first  # the fallback deadline does not drift between polls
        assert client.first_seen_s(event_id) == 50.0
        fake.clear()
        assert await client.poll() is None
        assert client.first_seen_s(event_id) is None


async def test_acknowledge_errors(fake: FakeAzureScheduledEvents, client: AzureScheduledEvents) -> None:
    fake.publish_interruption(time=DEADLINE)
    notice = await client.poll()
    assert notice is not None
    fake.fail_next(1, status=500, path=SCHEDULED_EVENTS_PATH)
    with pytest.raises(MetadataUnavailable, match="500"):
        await client.acknowledge(notice)
    fake.clear()  # the event is gone: the fake refuses the unknown id
    with pytest.raises(MetadataUnavailable, match="400"):
        await client.acknowledge(notice)
    assert fake.acknowledged == []
    aws_like = Notice.build(
        provider="aws", kind=NoticeKind.INTERRUPTION, action="terminate", deadline=DEADLINE, raw="{}"
    )
    with pytest.raises(ValueError, match="Azure"):
        await client.acknowledge(aws_like)


# -- construction and lifetime ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"api_version": ""}, "api_version"),
        ({"resource_name": ""}, "resource_name"),
    ],
)
def test_constructor_checks(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AzureScheduledEvents(**kwargs)


async def test_the_url_polled() -> None:
    events = AzureScheduledEvents()
    assert events.url == "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
    await events.aclose()  # never used: nothing to close, no I/O


def test_parse_rfc1123() -> None:
    assert parse_rfc1123("Mon, 11 Apr 2022 22:26:58 GMT") == datetime(
        2022, 4, 11, 22, 26, 58, tzinfo=timezone.utc
    )
    assert format_rfc1123(DEADLINE) == "Sat, 11 Apr 2026 22:26:58 GMT"
    assert parse_rfc1123(format_rfc1123(DEADLINE)) == DEADLINE
    for bad in ("", "soon", "2026-04-11T22:26:58Z", "Sat, 11 Apr 2026 22:26:58 -0000"):
        with pytest.raises(ValueError):
            parse_rfc1123(bad)


# -- the fake, checked directly ---------------------------------------------------------


async def test_fake_requires_metadata_header(
    fake: FakeAzureScheduledEvents, http: aiohttp.ClientSession
) -> None:
    url = fake.url + SCHEDULED_EVENTS_PATH
    async with http.get(url, params={"api-version": "2020-07-01"}) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/json"
        assert "metadata header" in (await resp.json())["error"]
    async with http.get(url, params={"api-version": "2020-07-01"}, headers={"Metadata": "false"}) as resp:
        assert resp.status == 400
    async with http.get(url, params={"api-version": "2020-07-01"}, headers={"Metadata": "true"}) as resp:
        assert resp.status == 200
        assert await resp.json() == {"DocumentIncarnation": 1, "Events": []}


async def test_fake_request_rules(fake: FakeAzureScheduledEvents, http: aiohttp.ClientSession) -> None:
    url = fake.url + SCHEDULED_EVENTS_PATH
    h = {"Metadata": "true"}
    async with http.get(url, headers=h) as resp:  # no api-version
        assert resp.status == 400
        body = await resp.json()
        assert "api-version was not specified" in body["error"] and body["newest-versions"]
    async with http.get(url + "?api-version=2020-07-01&api-version=2019-01-01", headers=h) as resp:
        assert resp.status == 400  # duplicate query parameter names
    async with http.get(url, params={"api-version": "1999-01-01"}, headers=h) as resp:
        assert resp.status == 400
    q = {"api-version": "2020-07-01"}
    async with http.get(url, params=q, headers={**h, "X-Forwarded-For": "10.0.0.1"}) as resp:
        assert resp.status == 400
    async with http.put(url, params=q, headers=h) as resp:
        assert resp.status == 405
    async with http.get(fake.url + "/metadata/nowhere", params=q, headers=h) as resp:
        assert resp.status == 404


async def test_fake_document_and_versions(
    fake: FakeAzureScheduledEvents, http: aiohttp.ClientSession
) -> None:
    url = fake.url + SCHEDULED_EVENTS_PATH
    h = {"Metadata": "true"}

    async def get(version: str) -> dict:
        async with http.get(url, params={"api-version": version}, headers=h) as resp:
            assert resp.status == 200 and resp.content_type == "application/json"
            return await resp.json()

    fake.publish_interruption(time=DEADLINE)
    doc = await get("2020-07-01")
    assert doc["DocumentIncarnation"] == 2
    (event,) = doc["Events"]
    assert event == {
        "EventId": event["EventId"],
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": [VM],
        "EventStatus": "Scheduled",
        "NotBefore": "Sat, 11 Apr 2026 22:26:58 GMT",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }
    assert event["EventId"] == event["EventId"].upper() and len(event["EventId"]) == 36
    old = (await get("2019-01-01"))["Events"][0]
    assert "EventSource" not in old and "DurationInSeconds" not in old and "Description" not in old
    assert (await get("2017-08-01"))["Events"] == []  # Preempt appeared in 2017-11-01

    fake.publish_interruption(time=DEADLINE + timedelta(minutes=1))  # replaces the earlier one
    doc = await get("2020-07-01")
    assert doc["DocumentIncarnation"] == 3 and len(doc["Events"]) == 1
    assert doc["Events"][0]["EventId"] != event["EventId"]


async def test_fake_start_requests(fake: FakeAzureScheduledEvents, http: aiohttp.ClientSession) -> None:
    url = fake.url + SCHEDULED_EVENTS_PATH
    q = {"api-version": "2020-07-01"}
    h = {"Metadata": "true"}
    event_id = fake.publish_event("Freeze", not_before=DEADLINE, duration_s=5)

    async def post(body: str, headers: dict = h) -> int:
        async with http.post(url, params=q, headers=headers, data=body) as resp:
            return resp.status

    assert await post(json.dumps({"StartRequests": [{"EventId": event_id}]}), {}) == 400  # no header
    assert await post("{not json") == 400
    assert await post(json.dumps({"StartRequests": []})) == 400
    assert await post(json.dumps({"StartRequests": [{"Id": event_id}]})) == 400
    assert await post(json.dumps({"StartRequests": [{"EventId": "F020BA2E-0000"}]})) == 400
    assert fake.acknowledged == [] and fake.events[0]["EventStatus"] == "Scheduled"
    assert await post(json.dumps({"StartRequests": [{"EventId": event_id.lower()}]})) == 200
    assert fake.acknowledged == [event_id]
    assert fake.events[0]["EventStatus"] == "Started" and fake.events[0]["NotBefore"] == ""


async def test_fake_hooks() -> None:
    fake = FakeAzureScheduledEvents()
    with pytest.raises(ValueError, match="action"):
        fake.publish_interruption(action="")
    with pytest.raises(ValueError, match="event_type"):
        fake.publish_event("Explode")
    with pytest.raises(ValueError):
        FakeAzureScheduledEvents(vm_name="")
    assert fake.published_at is None
    fake.publish_raw("{}")
    assert fake.published_at is not None
    fake.clear()
    assert fake.published_at is None
