"""AWS IMDSv2 dialect (daemon/gpunode/metadata/aws.py) against its local fake (fake_aws.py),
and the fake itself checked directly with aiohttp against the IMDS documents.

No sleeps: token expiry is driven by an injected clock, timeouts by a request the
fake never answers.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import aiohttp
import pytest

from daemon.gpunode.metadata import (
    MetadataDialect,
    MetadataError,
    MetadataUnavailable,
    Notice,
    NoticeKind,
    notice_id,
)
from daemon.gpunode.metadata.aws import (
    INSTANCE_ACTION_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TTL_HEADER,
    AwsImds,
)
from daemon.providers.local_metadata.aws import FakeImds
from conftest import ManualClock as Clock

DEADLINE = datetime(2017, 9, 18, 8, 22, tzinfo=timezone.utc)


@pytest.fixture
def fake_clock() -> Clock:
    return Clock()


@pytest.fixture
async def fake(fake_clock: Clock) -> AsyncIterator[FakeImds]:
    async with FakeImds(instance_id="i-0abc", clock=fake_clock) as imds:
        yield imds


@pytest.fixture
async def client(fake: FakeImds) -> AsyncIterator[AwsImds]:
    async with AwsImds(fake.url, timeout_s=2.0) as imds:
        yield imds


def puts(fake: FakeImds) -> list[int]:
    """Statuses of the token PUTs the fake saw."""
    return [status for method, path, status in fake.request_log if method == "PUT"]


# -- the dialect -------------------------------------------------------------------


async def test_no_notice_is_none(fake: FakeImds, client: AwsImds) -> None:
    assert await client.poll() is None
    assert await client.poll_rebalance() is None
    assert fake.request_log[0] == ("PUT", TOKEN_PATH, 200)
    assert ("GET", INSTANCE_ACTION_PATH, 404) in fake.request_log


async def test_published_interruption_is_a_notice(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_interruption(action="stop", time=DEADLINE)
    first = await client.poll()
    assert first is not None
    assert first.provider == "aws"
    assert first.kind is NoticeKind.INTERRUPTION
    assert first.action == "stop"
    assert first.deadline == DEADLINE and first.deadline.tzinfo is not None
    assert json.loads(first.raw) == {"action": "stop", "time": "2017-09-18T08:22:00Z"}
    assert first.id == notice_id("aws", NoticeKind.INTERRUPTION, first.raw)
    assert len(first.id) == 16 and int(first.id, 16) >= 0
    assert first.to_dict()["deadline"] == "2017-09-18T08:22:00Z"
    assert Notice.from_dict(json.loads(json.dumps(first.to_dict()))) == first

    again = await client.poll()
    assert again == first and again.id == first.id
    assert fake.token_puts == 1  # the token is reused between polls

    fake.clear()
    assert await client.poll() is None


async def test_default_interruption_is_two_minutes_ahead(fake: FakeImds, client: AwsImds) -> None:
    before = datetime.now(timezone.utc).replace(microsecond=0)
    fake.publish_interruption()
    notice = await client.poll()
    assert notice is not None and notice.action == "terminate"
    assert notice.deadline is not None
    assert timedelta(seconds=119) <= notice.deadline - before <= timedelta(seconds=122)


async def test_different_bodies_different_ids(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_interruption(action="terminate", time=DEADLINE)
    a = await client.poll()
    fake.publish_interruption(action="terminate", time=DEADLINE + timedelta(seconds=1))
    b = await client.poll()
    assert a is not None and b is not None and a.id != b.id


async def test_rebalance_recommendation(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_rebalance(datetime(2020, 10, 27, 8, 22, tzinfo=timezone.utc))
    notice = await client.poll_rebalance()
    assert notice is not None
    assert notice.kind is NoticeKind.REBALANCE
    assert notice.action is None and notice.deadline is None
    assert json.loads(notice.raw) == {"noticeTime": "2020-10-27T08:22:00Z"}
    assert notice.id == notice_id("aws", NoticeKind.REBALANCE, notice.raw)
    assert await client.poll() is None  # a recommendation is not an interruption


async def test_static_items(fake: FakeImds, client: AwsImds) -> None:
    assert await client.get_metadata("instance-id") == "i-0abc"
    assert await client.get_metadata("instance-type") == "p4d.24xlarge"
    assert await client.get_metadata("placement/availability-zone") == "us-east-1a"
    assert await client.get_metadata("no/such/item") is None


# -- tokens ------------------------------------------------------------------------


async def test_expired_token_is_refreshed_not_an_error(
    fake: FakeImds, fake_clock: Clock, client: AwsImds
) -> None:
    """The fake expires the token while the client still believes in it: 401 -> new PUT."""
    fake.publish_interruption(time=DEADLINE)
    assert await client.poll() is not None
    fake_clock.advance(21600)  # the client's own clock is real time: it sees no expiry
    notice = await client.poll()
    assert notice is not None and notice.deadline == DEADLINE
    assert fake.token_puts == 2
    gets = [s for m, p, s in fake.request_log if m == "GET"]
    assert gets == [200, 401, 200]


async def test_token_refreshed_before_expiry(fake: FakeImds, fake_clock: Clock) -> None:
    """Client and fake share a clock: the client renews ahead of expiry, never sees 401."""
    async with AwsImds(fake.url, token_ttl_s=100, clock=fake_clock) as client:
        assert await client.poll() is None
        fake_clock.advance(80)  # < 85 s (the earlier of 90 % and TTL - 15 s): keep it
        assert await client.poll() is None
        assert fake.token_puts == 1
        fake_clock.advance(6)  # 86 s: renew before the fake would expire it at 100 s
        assert await client.poll() is None
        assert fake.token_puts == 2
        fake_clock.advance(99)  # still within the second token's life
        assert await client.poll() is None
    assert all(status != 401 for _, _, status in fake.request_log)


async def test_401_mid_life_refetches_once(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_interruption(time=DEADLINE)
    assert await client.poll() is not None
    fake.forget_tokens()  # IMDS restarted
    notice = await client.poll()
    assert notice is not None and notice.action == "terminate"
    assert puts(fake) == [200, 200]


async def test_persistent_401_is_unavailable_after_one_retry(fake: FakeImds, client: AwsImds) -> None:
    assert await client.poll() is None  # holds a token
    fake.fail_next(2, status=401, path=INSTANCE_ACTION_PATH)
    with pytest.raises(MetadataUnavailable, match="401 again"):
        await client.poll()
    assert puts(fake) == [200, 200]  # exactly one re-fetch
    assert await client.poll() is None  # recovers on the next tick


async def test_concurrent_polls_share_one_token(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_rebalance()
    results = await asyncio.gather(client.poll(), client.poll_rebalance(), client.poll())
    assert results[0] is None and results[2] is None
    assert results[1] is not None and results[1].kind is NoticeKind.REBALANCE
    assert fake.token_puts == 1


# -- no answer is never a notice -----------------------------------------------------


@pytest.mark.parametrize("status", [500, 503, 403])
async def test_error_status_is_unavailable(fake: FakeImds, client: AwsImds, status: int) -> None:
    assert await client.poll() is None
    fake.publish_interruption(time=DEADLINE)
    fake.fail_next(1, status=status)
    with pytest.raises(MetadataUnavailable, match=str(status)):
        await client.poll()
    assert (await client.poll()) is not None  # the fault was one request


async def test_token_put_failure_is_unavailable(fake: FakeImds, client: AwsImds) -> None:
    fake.fail_next(1, status=500)  # hits the very first request: the token PUT
    with pytest.raises(MetadataUnavailable, match="PUT"):
        await client.poll()
    assert await client.poll() is None


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "",
        "[1, 2]",
        '{"time": "2017-09-18T08:22:00Z"}',
        '{"action": "terminate"}',
        '{"action": "terminate", "time": "soon"}',
        '{"action": "terminate", "time": "2017-09-18T08:22:00"}',  # no offset
        '{"action": 3, "time": "2017-09-18T08:22:00Z"}',
    ],
)
async def test_garbage_instance_action_is_unavailable(
    fake: FakeImds, client: AwsImds, body: str
) -> None:
    fake.publish_raw("spot/instance-action", body)
    with pytest.raises(MetadataUnavailable):
        await client.poll()


@pytest.mark.parametrize("body", ["{}", '{"noticeTime": 5}', "<html>"])
async def test_garbage_rebalance_is_unavailable(fake: FakeImds, client: AwsImds, body: str) -> None:
    fake.publish_raw("events/recommendations/rebalance", body)
    with pytest.raises(MetadataUnavailable):
        await client.poll_rebalance()


async def test_unknown_action_is_still_an_interruption(fake: FakeImds, client: AwsImds) -> None:
    fake.publish_raw("spot/instance-action", '{"action": "evict", "time": "2017-09-18T08:22:00Z"}')
    notice = await client.poll()
    assert notice is not None and notice.action == "evict" and notice.deadline == DEADLINE


async def test_connection_refused_is_unavailable() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with AwsImds(f"http://127.0.0.1:{port}", timeout_s=2.0) as client:
        with pytest.raises(MetadataUnavailable) as info:
            await client.poll()
    assert isinstance(info.value.__cause__, aiohttp.ClientError)


async def test_timeout_is_unavailable(fake: FakeImds) -> None:
    async with AwsImds(fake.url, timeout_s=0.05) as client:
        assert await client.poll() is None
        fake.hang_next(1)
        with pytest.raises(MetadataUnavailable, match="timed out"):
            await client.poll()


async def test_unavailable_is_a_metadata_error() -> None:
    assert issubclass(MetadataUnavailable, MetadataError)


# -- construction and lifetime ----------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1, 21601, 1.5, True])
def test_token_ttl_bounds(ttl: object) -> None:
    with pytest.raises(ValueError, match="token_ttl_s"):
        AwsImds(token_ttl_s=ttl)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_timeout_must_be_positive(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        AwsImds(timeout_s=timeout_s)


def test_ttl_bounds_inclusive() -> None:
    AwsImds(token_ttl_s=1)
    AwsImds(token_ttl_s=21600)


async def test_conforms_to_dialect() -> None:
    imds = AwsImds()
    assert isinstance(imds, MetadataDialect)
    assert imds.provider == "aws"
    await imds.aclose()  # never used: nothing to close, no I/O


async def test_borrowed_session_is_not_closed(fake: FakeImds) -> None:
    async with aiohttp.ClientSession() as session:
        client = AwsImds(fake.url, session=session)
        assert await client.poll() is None
        await client.aclose()
        await client.aclose()  # idempotent
        assert not session.closed
        with pytest.raises(RuntimeError, match="closed"):
            await client.poll()


async def test_own_session_is_closed(fake: FakeImds) -> None:
    client = AwsImds(fake.url)
    assert await client.poll() is None
    session = client._session  # noqa: SLF001 - checking ownership
    assert session is not None and not session.closed
    await client.aclose()
    assert session.closed


# -- Notice ----------------------------------------------------------------------------


def test_notice_rejects_naive_deadline() -> None:
    with pytest.raises(ValueError, match="aware"):
        Notice.build(
            provider="aws",
            kind=NoticeKind.INTERRUPTION,
            action="terminate",
            deadline=datetime(2017, 9, 18, 8, 22),
            raw="{}",
        )


def test_notice_id_depends_on_provider_kind_raw() -> None:
    ids = {
        notice_id("aws", NoticeKind.INTERRUPTION, "x"),
        notice_id("aliyun", NoticeKind.INTERRUPTION, "x"),
        notice_id("aws", NoticeKind.REBALANCE, "x"),
        notice_id("aws", NoticeKind.INTERRUPTION, "y"),
    }
    assert len(ids) == 4
    assert notice_id("aws", NoticeKind.INTERRUPTION, "x") == notice_id("aws", "interruption", "x")


# -- the fake, checked directly ---------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _token(http: aiohttp.ClientSession, fake: FakeImds, ttl: str = "60") -> str:
    async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: ttl}) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        return await resp.text()


async def test_fake_read_without_token_is_401(fake: FakeImds, http: aiohttp.ClientSession) -> None:
    async with http.get(fake.url + "/latest/meta-data/instance-id") as resp:
        assert resp.status == 401
    async with http.get(
        fake.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: "forged"}
    ) as resp:
        assert resp.status == 401


@pytest.mark.parametrize("ttl", [None, "", "0", "21601", "-5", "abc", "1.5"])
async def test_fake_token_put_needs_valid_ttl(
    fake: FakeImds, http: aiohttp.ClientSession, ttl: str | None
) -> None:
    headers = {} if ttl is None else {TTL_HEADER: ttl}
    async with http.put(fake.url + TOKEN_PATH, headers=headers) as resp:
        assert resp.status == 400
    assert fake.token_puts == 0


async def test_fake_token_put_rules(fake: FakeImds, http: aiohttp.ClientSession) -> None:
    for ttl in ("1", "21600"):
        assert await _token(http, fake, ttl)
    async with http.put(
        fake.url + TOKEN_PATH, headers={TTL_HEADER: "60", "X-Forwarded-For": "10.0.0.1"}
    ) as resp:
        assert resp.status == 403
    async with http.get(fake.url + TOKEN_PATH) as resp:
        assert resp.status == 405


async def test_fake_serves_documents(
    fake: FakeImds, fake_clock: Clock, http: aiohttp.ClientSession
) -> None:
    token = await _token(http, fake, "60")
    h = {TOKEN_HEADER: token}

    async def get(item: str) -> tuple[int, str, str]:
        async with http.get(fake.url + "/latest/meta-data/" + item, headers=h) as resp:
            return resp.status, resp.content_type, await resp.text()

    assert await get("instance-id") == (200, "text/plain", "i-0abc")
    assert (await get("spot/instance-action"))[0] == 404
    assert (await get("spot/termination-time"))[0] == 404
    assert (await get("instance-action-typo"))[0] == 404
    async with http.get(fake.url + "/nowhere", headers=h) as resp:
        assert resp.status == 404

    fake.publish_interruption(action="terminate", time=DEADLINE)
    assert await get("spot/instance-action") == (
        200,
        "text/plain",
        '{"action": "terminate", "time": "2017-09-18T08:22:00Z"}',
    )
    assert await get("spot/termination-time") == (200, "text/plain", "2017-09-18T08:22:00Z")
    fake.publish_interruption(action="hibernate", time=DEADLINE)
    assert (await get("spot/termination-time"))[0] == 404

    fake_clock.advance(60)  # the token's TTL has run out
    assert (await get("instance-id"))[0] == 401


async def test_fake_optional_tokens_allows_v1_reads(http: aiohttp.ClientSession) -> None:
    async with FakeImds(http_tokens="optional") as fake:
        async with http.get(fake.url + "/latest/meta-data/instance-id") as resp:
            assert resp.status == 200
        async with http.get(
            fake.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: "bad"}
        ) as resp:
            assert resp.status == 401


async def test_fake_lifecycle() -> None:
    fake = FakeImds()
    with pytest.raises(RuntimeError, match="start"):
        _ = fake.url
    await fake.aclose()  # before start: fine
    await fake.start()
    assert fake.url.startswith("http://127.0.0.1:")
    with pytest.raises(RuntimeError, match="already started"):
        await fake.start()
    fake.hang_next(1)
    async with AwsImds(fake.url, timeout_s=5.0) as client:
        pending = asyncio.create_task(client.poll())
        await asyncio.wait_for(fake.wait_hanging(), timeout=5)  # the token PUT is held
        loop = asyncio.get_running_loop()
        started = loop.time()
        await fake.aclose()  # releases the held request, then stops
        assert loop.time() - started < 0.9  # did not wait out the 1 s shutdown timeout
        await fake.aclose()
        with pytest.raises(MetadataUnavailable):
            await pending


def test_fake_rejects_bad_publish() -> None:
    fake = FakeImds()
    with pytest.raises(ValueError, match="action"):
        fake.publish_interruption(action="explode")
    with pytest.raises(ValueError, match="aware"):
        fake.publish_interruption(time=datetime(2017, 9, 18, 8, 22))
    with pytest.raises(ValueError):
        fake.fail_next(1, status=200)


async def test_fake_fail_next_by_path(fake: FakeImds, client: AwsImds) -> None:
    fake.fail_next(1, status=503, path="/latest/meta-data/instance-id")
    assert await client.poll() is None  # PUT and instance-action unaffected
    with pytest.raises(MetadataUnavailable, match="503"):
        await client.get_metadata("instance-id")
    assert await client.get_metadata("instance-id") == "i-0abc"
