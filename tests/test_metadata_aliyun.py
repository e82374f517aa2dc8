"""Alibaba Cloud ECS metadata dialect (daemon/gpunode/metadata/aliyun.py) against its local fake
(fake_aliyun.py), and the fake itself checked directly with aiohttp.

No sleeps: token expiry is driven by an injected clock, timeouts by a request the
fake never answers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import aiohttp
import pytest

from daemon.gpunode.metadata import MetadataDialect, MetadataUnavailable, Notice, NoticeKind, notice_id
from daemon.gpunode.metadata.aliyun import (
    TERMINATION_TIME_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TTL_HEADER,
    AliyunMetadata,
)
from daemon.providers.local_metadata.aliyun import FakeAliyunMetadata
from conftest import ManualClock as Clock

DEADLINE = datetime(2015, 1, 5, 18, 2, tzinfo=timezone.utc)
STAMP = "2015-01-05T18:02:00Z"


@pytest.fixture
def fake_clock() -> Clock:
    return Clock()


@pytest.fixture
async def fake(fake_clock: Clock) -> AsyncIterator[FakeAliyunMetadata]:
    """A hardened-only fake (tokens required)."""
    async with FakeAliyunMetadata(instance_id="i-bp1abc", hardened=True, clock=fake_clock) as md:
        yield md


@pytest.fixture
async def client(fake: FakeAliyunMetadata) -> AsyncIterator[AliyunMetadata]:
    async with AliyunMetadata(fake.url, hardened=True, timeout_s=2.0) as md:
        yield md


def puts(fake: FakeAliyunMetadata) -> list[int]:
    """Statuses of the token PUTs the fake saw."""
    return [status for method, _, status in fake.request_log if method == "PUT"]


def gets(fake: FakeAliyunMetadata) -> list[int]:
    return [status for method, _, status in fake.request_log if method == "GET"]


# -- the dialect -------------------------------------------------------------------


@pytest.mark.parametrize("hardened", [False, True])
async def test_no_notice_is_none_over_many_polls(hardened: bool) -> None:
    async with FakeAliyunMetadata(hardened=hardened) as fake:
        async with AliyunMetadata(fake.url, hardened=hardened) as client:
            for _ in range(25):
                assert await client.poll() is None
        assert gets(fake) == [404] * 25
        assert fake.token_puts == (1 if hardened else 0)
        assert fake.published_at is None


async def test_published_interruption_is_a_notice(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    assert await client.poll() is None
    fake.publish_interruption(time=DEADLINE)
    assert fake.published_at is not None
    first = await client.poll()
    assert first is not None
    assert first.provider == "aliyun"
    assert first.kind is NoticeKind.INTERRUPTION
    assert first.action == "terminate"
    assert first.deadline == DEADLINE and first.deadline.tzinfo is not None
    assert first.raw == STAMP
    assert first.id == notice_id("aliyun", NoticeKind.INTERRUPTION, STAMP)
    assert first.id != notice_id("aws", NoticeKind.INTERRUPTION, STAMP)
    assert Notice.from_dict(json.loads(json.dumps(first.to_dict()))) == first

    for _ in range(5):
        again = await client.poll()
        assert again == first and again is not None and again.id == first.id
    assert fake.token_puts == 1  # the token is reused between polls

    fake.clear()
    assert fake.published_at is None
    assert await client.poll() is None


async def test_default_interruption_is_five_minutes_ahead(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    before = datetime.now(timezone.utc).replace(microsecond=0)
    fake.publish_interruption()
    notice = await client.poll()
    assert notice is not None and notice.action == "terminate" and notice.deadline is not None
    assert timedelta(seconds=299) <= notice.deadline - before <= timedelta(seconds=302)


async def test_action_is_ignored(fake: FakeAliyunMetadata, client: AliyunMetadata) -> None:
    fake.publish_interruption("stop", DEADLINE)
    notice = await client.poll()
    assert notice is not None and notice.action == "terminate" and notice.raw == STAMP


async def test_different_times_different_ids(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    fake.publish_interruption(time=DEADLINE)
    a = await client.poll()
    fake.publish_interruption(time=DEADLINE + timedelta(seconds=1))
    b = await client.poll()
    assert a is not None and b is not None and a.id != b.id


async def test_offset_timestamp_is_normalised(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    fake.publish_raw("instance/spot/termination-time", "2015-01-06T02:02:00+08:00")
    notice = await client.poll()
    assert notice is not None and notice.deadline == DEADLINE
    assert notice.raw == "2015-01-06T02:02:00+08:00"


async def test_static_items(fake: FakeAliyunMetadata, client: AliyunMetadata) -> None:
    assert await client.get_metadata("instance-id") == "i-bp1abc"
    assert await client.get_metadata("instance/instance-type") == "ecs.gn7i-c8g1.2xlarge"
    assert await client.get_metadata("region-id") == "cn-hangzhou"
    assert await client.get_metadata("zone-id") == "cn-hangzhou-h"
    assert await client.get_metadata("no/such/item") is None


# -- tokens (hardened mode) -------------------------------------------------------------


async def test_token_refreshed_before_expiry_mid_run(
    fake: FakeAliyunMetadata, fake_clock: Clock
) -> None:
    """Client and fake share a clock: the client renews ahead of expiry, never sees 401."""
    fake.publish_interruption(time=DEADLINE)
    async with AliyunMetadata(fake.url, hardened=True, token_ttl_s=100, clock=fake_clock) as client:
        first = await client.poll()
        fake_clock.advance(80)  # < 85 s (the earlier of 90 % and TTL - 15 s): keep it
        assert await client.poll() == first
        assert fake.token_puts == 1
        fake_clock.advance(6)  # 86 s: renew before the fake expires it at 100 s
        assert await client.poll() == first
        assert fake.token_puts == 2
        fake_clock.advance(84)  # within the second token's refresh window
        assert await client.poll() == first
        assert fake.token_puts == 2
        fake_clock.advance(2)  # past it: a third token, still no 401
        assert await client.poll() == first
    assert puts(fake) == [200, 200, 200]
    assert 401 not in gets(fake)


async def test_expired_token_is_refreshed_not_an_error(
    fake: FakeAliyunMetadata, fake_clock: Clock, client: AliyunMetadata
) -> None:
    """Only the fake's clock moves: the client still believes in its token -> 401 -> new PUT."""
    fake.publish_interruption(time=DEADLINE)
    assert await client.poll() is not None
    fake_clock.advance(21600)
    notice = await client.poll()
    assert notice is not None and notice.deadline == DEADLINE
    assert fake.token_puts == 2
    assert gets(fake) == [200, 401, 200]


async def test_forgotten_tokens_refetch_once(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    fake.publish_interruption(time=DEADLINE)
    assert await client.poll() is not None
    fake.forget_tokens()  # the metadata server restarted
    notice = await client.poll()
    assert notice is not None and notice.deadline == DEADLINE
    assert puts(fake) == [200, 200]
    assert gets(fake) == [200, 401, 200]


@pytest.mark.parametrize("status", [401, 403])
async def test_persistent_rejection_is_unavailable_after_one_retry(
    fake: FakeAliyunMetadata, client: AliyunMetadata, status: int
) -> None:
    assert await client.poll() is None  # holds a token
    fake.fail_next(2, status=status, path=TERMINATION_TIME_PATH)
    with pytest.raises(MetadataUnavailable, match=f"{status} again"):
        await client.poll()
    assert puts(fake) == [200, 200]  # exactly one re-fetch
    assert await client.poll() is None  # recovers on the next tick


async def test_token_put_failure_is_unavailable(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    fake.fail_next(1, status=500)  # the very first request: the token PUT
    with pytest.raises(MetadataUnavailable, match="PUT"):
        await client.poll()
    assert await client.poll() is None


async def test_concurrent_polls_share_one_token(
    fake: FakeAliyunMetadata, client: AliyunMetadata
) -> None:
    results = await asyncio.gather(*(client.poll() for _ in range(5)))
    assert results == [None] * 5
    assert fake.token_puts == 1


async def test_normal_client_against_hardened_only_instance(fake: FakeAliyunMetadata) -> None:
    async with AliyunMetadata(fake.url) as client:
        with pytest.raises(MetadataUnavailable, match="hardening"):
            await client.poll()
    assert fake.token_puts == 0


# -- no answer is never a notice; the next real one is still seen -------------------------


async def _then_notice_is_detected(fake: FakeAliyunMetadata, client: AliyunMetadata) -> None:
    fake.clear()
    fake.publish_interruption(time=DEADLINE)
    notice = await client.poll()
    assert notice is not None and notice.deadline == DEADLINE


@pytest.mark.parametrize("status", [500, 503])
async def test_error_status_is_unavailable(
    fake: FakeAliyunMetadata, client: AliyunMetadata, status: int
) -> None:
    assert await client.poll() is None
    fake.fail_next(1, status=status, path=TERMINATION_TIME_PATH)
    with pytest.raises(MetadataUnavailable, match=str(status)):
        await client.poll()
    await _then_notice_is_detected(fake, client)


async def test_timeout_is_unavailable(fake: FakeAliyunMetadata) -> None:
    async with AliyunMetadata(fake.url, hardened=True, timeout_s=0.05) as client:
        assert await client.poll() is None
        fake.hang_next(1)
        with pytest.raises(MetadataUnavailable, match="timed out"):
            await client.poll()
        await _then_notice_is_detected(fake, client)


@pytest.mark.parametrize(
    "body",
    [
        "",
        "soon",
        "2015-01-05T18:02:00",  # no offset
        "2015-13-05T18:02:00Z",
        '{"action": "terminate", "time": "2015-01-05T18:02:00Z"}',  # the AWS document
        "<html>busy</html>",
    ],
)
async def test_garbage_body_is_unavailable(
    fake: FakeAliyunMetadata, client: AliyunMetadata, body: str
) -> None:
    fake.publish_raw("instance/spot/termination-time", body)
    with pytest.raises(MetadataUnavailable, match="termination-time"):
        await client.poll()
    await _then_notice_is_detected(fake, client)


async def test_connection_refused_is_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with AliyunMetadata(url, hardened=True, timeout_s=2.0) as client:
        with pytest.raises(MetadataUnavailable) as info:
            await client.poll()
        assert isinstance(info.value.__cause__, aiohttp.ClientError)
        # The endpoint comes (back) up on that port: the notice is then seen.
        async with FakeAliyunMetadata(hardened=True, port=port) as fake:
            fake.publish_interruption(time=DEADLINE)
            notice = await client.poll()
            assert notice is not None and notice.deadline == DEADLINE


# -- construction and lifetime ----------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1, 21601, 1.5, True])
def test_token_ttl_bounds(ttl: object) -> None:
    with pytest.raises(ValueError, match="token_ttl_s"):
        AliyunMetadata(token_ttl_s=ttl)  # type: ignore[arg-type]


def test_bad_timeout_or_url() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        AliyunMetadata(timeout_s=0)
    with pytest.raises(ValueError, match="base_url"):
        AliyunMetadata("")
    AliyunMetadata(token_ttl_s=1)
    AliyunMetadata(token_ttl_s=21600)


async def test_conforms_to_dialect_and_lifetime(fake: FakeAliyunMetadata) -> None:
    md = AliyunMetadata()
    assert isinstance(md, MetadataDialect)
    assert md.provider == "aliyun" and md.base_url == "http://100.100.100.200"
    await md.aclose()  # never used: no I/O

    async with aiohttp.ClientSession() as session:
        client = AliyunMetadata(fake.url, hardened=True, session=session)
        assert await client.poll() is None
        await client.aclose()
        await client.aclose()  # idempotent
        assert not session.closed  # borrowed, not ours
        with pytest.raises(RuntimeError, match="closed"):
            await client.poll()


# -- the fake, checked directly ---------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _token(http: aiohttp.ClientSession, fake: FakeAliyunMetadata, ttl: str = "60") -> str:
    async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: ttl}) as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        return await resp.text()


async def test_fake_hardened_refuses_missing_or_bad_token(
    fake: FakeAliyunMetadata, fake_clock: Clock, http: aiohttp.ClientSession
) -> None:
    url = fake.url + "/latest/meta-data/instance-id"
    async with http.get(url) as resp:
        assert resp.status == 401
    async with http.get(url, headers={TOKEN_HEADER: "forged"}) as resp:
        assert resp.status == 401
    token = await _token(http, fake, "60")
    async with http.get(url, headers={TOKEN_HEADER: token}) as resp:
        assert resp.status == 200 and await resp.text() == "i-bp1abc"
    fake_clock.advance(60)  # the TTL has run out
    async with http.get(url, headers={TOKEN_HEADER: token}) as resp:
        assert resp.status == 401


@pytest.mark.parametrize("ttl", [None, "", "0", "21601", "-5", "abc", "1.5"])
async def test_fake_token_put_needs_valid_ttl(
    fake: FakeAliyunMetadata, http: aiohttp.ClientSession, ttl: str | None
) -> None:
    headers = {} if ttl is None else {TTL_HEADER: ttl}
    async with http.put(fake.url + TOKEN_PATH, headers=headers) as resp:
        assert resp.status == 400
    assert fake.token_puts == 0


async def test_fake_token_rules(fake: FakeAliyunMetadata, http: aiohttp.ClientSession) -> None:
    for ttl in ("1", "21600"):
        assert await _token(http, fake, ttl)
    assert fake.token_puts == 2
    async with http.put(  # the AWS header is not the Alibaba one
        fake.url + TOKEN_PATH, headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    ) as resp:
        assert resp.status == 400
    async with http.get(fake.url + TOKEN_PATH) as resp:
        assert resp.status == 405


async def test_fake_normal_mode_serves_without_token(http: aiohttp.ClientSession) -> None:
    async with FakeAliyunMetadata() as fake:
        base = fake.url + "/latest/meta-data/"
        async with http.get(base + "instance/spot/termination-time") as resp:
            assert resp.status == 404
        fake.publish_interruption(time=DEADLINE)
        async with http.get(base + "instance/spot/termination-time") as resp:
            assert (resp.status, resp.content_type, await resp.text()) == (200, "text/plain", STAMP)
        async with http.get(base + "instance-id") as resp:
            assert (await resp.text()).startswith("i-bp1")
        async with http.get(base + "instance-id", headers={TOKEN_HEADER: "bad"}) as resp:
            assert resp.status == 401
        async with http.get(fake.url + "/nowhere") as resp:
            assert resp.status == 404


def test_fake_publish_signature_is_uniform() -> None:
    ours = inspect.signature(FakeAliyunMetadata.publish_interruption)
    assert list(ours.parameters) == ["self", "action", "time"]
    assert str(ours) == "(self, action: 'str' = 'terminate', time: 'datetime | None' = None) -> 'None'"
    fake = FakeAliyunMetadata()
    with pytest.raises(ValueError, match="aware"):
        fake.publish_interruption(time=datetime(2015, 1, 5, 18, 2))
    with pytest.raises(ValueError):
        fake.fail_next(1, status=200)
    with pytest.raises(ValueError):
        fake.hang_next(-1)


async def test_fake_lifecycle() -> None:
    fake = FakeAliyunMetadata(hardened=True)
    with pytest.raises(RuntimeError, match="start"):
        _ = fake.url
    await fake.aclose()  # before start: fine
    await fake.start()
    assert fake.url.startswith("http://127.0.0.1:")
    with pytest.raises(RuntimeError, match="already started"):
        await fake.start()
    fake.hang_next(1)
    async with AliyunMetadata(fake.url, hardened=True, timeout_s=5.0) as client:
        pending = asyncio.create_task(client.poll())
        await asyncio.wait_for(fake.wait_hanging(), timeout=5)  # the token PUT is held
        await fake.aclose()  # releases the held request, then stops
        await fake.aclose()
        with pytest.raises(MetadataUnavailable):
            await pending
